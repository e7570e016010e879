"""GPU side of the estimator benchmark: real runtime steps on CUDA under MPS SM quotas.

Contract:
- :func:`run_groups` starts one *spawned* process per group ``{"quota": pct,
  "workloads": [...]}`` at the same moment (colocation when there are several), each
  with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=pct`` set before its CUDA context exists;
  a process runs its workloads one after the other (a profiling job runs several
  points of a module in one process) and stamps every step boundary after a
  ``torch.cuda.synchronize()``. Returns per group, per workload ``{"step_s"}`` (median
  of the measured steps; for colocated groups only steps inside the window where
  all groups were measuring) and the group's device-seconds (wall x quota / 100).
- The MPS control daemon must already run (bench/gpu/run.sh starts it and exports
  ``CUDA_MPS_PIPE_DIRECTORY``/``CUDA_MPS_LOG_DIRECTORY``); without it the percentage
  is ignored by CUDA and the quota column is meaningless.

Spawn rather than fork: the parent may have touched the CUDA driver, and a forked
child cannot initialise CUDA after that. Start-up (torch import, CUDA context) is in
the device-seconds of profiles and grid alike.
"""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time


def _worker(specs: list[dict], quota: int, path: str, start_at: float) -> None:
    os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(quota))  # read at context creation
    import torch

    from agent.runtime.__main__ import resolve
    from agent.runtime.parallel import comm
    from agent.runtime.report import Reporter

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context (and the MPS client) exists from here
    stamps: list[float] = []
    orig = comm.TIMER.reset

    def reset() -> float:
        torch.cuda.synchronize()
        stamps.append(time.monotonic())
        return orig()

    comm.TIMER.reset = reset
    while time.monotonic() < start_at:
        time.sleep(0.002)
    runs = []
    for spec in specs:
        stamps.clear()
        code = int(resolve(spec["workload"]["type"])(spec, Reporter(stream=open(os.devnull, "w"), enabled=False)))
        torch.cuda.synchronize()
        stamps.append(time.monotonic())
        runs.append(list(stamps))
        if code:
            raise SystemExit(code)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(runs, f)


def make_spec(workload: dict) -> dict:
    """A single-GPU executor spec (nccl backend, world 1: the runtime picks cuda:0)."""
    w = {"type": "gpt", "learning_rate": 1e-3, "seed": 0, "checkpoint_every": 0, "data": {"kind": "synthetic"}}
    w.update(copy.deepcopy(workload))
    return {"job_id": "bench-gpu", "workload": w, "threads": 1, "dist": {"rank": 0, "world_size": 1, "backend": "nccl"}}


def run_groups(groups: list[dict], warmup: int, timeout_s: float = 90.0, start_delay_s: float = 10.0) -> list[dict]:
    """Run the groups concurrently (see module doc); per group ``{"results": [...],
    "device_s": ...}``. ``start_delay_s`` covers the spawn and CUDA start-up (spawn +
    torch import + CUDA/MPS context: about 5-8 s estimated, not yet measured on the
    device) so that colocated groups begin their steps together; a group that is late
    only shrinks the common window (steps outside it are dropped below), it does not
    skew the figures. Was 15 s; 10 s saves 25 s over the 5 colocated calls of the GPU
    estimator benchmark. ``timeout_s`` (90 s; one group takes ~10-20 s) kills a hung
    group so that its caller can record the failure and go on."""
    ctx = mp.get_context("spawn")
    t0 = time.monotonic()
    start_at = t0 + start_delay_s
    with tempfile.TemporaryDirectory(prefix="tessera-gpu-") as tmp:
        procs, paths = [], []
        for i, g in enumerate(groups):
            paths.append(os.path.join(tmp, f"g{i}.json"))
            p = ctx.Process(target=_worker, args=([make_spec(w) for w in g["workloads"]], g["quota"], paths[-1],
                                                  start_at if len(groups) > 1 else 0.0), daemon=True)
            p.start()
            procs.append(p)
        deadline = t0 + timeout_s
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        wall = time.monotonic() - t0
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"gpu bench run failed: exit codes {[p.exitcode for p in procs]} for {groups}")
        runs = [json.load(open(pth, encoding="utf-8")) for pth in paths]
    lo = hi = None
    if len(groups) > 1:  # colocated: single-workload groups, keep the common window
        lo = max(r[0][warmup] for r in runs)
        hi = min(r[0][-1] for r in runs)
    out = []
    for g, rs in zip(groups, runs):
        res = []
        for st in rs:
            steps = [b - a for a, b in zip(st[warmup:-1], st[warmup + 1:])
                     if lo is None or (a >= lo - 1e-9 and b <= hi + 1e-9)]
            if len(steps) < 2:
                steps = [b - a for a, b in zip(st[warmup:-1], st[warmup + 1:])]
            res.append({"step_s": statistics.median(steps), "steps": steps})
        # the start-up wait of colocated groups is idle, not device time
        held = wall - (max(0.0, start_at - t0) if len(groups) > 1 else 0.0)
        out.append({"results": res, "device_s": held * g["quota"] / 100.0})
    return out
