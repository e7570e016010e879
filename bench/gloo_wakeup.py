"""Gloo collectives and parallel training steps with gloo's loop threads at SCHED_OTHER
(gloo as shipped) and at SCHED_BATCH (:mod:`tessera.gloo`, what the runtime does).

    python -m bench.gloo_wakeup [--reps 80] [--rounds 2] [--json PATH]

Part 1: two ranks pinned one core each run an all-reduce of 4 KiB-1 MiB ``--reps``
times, each after ~1 ms of matmul (as in a training step), in both modes, the modes
alternating ``--rounds`` times; the later rank's time per call (the collective's own
cost, not the wait for a late partner). Part 2: real training steps of two models under
tp=2, dp=2 and pp=2 (4 micro-batches) (bench._measure.run_jobs, gloo over loopback, one
core a rank), both modes alternating ``--rounds`` times; the median step of the faster
round.

Prints a table; ``--json`` writes ``allreduce`` (per size and mode: mean/median/p90 ms,
``slow_frac`` = calls over 1.5 ms), ``steps_ms`` (per config and mode), and the
ratios ``allreduce_mean_speedup`` (per size) and ``step_speedup`` (per config).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

from bench import _measure
from tessera import gloo
from tessera.log import quiet
from tessera.ports import free_port

SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20)
MODES = {"normal": "0", "batch": "1"}
SLOW_MS = 1.5
# (label, model dims (layers, hidden, heads), batch, seq, plan)
CONFIGS = [("A 16x64 tp=2", (2, 64, 4), 16, 64, {"tp": 2}),
           ("B 8x64 tp=2", (4, 128, 4), 8, 64, {"tp": 2}),
           ("A 16x64 dp=2", (2, 64, 4), 16, 64, {"dp": 2}),
           ("B 8x64 dp=2", (4, 128, 4), 8, 64, {"dp": 2}),
           ("A 16x64 pp=2 m=4", (2, 64, 4), 16, 64, {"pp": 2, "micro_batches": 4}),
           ("B 16x64 pp=2 m=4", (4, 128, 4), 16, 64, {"pp": 2, "micro_batches": 4})]


def _rank(rank: int, port: int, reps: int, q) -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, [cores[rank % len(cores)]])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    calmed = gloo.calm_loop_threads()
    a = torch.randn(128, 128)
    out = {}
    for nbytes in SIZES:
        x = torch.ones(nbytes // 4)
        for _ in range(3):
            dist.all_reduce(x)
        ts = []
        for _ in range(reps):
            for _ in range(20):
                a @ a
            t = time.perf_counter()
            dist.all_reduce(x)
            ts.append((time.perf_counter() - t) * 1e3)
        out[nbytes] = ts
    q.put((rank, calmed, out))
    dist.destroy_process_group()


def collectives(mode: str, reps: int) -> dict:
    """One 2-rank run in ``mode``: {bytes: [later rank's ms per call]}."""
    os.environ[gloo.ENV] = MODES[mode]
    ctx = mp.get_context("fork")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, reps, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, calmed, out = q.get(timeout=300)
        got[rank] = out
        if (calmed > 0) != (mode == "batch"):
            raise RuntimeError(f"rank {rank} in mode {mode} has {calmed} SCHED_BATCH loop threads")
    for p in procs:
        p.join(60)
    return {n: [min(a, b) for a, b in zip(got[0][n], got[1][n])] for n in SIZES}


def step_ms(dims: tuple, batch: int, seq: int, plan: dict, mode: str, steps: int = 12, warmup: int = 3) -> float:
    os.environ[gloo.ENV] = MODES[mode]
    layers, hidden, heads = dims
    w = {"model": {"vocab": 256, "seq_len": seq, "layers": layers, "hidden": hidden, "heads": heads},
         "batch_size": batch, "steps": warmup + steps,
         "plan": {"dp": 1, "tp": 1, "pp": 1, "micro_batches": 1, **plan}}
    (res,) = _measure.run_jobs([{"workload": w, "cores": [[0], [1]]}], warmup=warmup)
    return res["wall_s"] * 1e3


def _summary(ts: list[float]) -> dict:
    s = sorted(ts)
    return {"mean_ms": statistics.fmean(s), "median_ms": statistics.median(s),
            "p90_ms": s[int(0.9 * (len(s) - 1))], "slow_frac": sum(v > SLOW_MS for v in s) / len(s), "n": len(s)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gloo_wakeup", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=80, help="all-reduces per size and run (default 80)")
    ap.add_argument("--rounds", type=int, default=2, help="times each mode runs, alternating (default 2)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if len(os.sched_getaffinity(0)) < 2:
        print("needs 2 cores", file=sys.stderr)
        return 2
    saved = os.environ.get(gloo.ENV)
    try:
        calls: dict[str, dict[int, list[float]]] = {m: {n: [] for n in SIZES} for m in MODES}
        steps: dict[str, dict[str, list[float]]] = {c[0]: {m: [] for m in MODES} for c in CONFIGS}
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else list(MODES)[::-1]):
                for n, ts in collectives(mode, args.reps).items():
                    calls[mode][n] += ts
                for label, dims, b, s, plan in CONFIGS:
                    steps[label][mode].append(step_ms(dims, b, s, plan, mode))
                print(f"round {r + 1}/{args.rounds} {mode}: done", file=sys.stderr, flush=True)
    finally:
        if saved is None:
            os.environ.pop(gloo.ENV, None)
        else:
            os.environ[gloo.ENV] = saved
    ar = {str(n): {m: _summary(calls[m][n]) for m in MODES} for n in SIZES}
    st = {label: {m: min(v) for m, v in d.items()} for label, d in steps.items()}
    doc = {"allreduce": ar, "steps_ms": st,
           "allreduce_mean_speedup": {n: ar[n]["normal"]["mean_ms"] / ar[n]["batch"]["mean_ms"] for n in ar},
           "step_speedup": {k: v["normal"] / v["batch"] for k, v in st.items()},
           "reps": args.reps, "rounds": args.rounds, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    head = [f"{m} mean / median / p90 ms, slow" for m in MODES]
    print(f"{'all-reduce':>12} | {head[0]:>38} | {head[1]:>38} | mean x")
    for n, d in ar.items():
        cells = [f"{d[m]['mean_ms']:6.2f} / {d[m]['median_ms']:5.2f} / {d[m]['p90_ms']:5.2f}, {d[m]['slow_frac']:4.0%}"
                 for m in MODES]
        print(f"{int(n) >> 10:>8} KiB | {cells[0]:>38} | {cells[1]:>38} | {doc['allreduce_mean_speedup'][n]:5.2f}")
    print(f"{'step':>16} | {'normal ms':>9} | {'batch ms':>9} | x")
    for label, d in st.items():
        print(f"{label:>16} | {d['normal']:9.1f} | {d['batch']:9.1f} | {doc['step_speedup'][label]:4.2f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    # The ranks' info lines (one "joined" per rank and run) would bury the table. Only
    # here: main() called in-process (the tests) leaves the caller's logging alone.
    quiet()
    sys.exit(main())
