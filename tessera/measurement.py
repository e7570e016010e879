"""What makes a measurement malformed (pure; shared by profilerd and the estimator).

The estimator refuses a whole MeasurementBatch (INVALID_ARGUMENT, naming
``measurements[i].<field>``) when one of its measurements is malformed; profilerd
refuses the same measurement at ReportStep, so it is never buffered and cannot block
its stream. Both call ``malformed`` here, so they cannot disagree.

What is merely not a model input (a multi-rank run, another workload, a kind this
version does not know) is not malformed: it is stored, not refused.
"""

from __future__ import annotations

import math

# A run's steps make a profile point when at least PROFILE_MIN_MEASURED remain after its
# PROFILE_WARMUP_STEPS first (the estimator's rule; the controller's profile_steps must allow it).
PROFILE_WARMUP_STEPS = 2
PROFILE_MIN_MEASURED = 3

# Fields of an estimator run key after (job_id, device_kind, module): integers in this order.
RUN_INTS = ("layers", "hidden", "heads", "vocab", "seq_len", "batch", "micro_batches")
# Labels a step measurement's run key parses as numbers (``malformed`` checks them).
NUMERIC_LABELS = ("world_size",) + RUN_INTS + ("threads", "quota", "colocated")
# Modules a runtime breaks a step into (multimodal: after the whole step's ``progress``
# event, one per module — ``module: encoder|llm`` — with that module's phases and the
# step's wall time repeated). Such a step measurement is a breakdown of a step already
# reported, not another step: the estimator keeps it out of its step windows.
BREAKDOWN_MODULES = ("encoder", "llm")
# Plausibility bound of a step time and of each phase (seconds: ~11.6 days). Anything
# larger is a unit or clock bug, and would overflow the estimator's sums and medians.
MAX_STEP_TIME_S = 1e6
# A comm row's values beyond bytes / world / seconds, present on some rows only
# (profilerd.commbench ``--sync``): ``compute_s`` on the sync rows (the straggler
# term), ``idle_s`` on the refill row (the pipeline's refill after idling).
COMM_OPTIONAL_VALUES = ("compute_s", "idle_s")
# Values of the row kinds that must be finite numbers when present.
ROW_VALUES = {"comm": ("bytes", "world", "seconds") + COMM_OPTIONAL_VALUES,
              "colocation": ("colocated", "oversubscription", "alone_s", "together_s"),
              "ranks": ("seconds", "quota")}
# The row values that are measured durations (seconds), and the shortest one that can be
# real: one nanosecond, about one tick of the clocks that time them (profilerd.commbench
# floors its rows at 1e-6 s). A positive time below it is no measurement, and as a
# divisor in the fits (together_s / alone_s, seconds / refill(idle_s), the comm fits'
# relative residuals) it overflows them to inf. 0 (or below) is not refused: the row is
# simply no model input (a missing optional value reads 0).
ROW_TIMES = {"comm": ("seconds",) + COMM_OPTIONAL_VALUES, "colocation": ("alone_s", "together_s"),
             "ranks": ("seconds",)}
MIN_TIME_S = 1e-9


def number(x) -> float | None:
    """``x`` (a label string or a value) as a finite float, or None (unparseable, NaN, inf)."""
    try:
        v = float(x)
    except (ValueError, OverflowError, TypeError):
        return None
    return v if math.isfinite(v) else None


def malformed(m) -> str | None:
    """"<field>: why" for a measurement whose model inputs are not numbers, else None:
    a ``time`` that is NaN/inf (any kind); for a step, a ``step_time_s`` or a
    ``phases.<name>`` that is NaN/inf, negative or above ``MAX_STEP_TIME_S``, or a numeric
    label that does not parse; a NaN/inf value of a comm, colocation or ranks row, or a
    duration of one (``ROW_TIMES``) that is positive but below ``MIN_TIME_S``."""
    if not math.isfinite(m.time):
        return f"time: must be a finite number, got {m.time}"
    if m.kind == "step":
        if not (math.isfinite(m.step_time_s) and 0 <= m.step_time_s <= MAX_STEP_TIME_S):
            return f"step_time_s: must be a finite number in [0, {MAX_STEP_TIME_S:g}] seconds, got {m.step_time_s}"
        for k in sorted(m.phases):
            v = m.phases[k]
            if not (math.isfinite(v) and 0 <= v <= MAX_STEP_TIME_S):
                return f"phases.{k}: must be a finite number in [0, {MAX_STEP_TIME_S:g}] seconds, got {v}"
        for k in NUMERIC_LABELS:
            if k in m.labels and m.labels[k] != "" and number(m.labels[k]) is None:
                return f"labels.{k}: must be a finite number, got {m.labels[k]!r}"
    for k in ROW_VALUES.get(m.kind, ()):
        if k in m.values and not math.isfinite(m.values[k]):
            return f"values.{k}: must be a finite number, got {m.values[k]}"
    for k in ROW_TIMES.get(m.kind, ()):
        if k in m.values and 0 < m.values[k] < MIN_TIME_S:
            return f"values.{k}: must be 0 or at least {MIN_TIME_S:g} seconds (a measured time), got {m.values[k]!r}"
    return None
