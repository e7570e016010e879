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
    # Fields below were added for the Tessera policy and the simulator; all optional.
    iterations: int = 0            # iterations to run in all (0 = unknown: policy uses 1)
    done_iterations: float = 0.0   # progress so far (checkpointed)
    gpu_fraction: float = 1.0      # < 1: asks for a share of one device (PEFT, small jobs)
    backbone: str = ""             # LoRA jobs on the same frozen backbone may be fused
    encoder_share: float = 0.0     # multimodal: measured fraction of step time in the encoder
    elastic: bool = True           # False: run exactly ``num_devices`` of ``device_kind``
    # False: ordered like any job, but takes only free (or shared) devices, never a running
    # job's (non-preempting priority, Kubernetes' ``preemptionPolicy: Never``): the
    # controller's profiling jobs, which must not stop the job they profile.
    preempts: bool = True


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
    # Added with defaults: what the placement means beyond devices.
    gpu_type: str = ""              # device model of every shard (placements are homogeneous)
    plan: "Plan | None" = None      # parallelism chosen from the job's grid cell
    quota: float = 1.0              # share of each listed device the job may use (0..1]
    group: str = ""                 # colocation group id when the devices are shared

    @property
    def num_devices(self) -> int:
        return sum(len(s.device_ids) for s in self.shards)


@dataclass(frozen=True)
class Plan:
    """A parallelism plan: ``n_nodes`` x ``gpus_per_node`` devices, ``stages`` pipeline
    stages (0 = the estimator's best plan, not spelled out), and its estimated seconds
    per iteration. ``encoder_ranks`` is the encoder share of a multimodal job's ranks."""

    n_nodes: int
    gpus_per_node: int
    stages: int = 0
    est_iter_time: float = 0.0
    encoder_ranks: int = 0

    @property
    def num_devices(self) -> int:
        return self.n_nodes * self.gpus_per_node


@dataclass(frozen=True)
class RunningJob:
    """A job that currently holds devices. ``since`` is when its current placement started."""

    job: JobView
    placement: Placement
    since: float = 0.0


@dataclass(frozen=True)
class Resize:
    """Move a running job to ``placement``: kind is "shrink", "expand", "type-change" or
    "migrate". The job checkpoints and relaunches; ``cost_s`` is the restart time charged."""

    job_id: str
    placement: Placement
    kind: str
    cost_s: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class Preempt:
    """Stop a running job at a checkpoint and return it to the queue."""

    job_id: str
    reason: str = ""


@dataclass(frozen=True)
class ColocationGroup:
    """Jobs sharing the same devices. ``mode``: "fused-spatial" / "fused-temporal" (LoRA
    tasks on one backbone in one executor), "mps" / "timeslice" / "cpuset" (separate
    executors with quotas), "modules" (a multimodal job's modules colocated).
    ``members`` pairs a job id with its quota (share of each device, sum <= 1)."""

    group_id: str
    node: str
    device_ids: tuple[str, ...]
    members: tuple[tuple[str, float], ...]
    mode: str = "mps"
    reason: str = ""


@dataclass(frozen=True)
class Reshard:
    """Change a multimodal job's encoder:LLM rank split to ``encoder_ranks`` of its ranks."""

    job_id: str
    encoder_ranks: int
    llm_ranks: int
    cost_s: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class Repartition:
    """Re-decide the quotas inside a colocation group. ``live`` when the mechanism can
    change quotas in place (CPU core sets); else by checkpoint and relaunch (MPS, MIG)."""

    group_id: str
    quotas: tuple[tuple[str, float], ...]
    live: bool = False
    cost_s: float = 0.0
    reason: str = ""


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
    # Any object answering the questions of ``controller.policy.estimator.Estimator``;
    # None: policies that need estimates fall back to the requested resources.
    estimator: object | None = None
    tenant_quotas: tuple[tuple[str, int], ...] = ()   # tenant -> max devices held (0 = none)
    # Running groups as the caller knows them (for repartition decisions).
    groups: tuple[ColocationGroup, ...] = ()


@dataclass(frozen=True)
class ScheduleReply:
    placements: tuple[Placement, ...] = ()
    infeasible: tuple[Infeasible, ...] = ()
    resizes: tuple[Resize, ...] = ()
    preemptions: tuple[Preempt, ...] = ()
    colocations: tuple[ColocationGroup, ...] = ()
    reshards: tuple[Reshard, ...] = ()
    repartitions: tuple[Repartition, ...] = ()
    starving: tuple[str, ...] = ()   # pending jobs past the waiting bound (reported)
    # Later actions (resize, migrate, preempt, colocate, reshard) are added as new
    # fields with defaults; the controller ignores what it does not carry out yet.
    extra: dict = field(default_factory=dict)


class Policy(Protocol):
    """A scheduling policy. Must be deterministic for a given request."""

    name: str

    def schedule(self, request: ScheduleRequest) -> ScheduleReply: ...
