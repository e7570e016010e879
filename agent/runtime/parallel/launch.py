"""Run every rank of a job on this machine (tests, benchmarks, local development).

Contract: :func:`run_local` starts ``plan.world_size`` processes, each running the
workload's ``run(spec, reporter)`` as rank r with a loopback rendezvous on a free
port, waits for all of them, and returns their exit codes and rank 0's events. It is
the in-process equivalent of the agent starting ``python -m agent.runtime`` once per
rank. ``fork`` is the default start method because it skips re-importing torch in
every rank (seconds on a busy CPU); each rank should run with ``threads: 1``.
"""

from __future__ import annotations

import copy
import gc
import json
import multiprocessing as mp
import os
import tempfile
from dataclasses import dataclass

from agent.runtime.report import Reporter, parse_line
from tessera.ports import free_port


@dataclass
class LocalResult:
    exit_codes: list[int]
    events: list[dict]  # rank 0's events, in order

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]

    def losses(self) -> list[float]:
        return [e["loss"] for e in self.of("progress")]


def _rank_main(spec: dict, events_path: str) -> None:
    # A fork of a process with threads (a test runner's event loop, gRPC) inherits its
    # garbage too: a collection here could run a finalizer that joins one of the parent's
    # threads, which do not exist in this process, and hang the rank for good (seen: the
    # first import big enough to collect — sympy, at a pipeline stage's first backward).
    # What was there at the fork is never collected here.
    gc.freeze()
    from agent.runtime.__main__ import resolve

    code = 1
    with open(events_path, "w", encoding="utf-8") as f:
        try:
            rank = spec["dist"]["rank"]
            code = int(resolve(spec["workload"]["type"])(spec, Reporter(stream=f, enabled=rank == 0)))
        finally:
            f.flush()
            # Leave without running the parent's atexit hooks (forked copies of them).
            os._exit(code)


def _wait_all(procs: list, timeout_s: float) -> None:
    """Wait for every process; once one fails (or time runs out) kill the rest, which
    would otherwise block in a collective until the distributed timeout."""
    import time
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        wait([p.sentinel for p in pending], timeout=left)
        for p in list(pending):
            if p.exitcode is not None:
                pending.remove(p)
                if p.exitcode != 0:
                    deadline = time.monotonic()  # a failed rank: stop the others now
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def run_local(spec: dict, world_size: int, *, start_method: str | None = None, timeout_s: float = 120.0) -> LocalResult:
    """Run ``spec`` as ``world_size`` local ranks; kills them all after ``timeout_s``.

    ``start_method`` defaults to ``$TESSERA_LOCAL_START_METHOD`` or ``fork``.
    """
    ctx = mp.get_context(start_method or os.environ.get("TESSERA_LOCAL_START_METHOD", "fork"))
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tessera-local-") as tmp:
        procs = []
        for r in range(world_size):
            s = copy.deepcopy(spec)
            s["dist"] = {**s.get("dist", {}), "rank": r, "world_size": world_size,
                         "master_addr": "127.0.0.1", "master_port": port, "backend": "gloo",
                         "timeout_s": s.get("dist", {}).get("timeout_s", 60)}
            p = ctx.Process(target=_rank_main, args=(s, os.path.join(tmp, f"rank{r}.events")), daemon=True)
            p.start()
            procs.append(p)
        _wait_all(procs, timeout_s)
        events = []
        path = os.path.join(tmp, "rank0.events")
        if os.path.exists(path):  # absent when rank 0 died before starting
            with open(path, encoding="utf-8") as f:
                for line in f:
                    ev = parse_line(line)
                    if ev is not None:
                        events.append(ev)
        return LocalResult(exit_codes=[p.exitcode for p in procs], events=events)


def main() -> None:  # pragma: no cover - manual tool
    import sys

    spec = json.load(open(sys.argv[1]))
    world = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    res = run_local(spec, world)
    for e in res.events:
        print(json.dumps(e))
    sys.exit(max(res.exit_codes))


if __name__ == "__main__":  # pragma: no cover
    main()
