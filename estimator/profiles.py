"""Aggregation of step measurements into a profile (pure: no I/O, no clock)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepSample:
    """One step timing as the estimator keeps it in memory."""

    step_time_s: float
    phases: Mapping[str, float] = field(default_factory=dict)
    time: float = 0.0


@dataclass(frozen=True)
class Summary:
    samples: int
    mean_step_time_s: float
    p50_step_time_s: float
    p90_step_time_s: float
    mean_phases: dict[str, float]
    last_time: float


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of already sorted values, linear between closest ranks
    (numpy's default). Raises ValueError on an empty list."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples: Iterable[StepSample]) -> Summary | None:
    """Mean, p50, p90 of the step time and the mean of each phase (over the samples
    that report that phase); ``None`` when there are no samples with a finite step time.
    Overflow-safe (means are sums of value/n, never above the largest value), and never
    NaN/inf out: a non-finite step time, phase value or time (only in a log written before
    ``tessera.measurement.malformed`` refused them) is left out of the step-time statistics
    and ``samples`` (which count the finite step times) / of its phase's mean / of
    ``last_time``."""
    samples = list(samples)
    times = sorted(s.step_time_s for s in samples if math.isfinite(s.step_time_s))
    if not times:
        return None
    phases: dict[str, list[float]] = {}
    for s in samples:
        for k, v in s.phases.items():
            if math.isfinite(v):
                phases.setdefault(k, []).append(v)
    stamps = [s.time for s in samples if math.isfinite(s.time)]
    return Summary(
        samples=len(times),
        mean_step_time_s=math.fsum(t / len(times) for t in times),
        p50_step_time_s=percentile(times, 0.5),
        p90_step_time_s=percentile(times, 0.9),
        mean_phases={k: math.fsum(v / len(vs) for v in vs) for k, vs in sorted(phases.items())},
        last_time=max(stamps, default=0.0),
    )
