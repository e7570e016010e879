"""Pure mutations of a job record shared by the controller's write paths (core, actions):
phase transitions, decisions, and the allocation keys a placement holds; and which jobs
are the controller's own profiling jobs (profiling, fusion)."""

from __future__ import annotations

import re

from tessera.api.v1 import types_pb2

PROFILE_TENANT = "tessera-system"
PROFILE_PREFIX = "profile-"


def is_profile_job(job: types_pb2.Job) -> bool:
    """A profiling job the controller submitted (controller/profiling.py)."""
    return job.spec.tenant == PROFILE_TENANT and job.spec.name.startswith(PROFILE_PREFIX)


# status.history keeps its first entry (the submission) and the last HISTORY_KEEP entries:
# a job requeued over and over (transient launch refusals, preemptions, relaunches) would
# otherwise grow its record until etcd refuses every write of it (max request size).
HISTORY_KEEP = 50
_DROPPED_RE = re.compile(r" \[(\d+) later transitions dropped from this history\]$")


def dropped_transitions(job: types_pb2.Job) -> int:
    """How many transitions :func:`transition` dropped from ``job``'s history (counted in
    the first entry's reason)."""
    h = job.status.history
    m = _DROPPED_RE.search(h[0].reason) if h else None
    return int(m.group(1)) if m else 0


def transition(job: types_pb2.Job, phase: int, reason: str, now: float) -> None:
    """Move ``job`` to ``phase`` and record the transition (no-op history if unchanged).
    The history stays bounded: its first entry and the last ``HISTORY_KEEP`` are kept;
    the entries dropped in between are counted in the first entry's reason
    (``"... [N later transitions dropped from this history]"``, :func:`dropped_transitions`)."""
    if job.status.phase != phase:
        job.status.history.add(phase=phase, time=now, reason=reason)
    job.status.phase = phase
    job.status.reason = reason
    h = job.status.history
    extra = len(h) - 1 - HISTORY_KEEP
    if extra > 0:
        n = dropped_transitions(job) + extra
        first = _DROPPED_RE.sub("", h[0].reason)
        del h[1:1 + extra]
        h[0].reason = f"{first} [{n} later transitions dropped from this history]"


def alloc_keys(shards) -> list[tuple[str, str]]:
    """(node, partition id) of every rank of ``shards`` (device ids for older records)."""
    return [(s.node, pid) for s in shards for pid in (list(s.partition_ids) or list(s.device_ids))]


def decide(job: types_pb2.Job, policy: str, action: str, reason: str, now: float, decision_id: str,
           quota: float = 1.0) -> None:
    """Record a scheduling decision on ``job`` (structured, and as the ``decision`` text)."""
    job.status.last_decision.CopyFrom(types_pb2.Decision(policy=policy, action=action, reason=reason[:500], time=now,
                                                         decision_id=decision_id, quota=quota))
    job.status.decision = f"{policy}: {action}: {reason}"[:600]
