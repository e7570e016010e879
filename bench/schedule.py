"""Scheduling benchmark: every policy on the same trace, cluster and ground truth.

    python -m bench.schedule --trace ../shared/arena/philly_trace.csv \\
        --iter-times ../shared/arena/iter_time_optimal.json \\
        --cluster ../shared/arena/cluster_1280.json --json out.json --plot jct_cdf.png

Prints a table of every policy side by side (exact estimates), then the same with the
estimator's error injected (log-normal, ``--error`` sigma) into what the policies see;
the simulator's ground truth is always the measured table. Writes JSON (per policy
``avg_jct``, ``p99_jct``, ``makespan``, ``finished`` and more; top-level
``jct_reduction_vs_fcfs`` and ``jct_reduction_vs_best_baseline`` for Tessera) and a
CDF plot of JCT (PNG, needs matplotlib). ``--openb`` adds the multiplexing experiment on
Alibaba's GPU-sharing trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from controller.policy import FCFSPolicy, GavelPolicy, SiaPolicy, TableEstimator, TesseraPolicy
from controller.sim import Simulator, convert_openb, load_arena_trace, load_cluster, load_iter_times, summarize
from controller.sim.traces import cluster_nodes

POLICIES = {
    "fcfs": FCFSPolicy,
    "gavel": GavelPolicy,
    "sia": SiaPolicy,
    "tessera-nomux": lambda: TesseraPolicy(multiplexing=False),
    "tessera": TesseraPolicy,
}
BASELINES = ("fcfs", "gavel", "sia", "tessera-nomux")
PUBLISHED = ("fcfs", "gavel", "sia")


def _one(args: tuple) -> tuple[str, dict, list[float]]:
    """Run one policy (in a worker process); returns its metrics and JCTs."""
    name, trace, iter_times, cluster, error, seed, round_s, limit, openb = args
    table = load_iter_times(iter_times)
    if openb:
        jobs = convert_openb(openb, table, limit=limit)
        nodes = cluster_nodes(json.loads(cluster)) if cluster.startswith("{") else load_cluster(cluster)
    else:
        jobs = load_arena_trace(trace, limit=limit)
        nodes = load_cluster(cluster)
    truth = TableEstimator(table)
    seen = TableEstimator(table, error=error, seed=seed) if error > 0 else TableEstimator(table)
    t0 = time.perf_counter()
    res = Simulator(nodes, jobs, truth, POLICIES[name](), seen, round_s=round_s).run()
    m = summarize(res)
    m["sim_wall_s"] = round(time.perf_counter() - t0, 1)
    jct = sorted(r.finish - r.submit for r in res.records.values() if r.finish is not None)
    return name, m, jct


def reductions(ms: dict[str, dict], key: str = "avg_jct", baselines=BASELINES) -> dict:
    """Tessera's fractional reduction of ``key`` vs FCFS and vs the best baseline."""
    t = ms["tessera"][key]
    present = [b for b in baselines if b in ms]
    # "Best baseline" is the best published scheduler (FCFS, Gavel, Sia); the ablation
    # without multiplexing is reported beside it (it is Tessera itself, less one part).
    best = min([b for b in PUBLISHED if b in ms], key=lambda b: ms[b][key])
    return {
        f"{key}_reduction_vs_fcfs": 1 - t / ms["fcfs"][key] if ms["fcfs"][key] else 0.0,
        f"{key}_reduction_vs_best_baseline": 1 - t / ms[best][key] if ms[best][key] else 0.0,
        f"{key}_best_baseline": best,
        f"{key}_reduction_vs": {b: (1 - t / ms[b][key]) if ms[b][key] else 0.0 for b in present},
    }


def run_all(names, trace, iter_times, cluster, error, seed, round_s, limit, workers, openb=None):
    jobs = [(n, trace, iter_times, cluster, error, seed, round_s, limit, openb) for n in names]
    if workers <= 1:
        out = [_one(j) for j in jobs]
    else:
        with ProcessPoolExecutor(workers) as ex:
            out = list(ex.map(_one, jobs))
    return {n: m for n, m, _ in out}, {n: j for n, _, j in out}


H = 3600.0
COLS = [("finished", "fin", "{:d}"), ("avg_jct", "avg JCT h", "{:.1f}"), ("median_jct", "med JCT h", "{:.1f}"),
        ("p99_jct", "p99 JCT h", "{:.0f}"), ("makespan", "makespan h", "{:.0f}"), ("avg_queue", "queue h", "{:.1f}"),
        ("finished_in_horizon", "fin@2000r", "{:d}"), ("arena_avg_jct", "Arena JCT h", "{:.1f}"),
        ("avg_norm_throughput_in_horizon", "tput@2000r", "{:.0f}"), ("gpu_util", "util", "{:.2f}"),
        ("decision_ms_median", "ms/round", "{:.1f}"), ("restarts", "restarts", "{:d}")]


def table(ms: dict[str, dict]) -> str:
    """Policies side by side, times in hours."""
    head = f"{'policy':<14}" + "".join(f"{c[1]:>12}" for c in COLS)
    lines = [head, "-" * len(head)]
    for n, m in ms.items():
        cells = []
        for k, _, fmt in COLS:
            v = m[k]
            if k in ("avg_jct", "median_jct", "p99_jct", "makespan", "avg_queue", "arena_avg_jct"):
                v = v / H
            cells.append(f"{fmt.format(v):>12}")
        lines.append(f"{n:<14}" + "".join(cells))
    return "\n".join(lines)


def plot(jcts: dict[str, list[float]], path: str, title: str, jcts_err: dict | None = None) -> None:
    """CDF of JCT per policy (log hours)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, xs in jcts.items():
        if xs:
            ax.plot([x / H for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], label=n)
    for n, xs in (jcts_err or {}).items():
        if xs and n == "tessera":
            ax.plot([x / H for x in xs], [(i + 1) / len(xs) for i in range(len(xs))], "--", label=f"{n} (est. error)")
    ax.set_xscale("log")
    ax.set_xlabel("JCT (hours, log)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="../shared/arena/philly_trace.csv")
    ap.add_argument("--iter-times", default="../shared/arena/iter_time_optimal.json")
    ap.add_argument("--cluster", default="../shared/arena/cluster_1280.json")
    ap.add_argument("--json", dest="json_path")
    ap.add_argument("--plot", dest="plot_path")
    ap.add_argument("--error", type=float, default=0.2, help="sigma of the log-normal estimate error (0: skip)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--round-s", type=float, default=300.0)
    ap.add_argument("--limit", type=int, default=None, help="first N jobs only")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--openb", default=None, help="also run the openb GPU-sharing trace (CSV path)")
    ap.add_argument("--openb-limit", type=int, default=3000)
    ap.add_argument("--openb-cluster", default='{"a10": [40, 2], "a40": [40, 2]}')
    a = ap.parse_args(argv)
    names = [n for n in a.policies.split(",") if n]
    out: dict = {"config": {"trace": a.trace, "iter_times": a.iter_times, "cluster": a.cluster,
                            "round_s": a.round_s, "limit": a.limit, "error_sigma": a.error}}
    t0 = time.time()
    ms, jcts = run_all(names, a.trace, a.iter_times, a.cluster, 0.0, a.seed, a.round_s, a.limit, a.workers)
    print(f"== exact estimates ({time.time() - t0:.0f} s)")
    print(table(ms))
    out.update({n: ms[n] for n in names})
    out["policies"] = names
    if "tessera" in ms and "fcfs" in ms:
        r = reductions(ms)
        out["jct_reduction_vs_fcfs"] = r["avg_jct_reduction_vs_fcfs"]
        out["jct_reduction_vs_best_baseline"] = r["avg_jct_reduction_vs_best_baseline"]
        out["best_baseline"] = r["avg_jct_best_baseline"]
        if "tessera-nomux" in ms:
            out["jct_reduction_vs_tessera_nomux"] = r["avg_jct_reduction_vs"]["tessera-nomux"]
        out["reductions"] = r
        out["arena_measure_reductions"] = reductions(ms, "arena_avg_jct")
        out["p99_jct_reductions"] = reductions(ms, "p99_jct")
        print(f"Tessera avg JCT: {r['avg_jct_reduction_vs_fcfs']:.1%} below FCFS, "
              f"{r['avg_jct_reduction_vs_best_baseline']:.1%} below the best baseline ({r['avg_jct_best_baseline']}); "
              + ", ".join(f"{b} {v:.1%}" for b, v in r["avg_jct_reduction_vs"].items()))
        ar = out["arena_measure_reductions"]
        print("Arena's measure (avg JCT of jobs done within 2,000 rounds): "
              + ", ".join(f"{b} {v:.1%}" for b, v in ar["arena_avg_jct_reduction_vs"].items()))
    jcts_err = None
    if a.error > 0:
        t0 = time.time()
        ms_e, jcts_err = run_all(names, a.trace, a.iter_times, a.cluster, a.error, a.seed, a.round_s, a.limit,
                                 a.workers)
        print(f"\n== estimator error injected: log-normal sigma {a.error} ({time.time() - t0:.0f} s)")
        print(table(ms_e))
        blk: dict = {"sigma": a.error, **{n: ms_e[n] for n in names}}
        if "tessera" in ms_e and "fcfs" in ms_e:
            r = reductions(ms_e)
            blk["jct_reduction_vs_fcfs"] = r["avg_jct_reduction_vs_fcfs"]
            blk["jct_reduction_vs_best_baseline"] = r["avg_jct_reduction_vs_best_baseline"]
            blk["reductions"] = r
            print(f"Tessera avg JCT: {r['avg_jct_reduction_vs_fcfs']:.1%} below FCFS, "
                  f"{r['avg_jct_reduction_vs_best_baseline']:.1%} below the best baseline ({r['avg_jct_best_baseline']})")
        out["with_error"] = blk
    if a.openb:
        t0 = time.time()
        on = [n for n in ("fcfs", "tessera-nomux", "tessera") if n in names]
        ms_o, _ = run_all(on, None, a.iter_times, a.openb_cluster, 0.0, a.seed, a.round_s, a.openb_limit,
                          a.workers, openb=a.openb)
        print(f"\n== openb GPU-sharing trace, first {a.openb_limit} GPU pods ({time.time() - t0:.0f} s)")
        print(table(ms_o))
        out["openb"] = {"trace": a.openb, "limit": a.openb_limit, "cluster": a.openb_cluster, **ms_o}
        if "tessera-nomux" in ms_o:
            out["openb"]["multiplexing_jct_reduction"] = 1 - ms_o["tessera"]["avg_jct"] / ms_o["tessera-nomux"]["avg_jct"]
            print(f"multiplexing cuts avg JCT by {out['openb']['multiplexing_jct_reduction']:.1%} vs Tessera without it")
    if a.json_path:
        with open(a.json_path, "w") as f:
            json.dump(out, f, indent=1, sort_keys=False)
    if a.plot_path:
        try:
            plot(jcts, a.plot_path, f"JCT CDF ({len(next(iter(jcts.values())))} jobs finished)", jcts_err)
        except ImportError:
            print("matplotlib is not installed: no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
