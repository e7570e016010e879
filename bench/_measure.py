"""Torch-side measurement harness for the estimator benchmark (not pure: imports torch).

Contract:
- :func:`run_jobs` runs one or more real ``gpt`` jobs of the runtime *at the same time*
  (colocation), each with every rank of its plan as a forked process pinned to a core
  set, and returns per job the median step time of rank 0 over the measured steps
  and the device-seconds the run cost. Steps are real training steps of
  ``agent.runtime.train`` (forward, backward, communication, optimizer).
- :func:`profile_points` is a profiling job: one process runs several single-rank
  points in turn, each pinned to its own quota (cores, one thread per core), and
  returns each point's median step and the device-seconds of the job.
- :func:`comm_table` runs the gloo loopback micro-benchmark (2 processes, one core
  each) and returns rows ``{"op", "bytes", "world", "seconds"}`` for all_reduce,
  all_gather, broadcast and send/recv (each timed after a short compute phase, as
  training issues them) and the sync rows (``compute_s``: the wait for the other rank
  after a compute chunk), plus the device-seconds it cost.
- Every run returns its per-step times too (``steps``, ``raw_steps``), so that the
  caller applies one statistic to profiles and grid points alike.

Why a launcher of its own rather than ``parallel.launch.run_local``: the benchmark
needs per-rank CPU affinity (the "quota"), per-step stamps on every rank (to keep only
the steps during which colocated jobs really overlapped), and each thread's on-CPU
time and run-queue wait (``/proc/self/task/*/schedstat``). This host is shared with
other people's test runs (load averages of 10 on 2 cores were seen); the wait they
cause (:func:`foreign_wait`: not the wait behind the job's own threads) is subtracted
from the step time, which the performance model predicts for a *dedicated* quota.
Both the raw and the corrected times are reported.
"""

from __future__ import annotations

import copy
import faulthandler
import gc
import json
import math
import multiprocessing as mp
import os
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import torch  # noqa: F401  - imported once here so that forked ranks start in milliseconds

from agent.runtime.parallel.launch import free_port

# The runtime's AdamW built once in the parent: its first construction in a process sets
# up what every later one shares (agent.runtime.optim.eager_optimizers; until 2026-12-07
# it imported torch._dynamo, ~2 s here, 5 s under load), so that no forked rank — profile
# or grid point — counts that as device time or waits on it before its first step.
from agent.runtime.optim import make_adamw  # noqa: E402

make_adamw([torch.nn.Parameter(torch.zeros(1))], lr=0.0, env={})
# The runtime's modules too: a forked rank (profile or grid point alike) starts its
# first step without importing anything.
from agent.runtime.__main__ import resolve  # noqa: E402,F401
from agent.runtime.parallel import comm as _comm  # noqa: E402,F401
from agent.runtime.report import Reporter  # noqa: E402,F401

resolve("gpt")  # imports agent.runtime.train
# And what torch imports lazily at a pipeline stage's first backward (explicit gradients:
# ~0.5 s of sympy), which came along with torch._dynamo while torch's own AdamW imported it.
import torch.fx.experimental.symbolic_shapes  # noqa: E402,F401

CORES = sorted(os.sched_getaffinity(0))


def _sched() -> dict[str, list[float]]:
    """Per thread of this process, cumulative ``[on-CPU, run-queue wait]`` seconds
    (fields 1 and 2 of /proc/<tid>/schedstat): the wait is time it was runnable while
    another task held the core."""
    out = {}
    base = "/proc/self/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat", encoding="ascii") as f:
                fields = f.read().split()
            out[tid] = [int(fields[0]) / 1e9, int(fields[1]) / 1e9]
        except (OSError, IndexError, ValueError):
            pass
    return out


def _stamp() -> list:
    """[wall, process CPU, per-thread [run, wait], pid, cores the process may run on,
    minor page faults of the process so far]."""
    return [time.monotonic(), time.process_time(), _sched(), str(os.getpid()), len(os.sched_getaffinity(0)),
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt]


def step_faults(stamps: list, warmup: int) -> float | None:
    """Mean minor page faults per step after ``warmup`` of one process's :func:`_stamp`
    list (one stamp per step boundary, pure); None when there is no measured step or the
    stamps carry no fault counts. A training step that maps its activations afresh
    faults ~1 page per 4 KiB of them, each ~2-3 us on a VM: agent.runtime.heap."""
    got = [s[5] for s in stamps[warmup:] if len(s) > 5]
    if len(got) != len(stamps[warmup:]) or len(got) < 2:
        return None
    return (got[-1] - got[0]) / (len(got) - 1)


def foreign_wait(waits: dict[str, float], runs: dict[str, float], cores: int, dt: float, extra: float = 0.0) -> float:
    """The run-queue wait that *other* tenants caused one rank during an interval of
    ``dt`` seconds (pure): over its threads, the largest wait less what the rank's own
    other threads can explain — the CPU time they ran beyond the ``cores - 1`` other
    cores of its quota (on one core, all of it: a main thread waiting behind its own
    gloo, encoder or LLM worker is the configuration, not noise) — and less ``extra``
    (CPU time of a colocated partner on a shared core, which is the configuration too).
    ``waits`` and ``runs``: per thread id, seconds in the interval. Never negative."""
    total = sum(runs.values())
    worst = 0.0
    for tid, w in waits.items():
        own = max(0.0, total - runs.get(tid, 0.0) - max(0, cores - 1) * dt)
        worst = max(worst, w - own - extra)
    return max(0.0, worst)


def _rank_main(specs: list[dict], cores: list[int], path: str, start_at: float,
               go=None, signal: tuple | None = None, stop=None) -> None:
    """One forked rank: pin to ``cores``, then run ``specs`` one after the other (a
    profiling job runs several points of a module in one process). Writes, per spec,
    a stamp (:func:`_stamp`) at the start of every step — hooked on
    ``comm.TIMER.reset``, which the training loop calls once per step — and one at the
    end of its last step (its ``progress`` event; not after the run returns, which in
    a gloo world adds ``destroy_process_group``: ~40 ms on a 17 ms tp=2 step, a
    standing outlier among 5 measured steps).
    ``go`` (an Event): start the step loop when it is set, not at ``start_at``;
    ``signal`` = (n, Event): set the Event once n steps are done. ``stop`` (an Event):
    when it is set, the runtime leaves at its next step boundary (``train.STOP``, as on
    SIGTERM; its exit code 143 counts as done)."""
    code = 1
    gc.freeze()  # what the fork inherited is never collected here (agent.runtime.parallel.launch._rank_main)
    try:
        dump_on_timeout()
        if stop is not None:
            from agent.runtime.train import STOP

            def leave() -> None:
                stop.wait()
                sys.stdout = open(os.devnull, "w")  # not the runtime's "stopped by SIGTERM" error line
                STOP.set()

            threading.Thread(target=leave, daemon=True).start()
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(int(specs[0].get("threads") or len(cores)))
        from agent.runtime.__main__ import resolve
        from agent.runtime.parallel import comm
        from agent.runtime.report import Reporter

        stamps: list = []
        ends: list = []  # the stamp of the latest step end (progress event)
        fb: list = []  # per step: its micro-batches' forward + backward seconds (the runtime's phases)

        class StepEnd(Reporter):
            def event(self, kind: str, **fields) -> None:
                if kind == "progress":
                    ends[:] = [_stamp()]
                    ph = fields.get("phases") or {}
                    fb.append(float(ph.get("forward", 0.0)) + float(ph.get("backward", 0.0)))
                super().event(kind, **fields)

        orig = comm.TIMER.reset

        def reset() -> float:
            stamps.append(_stamp())
            if signal is not None and len(stamps) == signal[0] + 1:  # stamp n+1 starts step n+1
                signal[1].set()
            return orig()

        comm.TIMER.reset = reset  # instance attribute: shadows the method for this process only
        if go is not None:
            go.wait()
        # Colocated jobs start their step loop at the same moment.
        while time.monotonic() < start_at:
            time.sleep(0.001)
        runs, starts, fbs = [], [], []
        for spec in specs:
            if spec.get("cores"):  # a profiling job sets each point's quota (cores, threads) itself
                os.sched_setaffinity(0, spec["cores"])
                torch.set_num_threads(int(spec.get("threads") or len(spec["cores"])))
            starts.append(time.monotonic())
            stamps.clear()
            ends.clear()
            fb.clear()
            code = int(resolve(spec["workload"]["type"])(spec, StepEnd(stream=open(os.devnull, "w"), enabled=False)))
            if code == 143 and stop is not None and stop.is_set():
                code = 0  # told to stop: done
            stamps.append(ends[0] if ends else _stamp())
            runs.append(list(stamps))
            fbs.append(list(fb))
            if code:
                break
        with open(path, "w", encoding="utf-8") as f:
            json.dump(runs, f)
        with open(path + ".starts", "w", encoding="utf-8") as f:
            json.dump(starts, f)
        with open(path + ".fb", "w", encoding="utf-8") as f:
            json.dump(fbs, f)
    finally:
        os._exit(code)


def _series(stamps: list) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], int]:
    """(wall, process CPU, per-thread wait, per-thread on-CPU time, cores) of a list of
    :func:`_stamp` stamps (a thread absent from a stamp counts 0 there)."""
    t = np.array([s[0] for s in stamps])
    cpu = np.array([s[1] for s in stamps])
    tids = {tid for s in stamps for tid in s[2]}
    waits = {tid: np.array([s[2][tid][1] if tid in s[2] else 0.0 for s in stamps]) for tid in tids}
    runs = {tid: np.array([s[2][tid][0] if tid in s[2] else 0.0 for s in stamps]) for tid in tids}
    return t, cpu, waits, runs, int(stamps[-1][4])


def less_wait(raw: float, wait: float) -> float:
    """A step's ``raw`` wall time less the foreign ``wait`` in it, never below a fifth of
    ``raw`` (a correction that large is a measurement gone wrong, not a faster step)."""
    return max(0.2 * raw, raw - wait)


def step_waits(series: tuple, a: float, b: float, extra: float = 0.0) -> float:
    """:func:`foreign_wait` of one rank (its :func:`_series`) between times a and b."""
    t, _, waits, runs, cores = series

    def d(x):
        return float(np.interp(b, t, x) - np.interp(a, t, x))

    return foreign_wait({k: d(v) for k, v in waits.items()}, {k: d(v) for k, v in runs.items()}, cores, b - a, extra)


def _steps(job_stamps: list[list], lo: float, hi: float, warmup: int, partner: list | None,
           starts_only: bool = False) -> dict:
    """Per measured step of one job (rank 0's boundaries inside [lo, hi]; with
    ``starts_only`` every step that starts inside it): raw wall time and wall time less
    the run-queue wait that other tenants caused.

    The wait of a step is the largest over the ranks (a synchronous step waits for its
    slowest rank) of :func:`foreign_wait`: a thread's wait less what the rank's own
    other threads ran on its cores (gloo's threads beside a rank's main thread, the
    intra-op workers) — a wait of our own, not another tenant's. On a core shared with a
    colocated ``partner`` job the partner's CPU time is discounted too: that wait is
    the configuration, not noise. The partner's CPU time is known only at its own step
    boundaries, so there the foreign wait is taken over the whole window of counted steps
    and spread over them by duration: per step, the interpolated partner time of a
    time-sliced core is off by up to a slice either way, and a wait is never negative —
    per-step errors did not cancel but subtracted (a job paired with one of 3x its step
    read 25 % faster than its raw time, faster than time slicing allows).
    """
    t0, cpu0 = _series(job_stamps[0])[:2]
    ranks = [_series(st) for st in job_stamps]
    pt = _series(partner) if partner else None
    raw, corr, util, spans = [], [], [], []
    for k in range(warmup, len(t0) - 1):
        a, b = t0[k], t0[k + 1]
        if a < lo - 1e-9 or (a >= hi if starts_only else b > hi + 1e-9):
            continue
        w = b - a
        spans.append((a, b))
        raw.append(w)
        if pt is None:
            corr.append(less_wait(w, max(step_waits(r, a, b) for r in ranks)))
        util.append((cpu0[k + 1] - cpu0[k]) / w)
    if pt is not None and spans:
        a, b = spans[0][0], spans[-1][1]
        extra = float(np.interp(b, pt[0], pt[1]) - np.interp(a, pt[0], pt[1]))
        share = max(step_waits(r, a, b, extra) for r in ranks) / max(sum(raw), 1e-12)
        corr = [less_wait(w, w * share) for w in raw]
    return {"raw": raw, "corrected": corr, "util": util}


def make_spec(workload: dict, threads: int) -> dict:
    """An executor spec for a gpt workload (no checkpoints, synthetic data)."""
    w = {"type": "gpt", "learning_rate": 1e-3, "seed": 0, "checkpoint_every": 0, "data": {"kind": "synthetic"}}
    w.update(copy.deepcopy(workload))
    return {"job_id": "bench", "workload": w, "threads": threads}


def _start(ctx, specs: list[dict], cores: list[int], path: str, start_at: float, go=None, signal=None, stop=None):
    p = ctx.Process(target=_rank_main, args=(specs, cores, path, start_at, go, signal, stop), daemon=True)
    p.start()
    return p


# After a run's timeout: the time its processes get to write their stacks (SIGUSR1,
# :func:`dump_on_timeout`) before they are killed.
DUMP_S = 2.0


def dump_on_timeout() -> None:
    """In a forked run: SIGUSR1 writes every thread's Python stack to stderr (the
    bench's log), so that a run :func:`_join` gives up on says where it hung."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)


def _join(procs: list, timeout_s: float, what) -> None:
    """Wait for ``procs`` up to ``timeout_s`` in all; the ones still alive then are asked
    for their stacks (SIGUSR1), given :data:`DUMP_S`, and killed. RuntimeError naming
    ``what`` unless every one exited 0. Interrupted while waiting (KeyboardInterrupt, a
    test's timeout), it kills and reaps every one still alive before the exception goes
    on: a forked rank left running holds its core for ever (a CI run of 2026-12-07: one
    such orphan, spinning, cost the next test its together steps)."""
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        raise
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    for p in alive:
        p.join(DUMP_S)
        if p.is_alive():
            p.kill()
            p.join()
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"bench run failed: exit codes {[p.exitcode for p in procs]} for {what}")


# Colocated jobs run until the slowest has done its steps, at most this many times
# their own step count (run_jobs).
PAIR_CAP = 20


def run_jobs(jobs: list[dict], warmup: int, timeout_s: float = 300.0) -> list[dict]:
    """Run ``jobs`` concurrently; each is ``{"workload": {...}, "cores": [[rank0 cores], ...]}``
    (one core list per rank; ``workload.steps`` = warmup + measured).

    Returns per job ``{"step_s", "wall_s", "cpu_util", "steps", "raw_steps", "device_s",
    "faults"}``: ``step_s`` the median step time less other tenants' run-queue wait,
    ``wall_s`` the raw median, ``device_s`` its share of the run's wall time times the
    cores the run held (the union of every job's cores, split evenly over the jobs),
    ``faults`` rank 0's minor page faults per step after the warm-up (:func:`step_faults`). With several
    jobs only steps inside the window where all of them were measuring count; they
    start their step loops together after a short barrier, which is not counted as
    device time (a lone job has none). Several jobs run until the slowest has done its
    ``steps`` (each job's rank 0 signals when it has; then all are told to stop at
    their next step boundary, :func:`_rank_main`): the faster ones go on meanwhile, so
    the slower one's measured steps all fall in the window. (A faster job that ended
    at its own step count cut the window short: a job paired with one of a third of
    its step time measured 1-2 steps, one of them part alone — read 20-30 % fast.)
    """
    ctx = mp.get_context("fork")
    t_begin = time.monotonic()
    several = len(jobs) > 1
    start_at = t_begin + (0.3 if several else 0.0)
    stop = ctx.Event() if several else None
    dones = [ctx.Event() if several else None for _ in jobs]
    procs = []
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as tmp:
        paths = []
        for j, job in enumerate(jobs):
            world = len(job["cores"])
            port = free_port()
            threads = job.get("threads") or len(job["cores"][0])
            paths.append([])
            w = job["workload"]
            if several:  # runs until told to stop (a cap, in case a partner never gets there)
                w = {**w, "steps": PAIR_CAP * int(w["steps"])}
            for r in range(world):
                spec = make_spec(w, threads)
                spec["dist"] = {"rank": r, "world_size": world, "master_addr": "127.0.0.1",
                                "master_port": port, "backend": "gloo", "timeout_s": 120}
                paths[-1].append(os.path.join(tmp, f"job{j}.rank{r}"))
                sig = (int(job["workload"]["steps"]), dones[j]) if several and r == 0 else None
                procs.append(_start(ctx, [spec], job["cores"][r], paths[-1][-1], start_at, signal=sig, stop=stop))
        if several:
            deadline = time.monotonic() + timeout_s
            pending = list(dones)
            while pending and time.monotonic() < deadline:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a failed rank: _join reports it
                pending[0].wait(0.01)
                pending = [d for d in pending if not d.is_set()]
            stop.set()
        _join(procs, max(1.0, timeout_s - (time.monotonic() - t_begin)), jobs)
        wall = time.monotonic() - max(t_begin, start_at)
        stamps = []
        for ps in paths:
            stamps.append([json.load(open(p, encoding="utf-8"))[0] for p in ps])
    lo = max(st[0][warmup][0] for st in stamps)
    hi = min(st[0][-1][0] for st in stamps)
    held = len({c for job in jobs for rc in job["cores"] for c in rc})
    out = []
    for j, job in enumerate(jobs):
        partner = None
        if len(jobs) == 2:
            other = jobs[1 - j]
            if set(other["cores"][0]) & set(job["cores"][0]):
                partner = stamps[1 - j][0]
        st = _steps(stamps[j], lo, hi, warmup, partner)
        if len(st["raw"]) < 2:
            # Too little overlap: the steps that started while every job was measuring
            # (the one in flight when a partner ended is part-contended), never one that
            # ran after it — that one would be an alone step counted as a pair's.
            st = _steps(stamps[j], lo, hi, warmup, partner, starts_only=True)
        if not st["raw"]:  # no overlap at all: every measured step
            st = _steps(stamps[j], -1e18, 1e18, warmup, partner)
        out.append({"step_s": statistics.median(st["corrected"]), "wall_s": statistics.median(st["raw"]),
                    "cpu_util": statistics.median(st["util"]), "steps": st["corrected"], "raw_steps": st["raw"],
                    "device_s": wall * held / len(jobs), "faults": step_faults(stamps[j][0], warmup)})
    return out


def colocation_profile(workload: dict, cores: list[list[int]], warmup: int, measured: int,
                       timeout_s: float = 300.0, together: int | None = None) -> dict:
    """A module's interference profile in one run, alone and together seconds apart in
    the same process (separate alone and pair runs differ by the host's drift, 20-40%
    here, as much as the interference itself).

    Job X (``workload``, single rank, on ``cores[0]``) runs ``warmup`` + ``measured``
    steps alone; then it signals its twin Y (the same workload on ``cores[1]``: the same
    cores = time slicing, other cores = split), built and waiting since the start, which
    runs ``warmup`` + ``together`` steps (default ``measured``); X goes on alone after Y
    ends. X's ``workload["steps"]`` is replaced so that it outlasts Y by ``measured``
    steps when it makes up to 1.25x Y's steps while Y runs (the same module: about 1x
    in either mode). Beyond that X has fewer alone steps after Y (its alone time rests
    on the ``measured`` before); every step X runs alone after those is device time for
    nothing (with a 2x margin, ~0.25 device-s per round of the benchmark, split cores
    held throughout).

    Returns ``{"alone_s", "together_s", "alone_n", "together_n", "device_s", "x_t",
    "y_t"}``: the medians of X's steps (less other tenants' wait; Y's CPU time on a
    shared core is added back, as in :func:`run_jobs`) wholly before the signal or after
    Y's last step, and wholly inside Y's measured steps (after its warm-up); the run's
    wall time times the cores held; X's and Y's step boundaries (monotonic seconds,
    every step from the first; raw, nothing subtracted), so that how the two cores'
    steps slow together can be read afterwards. RuntimeError when either side has fewer
    than 2 steps."""
    ctx = mp.get_context("fork")
    t_begin = time.monotonic()
    go = ctx.Event()
    together = measured if together is None else together
    if together < 2:
        raise ValueError(f"together: {together}, expected >= 2")
    x_w = {**workload, "steps": warmup + 2 * measured + math.ceil(1.25 * (warmup + together))}
    y_w = {**workload, "steps": warmup + together}
    shared = bool(set(cores[0]) & set(cores[1]))
    with tempfile.TemporaryDirectory(prefix="tessera-colo-") as tmp:
        paths = [os.path.join(tmp, "x"), os.path.join(tmp, "y")]
        procs = []
        for w, c, path, kw in ((x_w, cores[0], paths[0], {"signal": (warmup + measured, go)}),
                               (y_w, cores[1], paths[1], {"go": go})):
            spec = make_spec(w, len(c))
            spec["dist"] = {"rank": 0, "world_size": 1}
            procs.append(_start(ctx, [spec], list(c), path, 0.0, **kw))
        _join(procs, timeout_s, [x_w, y_w])
        wall = time.monotonic() - t_begin
        x, y = (json.load(open(p, encoding="utf-8"))[0] for p in paths)
    partner = y if shared else None
    # Y builds its model after the signal (inside the runtime, before its first stamp):
    # X's steps from the signal to the end of Y's warm-up are neither alone nor
    # together. Together = Y's measured steps, as a colocated grid pair counts them
    # (run_jobs: after every job's warm-up). With Y's warm-up steps 2-3 counted, X's
    # time-sliced steps read 2.2-2.35x alone where grid twins ran 2.03-2.12x (four
    # stored runs): Y's first-touch work is not a colocated job's steady state.
    go_at, y1, yl = x[warmup + measured][0], y[warmup][0], y[-1][0]
    before = _steps([x], -1e18, go_at, warmup, partner)["corrected"]
    after = _steps([x], yl, 1e18, warmup, partner)["corrected"]
    together = _steps([x], y1, yl, warmup, partner)["corrected"]
    alone = before + after
    if len(alone) < 2 or len(together) < 2:
        raise RuntimeError(f"colocation profile: {len(alone)} alone and {len(together)} together steps of X "
                           f"(need 2 each)")
    held = len(set(cores[0]) | set(cores[1]))
    return {"alone_s": statistics.median(alone), "together_s": statistics.median(together),
            "alone_n": len(alone), "together_n": len(together), "device_s": wall * held,
            "x_t": [round(rec[0], 6) for rec in x], "y_t": [round(rec[0], 6) for rec in y]}


def profile_points(points: list[tuple[dict, list[int]]], warmup: int | list[int],
                   timeout_s: float = 300.0) -> tuple[list[dict], float]:
    """A cheap profiling job: one process runs each single-rank ``(workload, cores)``
    point in turn, pinned to that point's cores with one thread per core (its quota;
    ``steps`` = warmup + measured; ``warmup``: one count for every point, or one per
    point — the process is warm after its first). Returns (per point ``{"step_s", "wall_s"}``
    as in :func:`run_jobs` (``faults`` too), and ``mb_frac``: the median forward + backward time of its
    micro-batches (the runtime's phases) over the median raw step, None when a step did
    not report them; device-seconds of the job: each point's time, model build
    included, times its cores, plus start-up and gaps times the cores held then)."""
    warm = list(warmup) if isinstance(warmup, (list, tuple)) else [warmup] * len(points)
    if len(warm) != len(points):
        raise ValueError(f"warmup: {len(warm)} counts for {len(points)} points")
    ctx = mp.get_context("fork")
    t_begin = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-prof-") as tmp:
        path = os.path.join(tmp, "prof")
        specs = []
        for w, cores in points:
            spec = make_spec(w, len(cores))
            spec["dist"] = {"rank": 0, "world_size": 1}
            spec["cores"] = list(cores)
            specs.append(spec)
        _join([_start(ctx, specs, list(points[0][1]), path, 0.0)], timeout_s, [w for w, _ in points])
        runs = json.load(open(path, encoding="utf-8"))
        starts = json.load(open(path + ".starts", encoding="utf-8"))
        fbs = json.load(open(path + ".fb", encoding="utf-8"))
    t_end = time.monotonic()
    out = []
    device_s = 0.0
    for k, run in enumerate(runs):
        st = _steps([run], -1e18, 1e18, warm[k], None)
        fb = fbs[k][warm[k]:] if k < len(fbs) else []
        wall = statistics.median(st["raw"])
        # The share of a step that is its micro-batches' forward + backward (the
        # runtime's own phases, raw wall time like ``raw``), applied to the corrected step.
        whole = fb and len(fb) == len(st["raw"]) and all(v > 0 for v in fb)  # every measured step reported them
        frac = min(1.0, statistics.median(fb) / wall) if whole and wall > 0 else None
        out.append({"step_s": statistics.median(st["corrected"]), "wall_s": wall,
                    "steps": st["corrected"], "raw_steps": st["raw"], "mb_frac": frac,
                    "faults": step_faults(run, warm[k])})
        device_s += (run[-1][0] - starts[k]) * len(points[k][1])
    # Start-up and the gaps between points: the process holds the first point's cores
    # until it moves to the next point's (conservatively: the most the two held).
    gaps = [starts[0] - t_begin] + [starts[k + 1] - runs[k][-1][0] for k in range(len(runs) - 1)] \
        + [t_end - runs[-1][-1][0]]
    held = [len(points[0][1])] + [max(len(points[k][1]), len(points[k + 1][1])) for k in range(len(runs) - 1)] \
        + [len(points[len(runs) - 1][1])]
    device_s += sum(max(0.0, g) * c for g, c in zip(gaps, held))
    return out, device_s


# --------------------------------------------------------------------------- comm


def comm_table(sizes: list[int] | None = None, reps: int = 7, sync: bool = True,
               ops: tuple[str, ...] | None = None) -> tuple[list[dict], float]:
    """Gloo loopback micro-benchmark over 2 processes; (rows, device-seconds), with the
    synchronisation rows (``sync``), of ``ops`` (default: all of commbench's). The one
    implementation lives in profilerd/commbench.py (profilerd runs it too)."""
    from profilerd.commbench import OPS, table

    return table(sizes or [4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20], reps, sync=sync, ops=ops or OPS)
