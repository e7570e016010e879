"""The colocation micro-benchmark: one module alone, then beside its twin, then alone again.

What it measures is the interference the performance model prices for jobs that share a
device (``tessera.perfmodel.fit_interference``): for each mode a row ``{"mode",
"colocated": 2, "oversubscription", "alone_s", "together_s", "alone_n", "together_n"}``
plus the module's shape (``layers``, ``hidden``, ``heads``, ``vocab``, ``rows``, ``seq``:
the estimator scales g by a candidate's share of element-wise work over this module's,
``PerfModel.interference_ref``). Modes: ``split`` — the twin on another core (two jobs on
disjoint cores of one CPU; oversubscription 1), ``shared`` — the twin on the same core
(time slicing; oversubscription 2).

Protocol per mode (the same as ``bench._measure.colocation_profile``, whose pairs the
accuracy benchmark fits; here through the executor's own command line, ``python -m
agent.runtime --spec``, so nothing of the agent is imported): job X (``MODULE`` at
``ROWS`` rows, 1 thread, pinned to its core) runs ``warmup`` + ``measured`` steps alone;
then its twin Y starts (same workload, pinned to the other core or the same one) and
runs ``warmup`` + ``together`` steps and exits; X goes on until ``measured`` of its steps
began after Y's process exited, and is stopped (SIGTERM: it leaves at a step boundary).
X's steps are placed in time by when their ``progress`` events arrived: alone = its steps
after its warm-up that ended before Y was started or began after Y had exited;
together = its steps that began after Y's warm-up and ended before Y's last step
(:func:`classify`). Alone and together are seconds apart in one process, so the host's
drift (20-40 % over seconds on a shared VM) does not land on the ratio. Medians of the
reported step times (raw: nothing subtracted for other tenants).

Mode ``ranks`` is no pair of jobs but one job's own ranks: the same module as a 2-stage
pipeline (pp = 2, one micro-batch, ``ROWS`` rows), rank 0 on core A and rank 1 on core B,
gloo over loopback, ``warmup`` + ``measured`` (``RANK_MEASURED``) steps; its row
``{"mode": "ranks", "seconds", "n", "dp", "tp", "pp", "micro_batches", "quota"}`` plus
the module's shape is the median of rank 0's measured step times. It is the accuracy benchmark's rank profile
(``bench.estimator_accuracy.RANK_PROFILES``): the estimator fits from it what ranks of
one plan lose beside each other on one CPU beyond what its own compute, communication
and pipeline terms price (``tessera.perfmodel.fit_rank_interference``; g 0.10-0.27 on
the 2-vCPU host of 2026-12-07, where a split pair of two independent jobs read
0.00-0.05) — the mode "pipeline" of its pp = 2 plan, which prices pipelines (dp / tp
plans: their straggler wait and the split pair's g).

Run as ``python -m profilerd.colobench [--cores A,B] [--modes split shared ranks]`` it
prints one JSON document ``{"rows": [...], "device_s": ...}`` (device-seconds: wall time x
the cores held); profilerd (``--colocation-benchmark``) runs it that way in a fresh
process and reports the pairs to the estimator as ``kind="colocation"`` measurements and
the ``ranks`` row as a ``kind="ranks"`` one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from tessera.ports import free_port as _free_port

# The module whose pairs are measured: the accuracy benchmark's model "A" at 8 rows of 64
# tokens (its COLO_PROFILE), a step of ~5-10 ms on one core here.
MODULE = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 64}
ROWS = 8
MODES = ("split", "shared")  # pairs of jobs
RANKS = "ranks"  # one job's own ranks: a 2-stage pipeline (module docstring)
ALL_MODES = MODES + (RANKS,)
PREFIX = "TESSERA_EVENT "  # agent/runtime/report.py's line format (a contract, not an import)
X_STEPS = 1_000_000  # X runs until stopped


def shape() -> dict:
    """The measured module's shape as the rows carry it (``interference_ref``'s keys)."""
    return {"layers": MODULE["layers"], "hidden": MODULE["hidden"], "heads": MODULE["heads"],
            "vocab": MODULE["vocab"], "rows": ROWS, "seq": MODULE["seq_len"]}


def classify(x: list[tuple[float, float]], warmup: int, go_at: float, y_first: float,
             y_last: float, y_gone: float) -> tuple[list[float], list[float]]:
    """X's step times split into (alone, together). ``x``: per step, (when its progress
    event arrived, its step time) in step order; ``go_at``: when Y was started;
    ``y_first``: when Y's last warm-up step ended (its measured steps begin); ``y_last``:
    when Y's last step ended; ``y_gone``: when Y's process had exited (its interpreter's
    teardown after its last step takes a second or two of the core: a time-sliced X
    runs at half speed meanwhile). Alone: steps after X's first ``warmup`` that ended by
    ``go_at`` or began at or after ``y_gone``; together: steps that began at or after
    ``y_first`` and ended by ``y_last``. Pure."""
    alone, together = [], []
    for i, (end, dt) in enumerate(x):
        start = end - dt
        if i >= warmup and (end <= go_at or start >= y_gone):
            alone.append(dt)
        elif start >= y_first and end <= y_last:
            together.append(dt)
    return alone, together


class _Child:
    """One executor process and the step events it printed (arrival time, step time)."""

    def __init__(self, argv: list[str], cores: set[int], env: dict, cond: threading.Condition) -> None:
        self.cond = cond
        self.steps: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.exited_at: float | None = None  # when its output closed and it was reaped
        self.err = tempfile.TemporaryFile()
        # Affinity is inherited: set ours, spawn, restore (no race with the child's threads).
        mine = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cores)
        try:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.err, env=env, text=True)
        finally:
            os.sched_setaffinity(0, mine)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith(PREFIX):
                continue
            try:
                ev = json.loads(line[len(PREFIX):])
            except json.JSONDecodeError:
                continue
            now = time.monotonic()
            with self.cond:
                if ev.get("event") == "progress" and "step_time_s" in ev:
                    self.steps.append((now, float(ev["step_time_s"])))
                elif ev.get("event") == "error":
                    self.errors.append(str(ev.get("message", "")))
                self.cond.notify_all()
        self.proc.wait()
        with self.cond:
            self.exited_at = time.monotonic()
            self.cond.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def why(self, what: str) -> str:
        self.err.seek(0)
        tail = self.err.read()[-400:].decode(errors="replace").strip()
        return (f"{what} exited {self.proc.returncode} after {len(self.steps)} steps"
                + (f": {self.errors[-1]}" if self.errors else "") + (f" ({tail})" if tail else ""))

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()
        self.reader.join(5)
        self.err.close()


def _spec(tmp: str, name: str, steps: int, plan: dict | None = None, dist: dict | None = None) -> str:
    w = {"type": "gpt", "model": dict(MODULE), "steps": steps, "batch_size": ROWS, "learning_rate": 1e-3,
         "seed": 0, "checkpoint_every": 0, "data": {"kind": "synthetic"}}
    if plan:
        w["plan"] = dict(plan)
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"job_id": f"colobench-{name}", "workload": w, "threads": 1,
                   "dist": dist or {"rank": 0, "world_size": 1}}, f)
    return path


def _child_env() -> dict:
    """An executor child's environment: one OpenMP thread (its quota is one core), no GPU."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


# The plan of the ``ranks`` row: the accuracy benchmark's rank profile (RANK_PROFILES).
RANK_PLAN = {"dp": 1, "tp": 1, "pp": 2, "micro_batches": 1}
# Measured steps of the ``ranks`` row. Its cost is the two processes' start (~5 s of wall
# for ~0.2 s of steps), so more steps are nearly free, and the row is measured once where
# the benchmark has 9 rounds: 5 steps read 15.4-21.6 ms over three runs here, 15 steps
# 19.7-22.7 ms over four (2026-12-07, the 2-vCPU host).
RANK_MEASURED = 20


def ranks(cores: tuple[int, int], warmup: int = 3, measured: int = RANK_MEASURED, timeout_s: float = 120.0,
          python: str = sys.executable) -> dict:
    """The ``ranks`` row (module docstring): ``MODULE`` as a pp = 2 pipeline, rank 0 on
    ``cores[0]``, rank 1 on ``cores[1]``; the median of rank 0's step times after
    ``warmup``. RuntimeError naming the rank at fault when one fails or the run
    outlives ``timeout_s``; both processes are killed and reaped whatever happens."""
    if warmup < 0 or measured < 2:
        raise ValueError("warmup >= 0 and measured >= 2")
    if len(set(cores)) < 2:
        raise ValueError(f"cores: two distinct cores for the two ranks, got {cores}")
    env = _child_env()
    cond = threading.Condition()
    steps = warmup + measured
    t0 = time.monotonic()
    kids: list[_Child] = []
    with tempfile.TemporaryDirectory(prefix="tessera-colobench-") as tmp:
        try:
            port = _free_port()
            for r in (0, 1):
                dist = {"rank": r, "world_size": 2, "master_addr": "127.0.0.1", "master_port": port,
                        "backend": "gloo", "timeout_s": max(10.0, timeout_s)}
                kids.append(_Child([python, "-m", "agent.runtime", "--spec",
                                    _spec(tmp, f"rank{r}", steps, RANK_PLAN, dist)], {cores[r]}, env, cond))
            deadline = t0 + timeout_s
            for k in kids:
                k.reader.join(max(0.1, deadline - time.monotonic()))
            for r, k in enumerate(kids):
                if k.reader.is_alive():
                    raise RuntimeError(f"colocation benchmark ({RANKS}): rank {r} not done within {timeout_s:g} s "
                                       f"({len(k.steps)} steps)")
                if k.proc.returncode != 0:
                    raise RuntimeError(f"colocation benchmark ({RANKS}): " + k.why(f"rank {r}"))
            with cond:
                got = [dt for _, dt in kids[0].steps]
        finally:
            for k in kids:
                k.kill()
    wall = time.monotonic() - t0
    if len(got) < steps:
        raise RuntimeError(f"colocation benchmark ({RANKS}): rank 0 reported {len(got)} of {steps} steps")
    return {"mode": RANKS, "seconds": statistics.median(got[warmup:]), "n": len(got) - warmup, **RANK_PLAN,
            "quota": 1.0, **shape(), "device_s": wall * 2}


def pair(mode: str, cores: tuple[int, int], warmup: int = 3, measured: int = 5, together: int = 10,
         timeout_s: float = 120.0, python: str = sys.executable) -> dict:
    """One mode's row (module docstring). ``cores``: X's core and, for ``split``, Y's (for
    ``shared`` Y runs on X's). RuntimeError naming the side at fault when a child fails,
    when the run outlives ``timeout_s``, or when X has fewer than 2 alone or together
    steps; the children are killed and reaped whatever happens."""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r}, expected one of {MODES}")
    if warmup < 0 or measured < 2 or together < 2:
        raise ValueError("warmup >= 0, measured >= 2 and together >= 2")
    cx, cy = cores[0], (cores[1] if mode == "split" else cores[0])
    env = _child_env()
    cond = threading.Condition()
    deadline = time.monotonic() + timeout_s
    t0 = time.monotonic()
    kids: list[_Child] = []

    def wait(pred, what: str) -> None:
        with cond:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"colocation benchmark ({mode}): {what} not within {timeout_s:g} s")
                cond.wait(min(left, 1.0))

    with tempfile.TemporaryDirectory(prefix="tessera-colobench-") as tmp:
        try:
            x = _Child([python, "-m", "agent.runtime", "--spec", _spec(tmp, "x", X_STEPS)], {cx}, env, cond)
            kids.append(x)
            wait(lambda: len(x.steps) >= warmup + measured or not x.alive(), "X's first steps")
            if not x.alive():
                raise RuntimeError(f"colocation benchmark ({mode}): " + x.why("X"))
            go_at = time.monotonic()
            y = _Child([python, "-m", "agent.runtime", "--spec", _spec(tmp, "y", warmup + together)], {cy}, env, cond)
            kids.append(y)
            wait(lambda: not y.alive() or not x.alive(), "the twin's steps")
            y.reader.join(max(0.1, deadline - time.monotonic()))
            if y.proc.returncode != 0 or len(y.steps) < warmup + together:
                raise RuntimeError(f"colocation benchmark ({mode}): " + y.why("the twin Y"))
            y_first = y.steps[warmup - 1][0] if warmup > 0 else go_at
            y_last, y_gone = y.steps[-1][0], y.exited_at
            wait(lambda: sum(1 for end, dt in x.steps if end - dt >= y_gone) >= measured or not x.alive(),
                 "X's steps after the twin")
            if not x.alive():
                raise RuntimeError(f"colocation benchmark ({mode}): " + x.why("X"))
            x.proc.send_signal(signal.SIGTERM)  # leaves at its next step boundary
            x.proc.wait(max(0.1, deadline - time.monotonic()))
            x.reader.join(5)
            with cond:
                steps = list(x.steps)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"colocation benchmark ({mode}): X did not stop within {timeout_s:g} s") from None
        finally:
            for k in kids:
                k.kill()
    wall = time.monotonic() - t0
    alone, tog = classify(steps, warmup, go_at, y_first, y_last, y_gone)
    if len(alone) < 2 or len(tog) < 2:
        raise RuntimeError(f"colocation benchmark ({mode}): {len(alone)} alone and {len(tog)} together steps of X "
                           f"(need 2 each)")
    return {"mode": mode, "colocated": 2, "oversubscription": 1.0 if mode == "split" else 2.0,
            "alone_s": statistics.median(alone), "together_s": statistics.median(tog),
            "alone_n": len(alone), "together_n": len(tog), **shape(),
            "device_s": wall * len({cx, cy})}


def table(cores: tuple[int, ...], modes=ALL_MODES, **kw) -> tuple[list[dict], float]:
    """Every mode's row in turn (``split`` and ``ranks`` need two distinct cores and are
    left out with one) and the device-seconds of all of them. ``kw``: ``pair``'s
    (``ranks`` takes its ``warmup``, ``measured`` and ``timeout_s``)."""
    rows = []
    for mode in modes:
        if mode in ("split", RANKS) and len(set(cores)) < 2:
            continue
        if mode == RANKS:
            rows.append(ranks((cores[0], cores[-1]), **{k: v for k, v in kw.items()
                                                         if k in ("warmup", "measured", "timeout_s", "python")}))
        else:
            rows.append(pair(mode, (cores[0], cores[-1]), **kw))
    return rows, sum(r["device_s"] for r in rows)


def _cores(text: str) -> tuple[int, ...]:
    try:
        cores = tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--cores: expected core ids like 0,1, got {text!r}") from None
    if not 1 <= len(cores) <= 2 or any(c < 0 for c in cores):
        raise argparse.ArgumentTypeError(f"--cores: one or two core ids >= 0, got {text!r}")
    return cores


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m profilerd.colobench",
                                 description="colocation micro-benchmark (JSON rows on stdout)")
    ap.add_argument("--cores", type=_cores, default=None,
                    help="X's core and the split twin's (the ranks' cores), e.g. 0,1 (default: the first two this "
                         "process may run on)")
    ap.add_argument("--modes", nargs="+", choices=ALL_MODES, default=list(ALL_MODES),
                    help="split and shared: pairs of jobs; ranks: one job's 2-stage pipeline (default: all)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per mode")
    a = ap.parse_args(argv)
    cores = a.cores or tuple(sorted(os.sched_getaffinity(0))[:2])
    allowed = os.sched_getaffinity(0)
    if any(c not in allowed for c in cores):
        print(f"--cores: {','.join(map(str, cores))} not all in this process's cores {sorted(allowed)}", file=sys.stderr)
        return 2
    try:
        rows, dev_s = table(cores, a.modes, timeout_s=a.timeout_s)
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        return 1
    json.dump({"rows": rows, "device_s": dev_s}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
