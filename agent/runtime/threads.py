"""Intra-op threads that follow the process's CPU grant.

Contract: the agent can change a running executor's cores in place (``UpdateGrant``;
:func:`agent.executors.pin_process` re-pins every thread of the process). The runtime
keeps its torch intra-op thread count proportional to the cores it may now run on, so
that after a grow the new cores are used and after a shrink the threads do not
oversubscribe the cores left.

:class:`ThreadFollower` is created at start with the executor's thread budget
``threads``; :meth:`ThreadFollower.poll` (one ``sched_getaffinity`` of the calling
thread: cheap enough for every step boundary) returns the new thread count when the
number of allowed cores changed since the previous poll — after setting it with
``torch.set_num_threads`` — and None otherwise. The new count is
``max(1, round(threads * cores / cores_at_start))``: a budget of one thread per core
stays one per core, an explicit smaller budget keeps its ratio. A budget of 0 (none
given) never changes anything. Pure apart from the affinity read and the torch call
(``affinity`` and ``set_threads`` can be injected for tests of the rule).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def scaled_threads(threads: int, cores_at_start: int, cores_now: int) -> int:
    """Thread count for ``cores_now`` cores, keeping the start's threads-per-core ratio."""
    if threads < 1 or cores_at_start < 1 or cores_now < 1:
        raise ValueError(f"threads, cores_at_start and cores_now must be >= 1, got {threads}, {cores_at_start}, {cores_now}")
    return max(1, round(threads * cores_now / cores_at_start))


class ThreadFollower:
    """Keeps torch's intra-op thread count proportional to the allowed cores; see module doc."""

    def __init__(self, threads: int, affinity: Callable[[], set[int]] | None = None,
                 set_threads: Callable[[int], None] | None = None) -> None:
        self._affinity = affinity or (lambda: os.sched_getaffinity(0))
        self._set = set_threads or torch.set_num_threads
        self.threads0 = max(0, int(threads or 0))
        self.cores0 = len(self._affinity())
        self.cores = self.cores0
        self.threads = self.threads0

    def poll(self) -> int | None:
        """The new thread count if the allowed core count changed (already applied), else None."""
        if self.threads0 < 1:
            return None
        cores = len(self._affinity())
        if cores == self.cores or cores < 1:
            return None
        self.cores = cores
        n = scaled_threads(self.threads0, self.cores0, cores)
        if n == self.threads:
            return None
        self.threads = n
        self._set(n)
        return n
