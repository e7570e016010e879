"""Torch-side measurement harness for the estimator benchmark (not pure: imports torch).

Contract:
- :func:`run_jobs` runs one or more real ``gpt`` jobs of the runtime *at the same time*
  (colocation), each with every rank of its plan as a forked process pinned to a core
  set, and returns per job the median step time of rank 0 over the measured steps
  and the device-seconds the run cost. Steps are real training steps of
  ``agent.runtime.train`` (forward, backward, communication, optimizer).
- :func:`comm_table` runs the gloo loopback micro-benchmark (2 processes) and returns
  rows ``{"op", "bytes", "world", "seconds"}`` for all_reduce, all_gather, broadcast
  and send/recv, plus the device-seconds it cost.

Why a launcher of its own rather than ``parallel.launch.run_local``: the benchmark
needs per-rank CPU affinity (the "quota") and a timestamp on every progress event, to
keep only the steps during which colocated jobs really overlapped.
"""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch  # noqa: F401  - imported once here so that forked ranks start in milliseconds

from agent.runtime.parallel.launch import free_port

CORES = sorted(os.sched_getaffinity(0))


class _StampedStream:
    """File-like object that prefixes every written line with CLOCK_MONOTONIC seconds
    (system-wide on Linux, so timestamps compare across processes)."""

    def __init__(self, f) -> None:
        self._f = f

    def write(self, s: str) -> None:
        for line in s.splitlines():
            if line:
                self._f.write(f"{time.monotonic():.6f} {line}\n")

    def flush(self) -> None:
        self._f.flush()


def _rank_main(specs: list[dict], cores: list[int], events_path: str, start_at: float) -> None:
    """One forked rank: pin to ``cores``, then run ``specs`` one after the other (a
    profiling job runs several points of a module in one process)."""
    code = 1
    try:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(int(specs[0].get("threads") or len(cores)))
        from agent.runtime.__main__ import resolve
        from agent.runtime.report import Reporter

        # Colocated jobs start their step loop at the same moment.
        while time.monotonic() < start_at:
            time.sleep(0.001)
        with open(events_path, "w", encoding="utf-8") as f:
            for i, spec in enumerate(specs):
                rank = spec["dist"]["rank"]
                f.write(f"{time.monotonic():.6f} SPEC {i}\n")
                rep = Reporter(stream=_StampedStream(f), enabled=rank == 0)
                code = int(resolve(spec["workload"]["type"])(spec, rep))
                if code:
                    break
    finally:
        os._exit(code)


def _read_events(path: str) -> list[list[tuple[float, dict]]]:
    """Timestamped events of each spec the rank ran, in order."""
    from agent.runtime.report import parse_line

    out: list[list[tuple[float, dict]]] = []
    if not os.path.exists(path):
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            ts, _, rest = line.partition(" ")
            if rest.startswith("SPEC "):
                out.append([])
                continue
            ev = parse_line(rest)
            if ev is not None and out:
                out[-1].append((float(ts), ev))
    return out


def make_spec(workload: dict, threads: int) -> dict:
    """An executor spec for a gpt workload (no checkpoints, synthetic data)."""
    w = {"type": "gpt", "learning_rate": 1e-3, "seed": 0, "checkpoint_every": 0, "data": {"kind": "synthetic"}}
    w.update(copy.deepcopy(workload))
    return {"job_id": "bench", "workload": w, "threads": threads}


def run_jobs(jobs: list[dict], warmup: int, timeout_s: float = 300.0) -> list[dict]:
    """Run ``jobs`` concurrently; each is ``{"workload": {...}, "cores": [[rank0 cores], ...]}``.

    ``workload.steps`` must be ``warmup + measured``. Returns per job
    ``{"step_s": median seconds, "steps": [...], "device_s": wall * devices}`` where
    devices is the number of distinct cores the job held. With several jobs only steps
    that ended while every job was still in its measured phase are kept.
    """
    ctx = mp.get_context("fork")
    start_at = time.monotonic() + 0.3
    t0 = time.monotonic()
    procs, paths = [], []
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        for j, job in enumerate(jobs):
            world = len(job["cores"])
            port = free_port()
            threads = job.get("threads") or len(job["cores"][0])
            for r in range(world):
                spec = make_spec(job["workload"], threads)
                spec["dist"] = {"rank": r, "world_size": world, "master_addr": "127.0.0.1",
                                "master_port": port, "backend": "gloo", "timeout_s": 120}
                path = os.path.join(tmp, f"job{j}.rank{r}")
                p = ctx.Process(target=_rank_main, args=([spec], job["cores"][r], path, start_at), daemon=True)
                p.start()
                procs.append(p)
            paths.append(os.path.join(tmp, f"job{j}.rank0"))
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        wall = time.monotonic() - t0
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"bench job failed: exit codes {[p.exitcode for p in procs]} for {jobs}")
        evs = [[(ts, e) for ts, e in _read_events(path)[0] if e["event"] == "progress"] for path in paths]
    # Overlap window: after every job's warm-up, before the first job finishes.
    lo = max(ev[warmup - 1][0] if warmup > 0 else ev[0][0] for ev in evs)
    hi = min(ev[-1][0] for ev in evs)
    out = []
    for job, ev in zip(jobs, evs):
        kept = [e["step_time_s"] for ts, e in ev[warmup:] if lo < ts <= hi + 1e-9] if len(jobs) > 1 else \
            [e["step_time_s"] for _, e in ev[warmup:]]
        if len(kept) < 2:  # too little overlap: fall back to every measured step
            kept = [e["step_time_s"] for _, e in ev[warmup:]]
        cores = {c for rc in job["cores"] for c in rc}
        out.append({"step_s": statistics.median(kept), "steps": kept, "device_s": wall * len(cores) / len(jobs)
                    if len(jobs) > 1 else wall * len(cores)})
    return out


def profile_points(workloads: list[dict], cores: list[int], threads: int, warmup: int,
                   timeout_s: float = 300.0) -> tuple[list[float], float]:
    """A cheap profiling job: one process on ``cores`` runs each single-rank workload
    in turn (``steps`` = warmup + measured). Returns (median step s per workload,
    device-seconds of the whole job)."""
    ctx = mp.get_context("fork")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-prof-") as tmp:
        path = os.path.join(tmp, "prof")
        specs = []
        for w in workloads:
            spec = make_spec(w, threads)
            spec["dist"] = {"rank": 0, "world_size": 1}
            specs.append(spec)
        p = ctx.Process(target=_rank_main, args=(specs, cores, path, 0.0), daemon=True)
        p.start()
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"profiling job failed: exit code {p.exitcode}")
        runs = _read_events(path)
    wall = time.monotonic() - t0
    meds = [statistics.median([e["step_time_s"] for _, e in run if e["event"] == "progress"][warmup:])
            for run in runs]
    return meds, wall * len(cores)


# --------------------------------------------------------------------------- comm


def _comm_rank(rank: int, port: int, sizes: list[int], reps: int, out_path: str) -> None:
    code = 1
    try:
        os.sched_setaffinity(0, [CORES[rank % len(CORES)]])
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        rows = []
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            x = torch.ones(n)
            outs = [torch.empty(n) for _ in range(2)]

            def ops():
                yield "all_reduce", lambda: dist.all_reduce(x)
                yield "all_gather", lambda: dist.all_gather(outs, x)
                yield "broadcast", lambda: dist.broadcast(x, src=0)
                yield "send_recv", lambda: dist.send(x, dst=1) if rank == 0 else dist.recv(x, src=0)

            for op, fn in ops():
                fn()  # warm-up (connection setup, buffers)
                ts = []
                for _ in range(reps):
                    dist.barrier()
                    t = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t)
                rows.append({"op": op, "bytes": n * 4, "world": 2, "seconds": statistics.median(ts)})
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as f:
                json.dump(rows, f)
        dist.destroy_process_group()
        code = 0
    finally:
        os._exit(code)


def comm_table(sizes: list[int] | None = None, reps: int = 7) -> tuple[list[dict], float]:
    """Gloo loopback micro-benchmark over 2 processes; (rows, device-seconds)."""
    sizes = sizes or [4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20]
    ctx = mp.get_context("fork")
    port = free_port()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-comm-") as tmp:
        path = os.path.join(tmp, "rows.json")
        procs = [ctx.Process(target=_comm_rank, args=(r, port, sizes, reps, path), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
                p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"comm micro-benchmark failed: {[p.exitcode for p in procs]}")
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    return rows, (time.monotonic() - t0) * 2
