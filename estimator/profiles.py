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
    that report that phase); ``None`` when there are no samples."""
    samples = list(samples)
    if not samples:
        return None
    times = sorted(s.step_time_s for s in samples)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for s in samples:
        for k, v in s.phases.items():
            sums[k] = sums.get(k, 0.0) + v
            counts[k] = counts.get(k, 0) + 1
    return Summary(
        samples=len(samples),
        mean_step_time_s=math.fsum(times) / len(times),
        p50_step_time_s=percentile(times, 0.5),
        p90_step_time_s=percentile(times, 0.9),
        mean_phases={k: sums[k] / counts[k] for k in sorted(sums)},
        last_time=max(s.time for s in samples),
    )
