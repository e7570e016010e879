"""Estimates of workloads the compute curve does not describe (``peft``, ``multimodal``): pure.

The fitted curve of :mod:`tessera.perfmodel.compute` composes a ``gpt`` step from
FLOPs, memory traffic and dispatch counts. A multi-task LoRA step (a frozen backbone
over packed chunks of many tasks) or a multimodal step (encoders, projectors and the
LLM under their own quotas) is not one of those stages, so its estimate starts from a
measurement of *its own step shape*: the module key of such a workload
(``tessera.modelkey.shape_key``, e.g. ``peft:l2-h64-a4-s64-v256:w3f2a9c1d0b7e``) names
everything that sets the cost of one step, and a short profiling run of the job files
its steps under that key.

Contract of :func:`estimate` for a valid candidate whose module is of such a workload:

* profiles of the same module and batch (``rows``) and micro-batches at the candidate's
  quota answer directly: the median of their medians; relative error = the points'
  own (``ProfilePoint.rel_std``), or their run-to-run scatter when larger;
* profiles at >= 2 other quotas: the module's own quota curve ``t(q) = a + b / q``
  (a: the serial part, b: the part that divides over the quota; non-negative, fitted on
  relative residuals) evaluated at the candidate's quota; its error: the curve's residual
  scatter (at least ``QUOTA_CURVE``), plus ``EXTRAP_PER_LOG`` per natural-log unit
  outside the profiled quotas;
* one profiled quota only: that point scaled by ``gpt_step(q) / gpt_step(q0)``, the
  device type's fitted ``gpt`` curve for a single-rank step of the candidate's own
  backbone (layers, hidden, heads, vocab, context; its batch and micro-batches): its
  serial parts (dispatch, optimizer, data) stay, only the FLOP and memory terms divide
  over the quota. (Scaling the whole step by the parallel part's ``s(q) / s(q0)``
  alone promised these small steps ~1.9x at 2 cores where they ran at 1.0-1.4x.) It
  is the device's curve, not the module's, and these runtimes change *how* they run
  with the quota (peft: one micro-batch worker per thread; colocated multimodal:
  encoder and LLM on their own cores), so the uncertainty grows by ``QUOTA_TRANSFER``
  per natural-log unit between the two quotas (the confidence of such an estimate is
  low, as it should be);
* colocated (``colocated > 1``): the device's interference for the mode, as for ``gpt``;
* otherwise ``insufficient_data`` naming what is missing. Never a number without data.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from tessera.perfmodel.compute import ComputeFit, ComputeSample, nnls
from tessera.perfmodel.pipeline import MAX_MICRO_BATCHES
from tessera.perfmodel.priors import COLOCATION, EXTRAP_PER_LOG, UNSEEN_MODULE

GPT = "gpt"
QUOTA_CURVE = 0.03     # prior error of a two-quota curve (no residual left to measure it)
QUOTA_TRANSFER = 0.5   # relative error per ln unit of carrying a profile by the device's gpt curve


def workload_of(module: str) -> str:
    """The workload type a module key names (``gpt`` for a key without a type)."""
    return module.split(":", 1)[0] if ":" in module else GPT


def profiled(module: str) -> bool:
    """Whether estimates of ``module`` come from its own profiles (not the gpt curve)."""
    return workload_of(module) != GPT


def invalid(c) -> str:
    """Why candidate ``c`` of a profiled workload is not valid ("" if it is). Its plan
    fields (dp, tp, pp) are not read: the step shape (world size included) is in its
    module key, and these runtimes do not take a gpt plan. As for any candidate:
    1 <= micro_batches <= ``pipeline.MAX_MICRO_BATCHES``, batch >= 1, the model fields
    positive, hidden divisible by heads, 0 <= seq <= seq_len."""
    if min(c.batch, c.micro_batches) < 1 or c.micro_batches > MAX_MICRO_BATCHES:
        return f"invalid candidate (batch >= 1, 1 <= micro_batches <= {MAX_MICRO_BATCHES})"
    if min(c.layers, c.hidden, c.heads, c.vocab, c.seq_len) < 1:
        return "invalid model (layers, hidden, heads, vocab, seq_len >= 1)"
    if c.hidden % c.heads or not 0 <= (c.seq or 0) <= c.seq_len:
        return "invalid model (hidden divisible by heads; 0 <= seq <= seq_len)"
    return quota_problem(c)


def quota_problem(c) -> str:
    """Why a candidate's quota or colocation fields are invalid ("" if they are not); the
    same rule for every candidate (``PerfModel._invalid`` uses it too)."""
    if not (math.isfinite(c.quota) and c.quota > 0):
        return "quota must be a finite number > 0"
    if not math.isfinite(c.oversubscription) or c.oversubscription < 0 or c.colocated < 1:
        return "oversubscription must be a finite number >= 0, colocated >= 1"
    return ""


def quota_curve(qs: list[float], ts: list[float]) -> tuple[float, float, float] | None:
    """(a, b, rel_sigma) of ``t(q) = a + b / q`` fitted to per-quota times (>= 2 distinct
    quotas, all finite and > 0), or None. ``rel_sigma`` is the relative residuals' RMS over
    the degrees of freedom; with none left (two quotas) their plain RMS when the fit
    misses the points (a or b clipped at 0), NaN when it passes through both."""
    q, t = np.asarray(qs, dtype=float), np.asarray(ts, dtype=float)
    if len(set(q.tolist())) < 2 or not (np.isfinite(q).all() and np.isfinite(t).all()) or (q <= 0).any() \
            or (t <= 0).any():
        return None
    x = np.stack([np.ones_like(q), 1.0 / q], axis=1) / t[:, None]
    a, b = nnls(x, np.ones_like(t))
    if not (math.isfinite(a) and math.isfinite(b)) or a + b <= 0:
        return None
    r = (a + b / q - t) / t
    dof = len(q) - 2
    if dof > 0:
        return float(a), float(b), float(math.sqrt(float(r @ r) / dof))
    rms = float(math.sqrt(float(r @ r) / len(q)))
    # Two quotas: an exact fit leaves nothing to measure (NaN); a clipped one (a or b at 0,
    # e.g. a step that gets slower with more quota) misses its own points by rms.
    return float(a), float(b), rms if rms > 1e-9 else math.nan


def gpt_step(fit: ComputeFit, c, q: float) -> float:
    """Seconds of a single-rank ``gpt`` step of candidate ``c``'s backbone (its layers,
    hidden, heads, vocab and context; ``batch`` rows in ``micro_batches``) at quota
    ``q`` on the fitted curve ``fit`` (embedding and head on the one stage)."""
    mbf, stf = ComputeSample(module=c.module, rows=c.batch, seq=c.seq or c.seq_len, layers=c.layers, hidden=c.hidden,
                             heads=c.heads, vocab=c.vocab, q=q, seconds=0.0, micro_batches=c.micro_batches,
                             seq_len=c.seq_len).features()
    return float(c.micro_batches * fit.mb_time(mbf, q) + fit.accumulation_time(stf["params"], c.micro_batches, q)
                 + fit.step_time(stf, q))


def _group(points) -> tuple[float, float, int]:
    """(seconds, rel_std, steps) of the profile points of one quota: the median of their
    medians; the larger of their own error and their run-to-run scatter."""
    secs = [p.seconds for p in points]
    med = statistics.median(secs)
    r = statistics.median(p.rel_std() for p in points)
    if len(secs) >= 2:
        r = max(r, statistics.stdev(secs) / statistics.fmean(secs))
    return med, r, sum(p.steps for p in points)


def estimate(c, points, fit: ComputeFit | None, interference: dict) -> tuple[float, float, dict, str] | str:
    """``(seconds, rel_std, breakdown, reason)`` of candidate ``c`` (see module doc) from
    its device type's profile points, fitted compute curve (or None) and interference
    coefficients; or the reason there is none (a str). seconds and rel_std are finite
    and > 0."""
    insufficient = str
    mine = [p for p in points if p.module == c.module and p.rows == c.batch
            and p.micro_batches == c.micro_batches and p.usable()]
    if not mine:
        return insufficient(f"no profile of {c.module} at batch {c.batch} on {c.device_type!r}")
    by_q: dict[float, list] = {}
    for p in mine:
        by_q.setdefault(round(p.q, 9), []).append(p)
    q = float(c.quota)
    groups = {qq: _group(ps) for qq, ps in sorted(by_q.items())}
    breakdown: dict[str, float] = {}
    if round(q, 9) in groups:
        seconds, r, steps = groups[round(q, 9)]
        breakdown["profile"] = seconds
        reason = f"measured profile of this workload's step ({steps} steps) at quota {q:g}"
    elif len(groups) >= 2:
        qs = list(groups)
        curve = quota_curve(qs, [groups[k][0] for k in qs])
        if curve is None:
            return insufficient(f"profiles of {c.module} give no quota curve")
        a, b, sig = curve
        seconds = a + b / q
        d = max(0.0, math.log(q / max(qs))) + max(0.0, math.log(min(qs) / q))
        own = statistics.median(groups[k][1] for k in qs)
        r = math.sqrt(own ** 2 + (QUOTA_CURVE if math.isnan(sig) else max(sig, QUOTA_CURVE)) ** 2
                      + (EXTRAP_PER_LOG * d) ** 2)
        breakdown.update(serial=a, parallel=b / q, extrapolation=d)
        reason = f"this workload's own quota curve from profiles at quotas {', '.join(f'{k:g}' for k in qs)}"
    else:
        q0 = next(iter(groups))
        if fit is None or fit.status != "ok":
            return insufficient(f"{c.module} was profiled at quota {q0:g} only, and {c.device_type!r} has no fitted "
                                f"compute curve to scale it to quota {q:g}")
        t0, r0, steps = groups[q0]
        t_q, t_q0 = gpt_step(fit, c, q), gpt_step(fit, c, q0)
        scale = t_q / t_q0 if math.isfinite(t_q0) and t_q0 > 0 else math.nan
        if not (math.isfinite(scale) and scale > 0):
            return insufficient(f"{c.device_type!r}'s fitted compute curve gives no time for {c.module}'s backbone")
        seconds = t0 * scale
        d = abs(math.log(q / q0))
        r = math.sqrt(r0 ** 2 + UNSEEN_MODULE ** 2 + (QUOTA_TRANSFER * d) ** 2)
        breakdown.update(profile=t0, quota_scale=scale)
        reason = (f"measured profile of this workload's step at quota {q0:g}, scaled to {q:g} by "
                  f"{c.device_type}'s fitted curve for a step of its backbone")
    if c.colocated > 1:
        mode, stretch = colocation_stretch(c, interference)
        if stretch is None:
            return insufficient(f"no colocation ({mode}) profile for device type {c.device_type!r}")
        seconds *= stretch
        r = math.sqrt(r * r + COLOCATION ** 2)
        breakdown["colocation"] = stretch
    if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(r) and r > 0):
        return insufficient("the profiles give no finite positive time for this candidate")
    return float(seconds), float(r), breakdown, reason


def colocation_stretch(c, interference: dict) -> tuple[str, float | None]:
    """(mode, factor) of a one-rank candidate sharing its device (``colocated`` > 1) over
    its time alone: mode "shared" when the quotas oversubscribe the device (time
    slicing), else "split" (what ``model.interference_mode`` gives a one-rank plan);
    factor = oversubscription x (1 + g (colocated - 1)), g the device type's fitted
    interference for the mode (``interference``: mode -> g), as fitted; None without one.
    Pure."""
    mode = "shared" if c.oversubscription > 1 else "split"
    g = interference.get(mode)
    if g is None:
        return mode, None
    return mode, max(c.oversubscription, 1.0) * (1.0 + g * (c.colocated - 1))
