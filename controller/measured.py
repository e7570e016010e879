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
  policy then keeps the current split).
"""

from __future__ import annotations

from typing import Mapping

ALPHA = 0.3  # weight of the newest step: ~3 reports to follow a shift, smooths one noisy step


def _compute_s(m) -> float:
    return max(float(m.forward_s), 0.0) + max(float(m.backward_s), 0.0)


def step_encoder_share(modules: Mapping) -> float | None:
    """Encoder share of one step's module compute, or None (see the module docstring)."""
    enc, llm = modules.get("encoder"), modules.get("llm")
    if enc is None or llm is None:
        return None
    e, total = _compute_s(enc), _compute_s(enc) + _compute_s(llm)
    if total <= 0.0:
        return None
    return e / total


def fold_encoder_share(prev: float, modules: Mapping, alpha: float = ALPHA) -> float:
    """``prev`` updated with the report's sample (see the module docstring)."""
    s = step_encoder_share(modules)
    if s is None:
        return prev
    if prev <= 0.0:
        return s
    return alpha * s + (1.0 - alpha) * prev
