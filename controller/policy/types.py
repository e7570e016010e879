"""Value objects of the scheduling policy interface: ``schedule(request) -> reply``.

Pure: no gRPC, etcd, clock, NVML or torch imports. The controller builds a
``ScheduleRequest`` from an etcd snapshot, the simulator builds one from a trace;
both call the same policy. New fields must have defaults so old callers keep working.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class DeviceView:
    """One schedulable device (a GPU, or a CPU core set) of a node.

    ``capacity`` is in the device's own units (cores for a CPU core set, 100 for a
    whole GPU); ``kind`` is "cpu" or "gpu"; ``model`` e.g. "a100" or "cpu".
    """

    device_id: str
    kind: str = "cpu"
    model: str = "cpu"
    memory_bytes: int = 0
    capacity: int = 1


@dataclass(frozen=True)
class NodeView:
    """A node as the policy sees it; only ``ready`` nodes receive new placements."""

    name: str
    devices: tuple[DeviceView, ...] = ()
    ready: bool = True


@dataclass(frozen=True)
class JobView:
    """A job asking for ``num_devices`` whole devices of ``device_kind`` ("" = any).

    ``submit_time`` is seconds on any monotone clock the caller uses consistently;
    ``weight`` is the tenant's fair-share weight.
    """

    job_id: str
    tenant: str = "default"
    num_devices: int = 1
    device_kind: str = ""
    submit_time: float = 0.0
    weight: float = 1.0
    model: str = ""
    workload: str = "gpt"


@dataclass(frozen=True)
class Shard:
    """Devices of one node given to a job (its ranks on that node)."""

    node: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True)
class Placement:
    """Where a job runs: one shard per node, rank order = shard order then device order."""

    job_id: str
    shards: tuple[Shard, ...]
    reason: str = ""

    @property
    def num_devices(self) -> int:
        return sum(len(s.device_ids) for s in self.shards)


@dataclass(frozen=True)
class RunningJob:
    """A job that currently holds devices."""

    job: JobView
    placement: Placement


@dataclass(frozen=True)
class Infeasible:
    """A pending job the policy could not place this round, and why (data, not an error)."""

    job_id: str
    reason: str


@dataclass(frozen=True)
class ScheduleRequest:
    nodes: tuple[NodeView, ...]
    pending: tuple[JobView, ...]
    running: tuple[RunningJob, ...] = ()
    now: float = 0.0


@dataclass(frozen=True)
class ScheduleReply:
    placements: tuple[Placement, ...] = ()
    infeasible: tuple[Infeasible, ...] = ()
    # Later actions (resize, migrate, preempt, colocate, reshard) are added as new
    # fields with defaults; the controller ignores what it does not carry out yet.
    extra: dict = field(default_factory=dict)


class Policy(Protocol):
    """A scheduling policy. Must be deterministic for a given request."""

    name: str

    def schedule(self, request: ScheduleRequest) -> ScheduleReply: ...
