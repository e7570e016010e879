"""Measured inputs for the live policy, folded from executor reports into ``JobStatus``.

Contract (pure functions over protos and floats; no etcd, gRPC or clock):

* :func:`step_encoder_share` — one PROGRESS report's ``modules`` map -> the encoder's share
  of module *compute* in that step: encoder (forward + backward) / (encoder + LLM)
  (forward + backward). Communication and idle time are left out on purpose: they depend
  on the current encoder:LLM rank split, whereas the policy's reshard rule
  (``controller.policy.multiplex.reshard_action``) needs the split-independent work mix.
  None when either module is missing or the compute sum is not positive.
* :func:`fold_encoder_share` — EWMA of those samples: the first sample (previous value
  0 = "not measured yet") is taken as is, later ones move the value by ``alpha``. A report
  without a usable sample leaves the value unchanged. The result lies in (0, 1] once
  measured (a true share of exactly 0 reads as "not measured", which is harmless: the
  policy then keeps the current split). A non-finite timing (NaN, inf) is no sample; a
  non-finite previous value reads as "not measured".
* :func:`fold_busy` — EWMA (same ``alpha``; first sample taken as is) of an executor's
  PROGRESS ``busy`` (CPU busy fraction of its quota, [0, 1]) into ``JobStatus.busy``;
  floored at :data:`MIN_BUSY` so that 0 keeps meaning "not measured". A report without
  ``busy`` (None) or with a non-finite one leaves the value unchanged; a non-finite
  previous value reads as "not measured".
* :func:`group_demands` — the members' demand in a colocation group (what
  ``multiplex.repartition_action`` reads as ``JobView.gpu_fraction``). Rule:

  - a measured member (busy > 0) demands what it uses: ``busy x quota`` (a share of the
    partition); an unmeasured one demands its requested share;
  - the slack ``1 - sum(demands)``, when positive, goes to the *saturated* measured
    members (busy >= :data:`SATURATED`), in proportion to their demand — a member that
    uses all its cores may need more, and cores another member leaves idle are free;
  - when no member is saturated, the slack goes to all measured members in proportion
    to their demand: the partition is divided by measured use rather than left partly
    unassigned. (Giving the idle share up to nobody shrank *every* member — the busiest
    too, e.g. a compute-bound job that a loaded machine holds below :data:`SATURATED` —
    and left cores that no one could use; on MPS that was a relaunch for nothing.)

  So a member that leaves its cores idle gives them up and a saturated (or busier) one
  grows; members using their shares alike keep them; with nothing measured the demands
  are the requested shares (the previous behaviour).
"""

from __future__ import annotations

import math
from typing import Mapping

ALPHA = 0.3  # weight of the newest step: ~3 reports to follow a shift, smooths one noisy step


def _compute_s(m) -> float:
    return max(float(m.forward_s), 0.0) + max(float(m.backward_s), 0.0)


def step_encoder_share(modules: Mapping) -> float | None:
    """Encoder share of one step's module compute, or None (see the module docstring)."""
    enc, llm = modules.get("encoder"), modules.get("llm")
    if enc is None or llm is None:
        return None
    if not all(math.isfinite(float(t)) for m in (enc, llm) for t in (m.forward_s, m.backward_s)):
        return None
    e, total = _compute_s(enc), _compute_s(enc) + _compute_s(llm)
    if not (math.isfinite(e) and math.isfinite(total)) or total <= 0.0:
        return None  # a NaN / inf timing is no sample (inf / inf would be NaN)
    return e / total


def fold_encoder_share(prev: float, modules: Mapping, alpha: float = ALPHA) -> float:
    """``prev`` updated with the report's sample (see the module docstring)."""
    if not math.isfinite(prev):
        prev = 0.0  # a non-finite stored share reads as "not measured"
    s = step_encoder_share(modules)
    if s is None or not math.isfinite(s):
        return prev
    if prev <= 0.0:
        return s
    return alpha * s + (1.0 - alpha) * prev


MIN_BUSY = 0.001  # a measured busy fraction is stored at least this (0 = not measured)
SATURATED = 0.9   # busy fraction from which a member is taken to want more than its quota


def fold_busy(prev: float, sample: float | None, alpha: float = ALPHA) -> float:
    """``prev`` (``JobStatus.busy``; 0 = not measured) updated with one report's ``busy``
    sample (None: no sample, unchanged). Samples are clamped to [0, 1]."""
    if not math.isfinite(prev):
        prev = 0.0  # a non-finite stored value reads as "not measured"
    if sample is None or not math.isfinite(float(sample)):
        return prev
    s = min(max(float(sample), 0.0), 1.0)
    v = s if prev <= 0.0 else alpha * s + (1.0 - alpha) * prev
    return max(v, MIN_BUSY)


def group_demands(members: Mapping[str, tuple[float, float, float]]) -> dict[str, float]:
    """Demand (share of the partition) of each member of one colocation group, by the rule
    in the module docstring. ``members``: job id -> (current quota, busy, requested share),
    busy 0 = not measured."""
    members = {j: (q, busy if math.isfinite(busy) else 0.0, req) for j, (q, busy, req) in members.items()}
    d = {j: (busy * q if busy > 0.0 else req) for j, (q, busy, req) in members.items()}
    slack = 1.0 - sum(d.values())
    hot = {j: d[j] for j, (_, busy, _) in members.items() if busy >= SATURATED}
    if not hot:
        hot = {j: d[j] for j, (_, busy, _) in members.items() if busy > 0.0}
    base = sum(hot.values())
    if slack > 0.0 and base > 0.0:
        for j, v in hot.items():
            d[j] = v + slack * v / base
    return d
