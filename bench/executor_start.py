"""Executor start with and without the agent's fork server (``--executor-zygote``).

    python -m bench.executor_start [--launches 6] [--steps 40] [--json PATH]

A real ``agent.executors.ExecutorManager`` on this machine's CPU cores (one core set of
all of them) launches one tiny GPT executor after another, ``--launches`` times in each
mode, the modes alternating launch by launch: ``fresh`` (every executor its own Python
process, importing torch) and ``fork`` (forked from the zygote, which the first fork
launch starts and waits for; that launch is reported apart as ``fork_first_s``). Per
launch: seconds from the launch call to the first progress report (the executor's first
training step done: its start), the executor process's CPU seconds, and the median step
time of its run (whether a forked executor trains as fast as a fresh one).

Prints a table; ``--json`` writes ``start_s`` and ``cpu_s`` and ``step_ms`` (median per
mode), ``fork_first_s``, and the ratios ``start_speedup`` (fresh / fork) and
``step_ratio`` (fork / fresh).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from agent.devices import discover
from agent.executors import ExecutorManager, process_cpu_s
from agent.zygote import ZygoteProcess
from tessera.log import quiet

MODEL = {"vocab": 64, "seq_len": 32, "layers": 2, "hidden": 64, "heads": 4}


def spec(job: str, steps: int) -> dict:
    return {"job_id": job, "checkpoint_dir": "",
            "workload": {"type": "gpt", "model": MODEL, "steps": steps, "batch_size": 8, "checkpoint_every": 0,
                         "learning_rate": 0.01}}


async def _launch(mgr: ExecutorManager, reports: dict, name: str, steps: int) -> dict:
    first = asyncio.Event()
    reports[name] = {"first": first, "steps": [], "cpu": None}
    t0 = time.perf_counter()
    ex, _ = await mgr.launch(allocation_id=name, job_id=name, rank=0, world_size=1, device_ids=["cpu0"],
                             master_addr="127.0.0.1", master_port=1, runtime_spec=spec(name, steps),
                             checkpoint_dir="")
    await first.wait()
    start = time.perf_counter() - t0
    await ex.done.wait()
    r = reports[name]
    return {"start_s": start, "cpu_s": r["cpu"], "step_ms": 1000 * statistics.median(r["steps"]),
            "forked": isinstance(ex.proc, ZygoteProcess)}


async def run(launches: int, steps: int) -> dict:
    reports: dict = {}

    async def on_report(ex, r) -> None:
        rec = reports.get(ex.allocation_id)
        if rec is None:
            return
        if r["kind"] == "PROGRESS":
            if r.get("step_time_s"):
                rec["steps"].append(r["step_time_s"])
            if r["step"] >= steps - 1 and ex.proc is not None:  # last reports: its CPU before it exits
                rec["cpu"] = process_cpu_s(ex.proc.pid) or rec["cpu"]
            rec["first"].set()

    devs = discover(1, use_nvml=False)
    out: dict[str, list[dict]] = {"fresh": [], "fork": []}
    first_fork = None
    with tempfile.TemporaryDirectory() as d:
        mgrs = {"fresh": ExecutorManager(Path(d) / "fresh", devs, on_report, report_interval_s=0.0),
                "fork": ExecutorManager(Path(d) / "fork", devs, on_report, report_interval_s=0.0, zygote=True)}
        try:
            first_fork = await _launch(mgrs["fork"], reports, "fork-warmup", steps)
            for i in range(launches):
                for mode in (("fresh", "fork") if i % 2 == 0 else ("fork", "fresh")):
                    res = await _launch(mgrs[mode], reports, f"{mode}-{i}", steps)
                    out[mode].append(res)
                    print(f"{mode:5s} #{i}: start {res['start_s']:.3f} s, cpu {res['cpu_s'] or 0:.2f} s, "
                          f"step {res['step_ms']:.2f} ms, forked={res['forked']}", flush=True)
        finally:
            for m in mgrs.values():
                await m.stop_all(grace_s=2.0)
            await mgrs["fork"].stop_zygote()
    med = {k: {f: statistics.median(r[f] for r in v if r[f] is not None) for f in ("start_s", "cpu_s", "step_ms")}
           for k, v in out.items()}
    return {"launches": launches, "steps": steps, "cores": len(devs[0].cores),
            "start_s": {k: med[k]["start_s"] for k in med}, "cpu_s": {k: med[k]["cpu_s"] for k in med},
            "step_ms": {k: med[k]["step_ms"] for k in med}, "fork_first_s": first_fork["start_s"],
            "all_forked": all(r["forked"] for r in out["fork"]) and not any(r["forked"] for r in out["fresh"]),
            "start_speedup": med["fresh"]["start_s"] / med["fork"]["start_s"],
            "step_ratio": med["fork"]["step_ms"] / med["fresh"]["step_ms"], "runs": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.executor_start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=6, help="launches per mode (alternating)")
    ap.add_argument("--steps", type=int, default=40, help="training steps per executor")
    ap.add_argument("--json", default="", help="write the figures here")
    a = ap.parse_args(argv)
    if a.launches < 1 or a.steps < 2:
        ap.error("--launches must be >= 1 and --steps >= 2")
    quiet()
    res = asyncio.run(run(a.launches, a.steps))
    print(f"\n{'mode':6s} {'start s':>8s} {'cpu s':>7s} {'step ms':>8s}")
    for k in ("fresh", "fork"):
        print(f"{k:6s} {res['start_s'][k]:8.3f} {res['cpu_s'][k]:7.2f} {res['step_ms'][k]:8.2f}")
    print(f"first fork launch (starts the zygote): {res['fork_first_s']:.3f} s")
    print(f"start speedup {res['start_speedup']:.1f}x, step time fork/fresh {res['step_ratio']:.3f}, "
          f"cores {res['cores']}, every fork launch forked: {res['all_forked']}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if res["all_forked"] else 1


if __name__ == "__main__":
    sys.exit(main())
