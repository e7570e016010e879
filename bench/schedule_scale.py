"""Decision time per round as the cluster grows.

    python -m bench.schedule_scale --json scale.json

For each size, a cluster with Arena's mix of device types (A100 x4, V100 x16, A40 x2,
A10 x2 per node, equal GPUs of each type) and a synthetic trace of jobs over the measured
models (twice as many jobs as GPUs at 1,280 GPUs: 2,000 jobs; 20,000 jobs at 10,000
GPUs) arriving over the first rounds. The simulator drives the Tessera policy every
round (300 s); the median wall time of ``schedule()`` per round is reported, the first
(cold-cache) round excluded. Writes ``round_ms``: GPU count (string) -> median ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from controller.policy import TableEstimator, TesseraPolicy
from controller.sim import Simulator, cluster_nodes, load_iter_times, synthetic_trace

SIZES = ((1280, 2000), (2560, 5000), (5120, 10000), (10000, 20000))
PER_NODE = {"a100": 4, "v100": 16, "a40": 2, "a10": 2}


def cluster_for(gpus: int) -> dict[str, tuple[int, int]]:
    """Arena's type mix scaled to ``gpus`` (a quarter of the GPUs per type, rounded to nodes)."""
    spec, left = {}, gpus
    for i, (t, per) in enumerate(PER_NODE.items()):
        share = left if i == len(PER_NODE) - 1 else gpus // 4
        spec[t] = (max(1, round(share / per)), per)
        left -= spec[t][0] * per
    return spec


def measure(gpus: int, n_jobs: int, table, rounds: int, seed: int = 0, multiplexing: bool = True) -> dict:
    """Median/p90 ms per round of Tessera on a loaded cluster of ``gpus`` GPUs."""
    spec = cluster_for(gpus)
    nodes = cluster_nodes(spec)
    # Long jobs so the cluster stays full; arrivals spread so every round has new work.
    jobs = synthetic_trace(n_jobs, table, list(spec), seed=seed, span_s=300.0 * rounds, max_gpu=16)
    jobs = [j.__class__(**{**j.__dict__, "iterations": j.iterations * 1000}) for j in jobs]
    est = TableEstimator(table)
    sim = Simulator(nodes, jobs, est, TesseraPolicy(multiplexing=multiplexing), est, round_s=300.0,
                    idle_call_rounds=1, max_time=jobs[0].submit + 300.0 * rounds)
    t0 = time.perf_counter()
    res = sim.run()
    ms = res.decision_ms[1:] or res.decision_ms
    return {"gpus": sum(n * g for n, g in spec.values()), "jobs": n_jobs, "rounds": len(res.decision_ms),
            "median_ms": statistics.median(ms), "p90_ms": sorted(ms)[int(0.9 * (len(ms) - 1))],
            "first_round_ms": res.decision_ms[0], "running_at_end": len(sim.running),
            "pending_at_end": len(sim.pending), "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iter-times", default="../shared/arena/iter_time_optimal.json")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--sizes", default=",".join(f"{g}:{j}" for g, j in SIZES), help="GPUS:JOBS,...")
    a = ap.parse_args(argv)
    table = load_iter_times(a.iter_times)
    rows = {}
    print(f"{'GPUs':>7} {'jobs':>7} {'rounds':>7} {'median ms':>10} {'p90 ms':>8} {'first ms':>9} {'running':>8} {'pending':>8}")
    for spec in a.sizes.split(","):
        g, j = (int(x) for x in spec.split(":"))
        m = measure(g, j, table, a.rounds)
        rows[str(g)] = m
        print(f"{m['gpus']:>7} {j:>7} {m['rounds']:>7} {m['median_ms']:>10.1f} {m['p90_ms']:>8.1f} "
              f"{m['first_round_ms']:>9.1f} {m['running_at_end']:>8} {m['pending_at_end']:>8}", flush=True)
    out = {"round_ms": {k: round(v["median_ms"], 2) for k, v in rows.items()}, "detail": rows,
           "goals_ms": {"1280": 100, "10000": 1000}}
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
