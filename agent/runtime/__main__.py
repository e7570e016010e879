"""``python -m agent.runtime --spec SPEC.json``: one executor process (one rank).

Contract: reads the spec, dispatches on ``workload.type`` through :data:`RUNNERS`
(imported lazily, so one workload's dependencies never break another), and exits with
the runner's code. Unknown type or unreadable spec: an ``error`` event and exit 2.
SIGTERM sets ``agent.runtime.train.STOP`` (runners checkpoint and leave at the next
step boundary); if the runner has not returned ``TERM_GRACE_S`` seconds later the
process exits 143 anyway, even when blocked inside a collective.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import json
import os
import signal
import sys
import threading

from agent.runtime.report import Reporter

RUNNERS: dict[str, str] = {
    "gpt": "agent.runtime.train:run",
    "peft": "agent.runtime.peft.workload:run",
    "multimodal": "agent.runtime.multimodal.workload:run",
}

TERM_GRACE_S = float(os.environ.get("TESSERA_TERM_GRACE_S", "8"))
EXIT_SPEC, EXIT_TERM = 2, 143


def resolve(workload_type: str):
    """The ``run(spec, reporter) -> int`` callable of a workload type; KeyError if unknown."""
    module, _, attr = RUNNERS[workload_type].partition(":")
    return getattr(importlib.import_module(module), attr)


def _watch_sigterm(stop: threading.Event) -> None:
    # SIGTERM is blocked in every thread and taken synchronously here, so it is seen
    # even while the main thread sits in a C call (a gloo collective) where a Python
    # signal handler would never run.
    signal.sigwait({signal.SIGTERM})
    stop.set()
    timer = threading.Timer(TERM_GRACE_S, lambda: os._exit(EXIT_TERM))
    timer.daemon = True  # a runner that returns in time must not wait for it
    timer.start()


def install_sigterm() -> threading.Event:
    """Route SIGTERM to the shared stop event; call before any other thread starts."""
    # Block first: importing torch starts threads, and a thread that does not block
    # SIGTERM would take it with the default action (die with no checkpoint).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    from agent.runtime.train import STOP  # the event every runner polls

    threading.Thread(target=_watch_sigterm, args=(STOP,), name="sigterm", daemon=True).start()
    return STOP


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agent.runtime", description="Tessera executor (one rank)")
    ap.add_argument("--spec", required=True, help="path of the executor spec (JSON)")
    args = ap.parse_args(argv)
    try:
        with open(args.spec, encoding="utf-8") as f:
            spec = json.load(f)
        if not isinstance(spec, dict):
            raise ValueError("spec must be a JSON object")
    except (OSError, ValueError) as e:
        Reporter().event("error", message=f"cannot read spec {args.spec}: {e}", field="spec")
        return EXIT_SPEC
    dist_spec = spec.get("dist") or {}
    rank = dist_spec.get("rank", 0) if isinstance(dist_spec, dict) else 0
    workload = spec.get("workload") or {}
    wtype = workload.get("type") if isinstance(workload, dict) else None
    if wtype not in RUNNERS:
        Reporter().event(
            "error", message=f"unknown workload.type {wtype!r} (known: {sorted(RUNNERS)})", field="workload.type", rank=rank
        )
        return EXIT_SPEC
    install_sigterm()
    # SIGUSR1: every thread's Python stack into the log (the agent asks for it before it
    # kills a stalled executor); faulthandler writes from the signal handler itself, so
    # it works while the main thread is stuck in a C call or another thread holds the GIL.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from tessera import log

    log.setup("executor", job_id=str(spec.get("job_id", "")), rank=rank, workload=wtype)
    try:
        runner = resolve(wtype)
    except ImportError as e:
        Reporter().event("error", message=f"workload {wtype!r} is not available: {e}", rank=rank)
        return 1
    # What the imports made (torch and the runner: ~200,000 objects) lives as long as the
    # process: out of the collector's way, so that a full collection during training walks
    # only what training made (one walked all of it in 165 ms, 3.5 steps of a 4 x 128
    # GPT). A forked executor's zygote froze its own already.
    gc.freeze()
    # Only rank 0 reports progress; runners report errors on every rank themselves.
    reporter = Reporter(enabled=(rank == 0))
    try:
        return int(runner(spec, reporter))
    except Exception as e:  # noqa: BLE001 - a runner that raises still ends with an event
        Reporter().event("error", message=f"{type(e).__name__}: {e}", rank=rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
