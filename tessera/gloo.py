"""Gloo's TCP loop threads, kept from preempting the collective that woke them (Linux).

The problem (measured on this project's 2-vCPU VM, kernel 6.18, EEVDF, HZ=250): a gloo
collective runs on a ``pt_gloo_runloop`` worker thread; gloo's ``gloo_tcp_loop`` thread
(one per gloo device, epoll) moves the bytes. When the worker wakes the loop thread on
the same core, the loop thread preempts it on wake-up and then stays on the CPU, in user
space, until the scheduler's tick takes the core back (a sched_switch trace: the loop
thread ran 2.8 ms straight while the preempted worker sat runnable; /proc samples of
its kernel stack: empty, i.e. user code, about half the time). Every such collective
takes 2-6 ms instead of 0.2-0.5 ms, 30-55 % of them at random: a 4 KiB all-reduce
between two ranks pinned one core each averaged 1.35-1.57 ms (median 0.19-0.30), a
256 KiB one 1.6-2.2 ms (median 0.3-0.4).

The fix: run the loop threads ``SCHED_BATCH``. A batch thread never preempts on
wake-up, so the worker finishes its part and blocks, and the loop thread then runs
at once on the idle core; CFS fairness between the threads is unchanged (same nice).
Same measurement: 0.16-0.21 ms mean for 4 KiB, 0.21-0.38 ms for 256 KiB, no slow mode.
``python -m bench.gloo_wakeup`` measures it.

Contract: :func:`calm_loop_threads` is idempotent and cheap (one /proc/self/task scan);
call it after creating gloo process groups (``init_process_group``, ``new_group``:
each creates its device's loop thread then). It changes only threads of the calling
process named ``gloo_tcp_loop``; lowering a thread to SCHED_BATCH needs no privilege.
It never raises: a kernel or sandbox that refuses leaves the thread as it was. The
environment variable ``TESSERA_GLOO_BATCH_LOOP=0`` turns it off (for comparisons).
"""

from __future__ import annotations

import os

from tessera.procfs import read_proc

LOOP_THREAD = b"gloo_tcp_loop"
ENV = "TESSERA_GLOO_BATCH_LOOP"


def enabled(env: dict | None = None) -> bool:
    """False where ``TESSERA_GLOO_BATCH_LOOP`` is ``0``/``false``/``no``/``off``."""
    value = (os.environ if env is None else env).get(ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def loop_threads(pid: int | str = "self") -> list[int]:
    """Thread ids of ``pid``'s gloo TCP loop threads (empty off Linux or without gloo)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            if read_proc(f"/proc/{pid}/task/{tid}/comm").strip() == LOOP_THREAD:
                out.append(int(tid))
        except (OSError, ValueError):
            continue  # the thread exited between the listing and the read
    return sorted(out)


def calm_loop_threads() -> int:
    """Put this process's gloo loop threads under SCHED_BATCH (see the module doc).
    Returns how many threads are SCHED_BATCH afterwards (0 when disabled, when there are
    none, or when the platform has no ``sched_setscheduler``)."""
    if not enabled() or not hasattr(os, "SCHED_BATCH"):
        return 0
    done = 0
    for tid in loop_threads():
        try:
            if os.sched_getscheduler(tid) != os.SCHED_BATCH:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            done += 1
        except OSError:
            continue  # gone, or refused: gloo still works, only slower
    return done
