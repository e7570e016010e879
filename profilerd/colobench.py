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

Run as ``python -m profilerd.colobench [--cores A,B] [--modes split shared]`` it prints
one JSON document ``{"rows": [...], "device_s": ...}`` (device-seconds: wall time x the
cores held); profilerd (``--colocation-benchmark``) runs it that way in a fresh process
and reports the rows to the estimator as ``kind="colocation"`` measurements.
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

# The module whose pairs are measured: the accuracy benchmark's model "A" at 8 rows of 64
# tokens (its COLO_PROFILE), a step of ~5-10 ms on one core here.
MODULE = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq_len": 64}
ROWS = 8
MODES = ("split", "shared")
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


def _spec(tmp: str, name: str, steps: int) -> str:
    w = {"type": "gpt", "model": dict(MODULE), "steps": steps, "batch_size": ROWS, "learning_rate": 1e-3,
         "seed": 0, "checkpoint_every": 0, "data": {"kind": "synthetic"}}
    path = os.path.join(tmp, f"{name}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"job_id": f"colobench-{name}", "workload": w, "threads": 1, "dist": {"rank": 0, "world_size": 1}}, f)
    return path


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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
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


def table(cores: tuple[int, ...], modes=MODES, **kw) -> tuple[list[dict], float]:
    """Every mode's row in turn (``split`` needs two distinct cores and is left out with
    one) and the device-seconds of all of them."""
    rows = []
    for mode in modes:
        if mode == "split" and len(set(cores)) < 2:
            continue
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
                    help="X's core and the split twin's, e.g. 0,1 (default: the first two this process may run on)")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
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
