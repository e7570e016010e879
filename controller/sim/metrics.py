"""Numbers from a ``SimResult``: JCT statistics, makespan, queueing, throughput, rounds."""

from __future__ import annotations

import statistics

from .engine import SimResult

ARENA_ROUNDS = 2000      # Arena's measure: jobs finished within 2,000 rounds ...
ARENA_ROUND_S = 300.0    # ... of 300 s


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for an empty list."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def summarize(res: SimResult, horizon_s: float | None = None) -> dict:
    """Metrics of a run. JCT = finish - submit over jobs run to completion; ``arena_*``
    counts only jobs finished within 2,000 rounds of 300 s from the first submission."""
    recs = list(res.records.values())
    fin = [r for r in recs if r.finish is not None]
    jct = [r.finish - r.submit for r in fin]
    queue = [r.waited for r in fin]
    horizon = horizon_s if horizon_s is not None else ARENA_ROUNDS * ARENA_ROUND_S
    within = [r.finish - r.submit for r in fin if r.finish - res.start <= horizon]
    span = sum(dt for _, dt, _, _ in res.throughput) or 1.0
    busy = sum(dt * b for _, dt, b, _ in res.throughput) / span
    tput = sum(dt * x for _, dt, _, x in res.throughput) / span
    in_h = [(t, dt, b, x) for t, dt, b, x in res.throughput if t - res.start < horizon]
    span_h = sum(dt for _, dt, _, _ in in_h) or 1.0
    dm = res.decision_ms
    return {
        "jobs": len(recs),
        "finished": len(fin),
        "avg_jct": statistics.fmean(jct) if jct else 0.0,
        "median_jct": statistics.median(jct) if jct else 0.0,
        "p99_jct": percentile(jct, 99),
        "makespan": (max(r.finish for r in fin) - res.start) if fin else 0.0,
        "avg_queue": statistics.fmean(queue) if queue else 0.0,
        "p99_queue": percentile(queue, 99),
        "finished_in_horizon": len(within),
        "arena_avg_jct": statistics.fmean(within) if within else 0.0,
        "avg_busy_gpus": busy,
        "gpu_util": busy / res.total_gpus if res.total_gpus else 0.0,
        "avg_norm_throughput": tput,
        "avg_norm_throughput_in_horizon": sum(dt * x for _, dt, _, x in in_h) / span_h,
        "peak_norm_throughput": max((x for _, _, _, x in res.throughput), default=0.0),
        "restarts": sum(r.restarts for r in recs),
        "rounds_decided": len(dm),
        "decision_ms_median": statistics.median(dm) if dm else 0.0,
        "decision_ms_p99": percentile(dm, 99),
        "max_device_usage": res.max_usage,
        "actions": dict(sorted(res.actions.items())),
    }


def throughput_series(res: SimResult, bucket_s: float = 3600.0) -> list[tuple[float, float]]:
    """Normalised cluster throughput averaged per ``bucket_s`` (hours since start, value)."""
    acc: dict[int, list[float]] = {}
    for t, dt, _, x in res.throughput:
        b = int((t - res.start) // bucket_s)
        a = acc.setdefault(b, [0.0, 0.0])
        a[0] += dt * x
        a[1] += dt
    return [(b * bucket_s / 3600.0, v[0] / v[1]) for b, v in sorted(acc.items()) if v[1] > 0]
