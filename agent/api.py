"""Thin AgentService servicer: fencing and incarnation checks, then the executor manager.

Codes: FAILED_PRECONDITION for a stale fencing token or incarnation; RESOURCE_EXHAUSTED
when the quota asked exceeds the partition's free capacity (the reason names the
partition, the amounts and the holders), at launch and at a live UpdateGrant;
FAILED_PRECONDITION also for an UpdateGrant on a partition that cannot change live
(MPS, MIG: checkpoint and relaunch instead); INVALID_ARGUMENT for a bad request;
INVALID_ARGUMENT names the field (``world_size``, ``device_ids``, an absolute
``checkpoint_dir``, ``runtime_spec_json.workload...``: ``spec_problem``); NOT_FOUND for
logs of a job this node never ran; UNAVAILABLE for a launch once the agent has begun
shutting down; INTERNAL for a launch the node itself cannot carry out (its log or
spec file cannot be written; nothing is spawned, the grant is released).

Ids: ``allocation_id`` and ``job_id`` name files under the state dir (specs, records,
logs), so every request that carries one is refused with INVALID_ARGUMENT naming the field
unless it is a safe id (``executors.id_problem``: ``[A-Za-z0-9._-]``, at most 128
characters, not "." or ".."), before anything is granted, spawned or written.

Fencing: a request's token is checked against the highest one seen first (a stale one is
refused), but it is recorded as the highest only once the request is accepted (passed
validation): a malformed request carrying a high token never locks out the real leader.
"""

from __future__ import annotations

import json
import math

import grpc

from agent.runtime.__main__ import RUNNERS  # names only: the runners' modules are imported lazily, by the runtime
from tessera import wire
from tessera.api.v1 import agent_pb2, agent_pb2_grpc, types_pb2

from .executors import BadRequest, CapacityError, ExecutorManager, NotRunning, ShuttingDown, id_problem
from .partitions import NotLive


# The workload types a runtime spec may name: the runtime's runners.
WORKLOAD_TYPES = tuple(sorted(RUNNERS))


class NodeState:
    """What the servicer needs to know of the node: its incarnation and the highest
    fencing token seen (a controller with a lower one was deposed)."""

    def __init__(self, name: str, devices) -> None:
        self.name = name
        self.devices = devices
        self.incarnation = ""
        self.max_token = 0

    def check_token(self, token: int) -> str | None:
        """Why ``token`` is refused (older than the highest accepted), or None. Records
        nothing: ``accept_token`` does, once the request passed validation."""
        if token < self.max_token:
            return f"fencing_token {token} is older than {self.max_token}: the sender is no longer the leader"
        return None

    def accept_token(self, token: int) -> None:
        """Record ``token`` of a request the agent accepted (carried out, or refused only for
        want of capacity); never for a request refused as invalid — by the servicer or by the
        executor manager — so a malformed request with a high token cannot lock out the
        real leader. Monotone: an older token accepted late changes nothing."""
        self.max_token = max(self.max_token, token)


MAX_TAIL_BYTES = wire.MAX_LOG_TAIL_BYTES  # ReadLogs' largest tail (the controller's GetJobLogs has the same bound)


def tail(path, n: int) -> tuple[str, bool]:
    """The last ``n`` bytes of the file at ``path`` (decoded, invalid UTF-8 replaced) and
    whether older bytes were cut off."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size > n:
            f.seek(size - n)
        data = f.read()
    return data.decode(errors="replace"), size > n


class AgentService(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, node: NodeState, mgr: ExecutorManager, stop_grace_s: float) -> None:
        self.node = node
        self.mgr = mgr
        self.stop_grace_s = stop_grace_s

    async def LaunchExecutor(self, request, context):
        if self.mgr.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "agent is shutting down; not launching new executors")
        why = self.node.check_token(request.fencing_token)
        if why:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        if request.incarnation != self.node.incarnation:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"incarnation: {request.incarnation!r} is not this node's current {self.node.incarnation!r}")
        for f in ("allocation_id", "job_id"):
            why = id_problem(f, getattr(request, f))
            if why:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if not request.runtime_spec_json:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "runtime_spec_json: is required")
        if request.world_size < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"world_size: must be >= 1, got {request.world_size}")
        if not 0 <= request.rank < request.world_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"rank: must be in [0, world_size={request.world_size}), got {request.rank}")
        try:
            spec = json.loads(request.runtime_spec_json)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"runtime_spec_json: not JSON ({e})")
        why = spec_problem(spec)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        try:
            ex, already = await self.mgr.launch(
                allocation_id=request.allocation_id, job_id=request.job_id, rank=request.rank,
                world_size=request.world_size, device_ids=list(request.device_ids), master_addr=request.master_addr,
                master_port=request.master_port, runtime_spec=spec, checkpoint_dir=request.checkpoint_dir,
                partition_id=request.partition_id, units=request.units, memory_bytes=request.memory_bytes,
            )
        except CapacityError as e:
            self.node.accept_token(request.fencing_token)  # a valid request the node could not satisfy
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ShuttingDown as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except OSError as e:
            # The node's own failure (its log or spec file cannot be written): nothing was
            # spawned, the grant was released.
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot launch on node {self.node.name}: {e}")
        # Recorded only now: a request the manager refused (unknown device or partition, a
        # bad grant) must not lock the real leader out with its token.
        self.node.accept_token(request.fencing_token)
        return agent_pb2.LaunchExecutorResponse(pid=ex.proc.pid if ex.proc else 0, already_running=already)

    async def StopExecutor(self, request, context):
        why = self.node.check_token(request.fencing_token)
        if why:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        why = id_problem("allocation_id", request.allocation_id)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if not math.isfinite(request.grace_s) or request.grace_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"grace_s: must be a finite number of seconds >= 0 (0: the agent's default), "
                                f"got {request.grace_s}")
        self.node.accept_token(request.fencing_token)
        n = await self.mgr.stop(request.allocation_id, request.grace_s or self.stop_grace_s)
        return agent_pb2.StopExecutorResponse(stopped=n)

    async def GetStatus(self, request, context):
        return agent_pb2.GetStatusResponse(
            node=self.node.name,
            incarnation=self.node.incarnation,
            devices=[to_proto(d) for d in self.node.devices],
            executors=[
                agent_pb2.ExecutorStatus(
                    allocation_id=e.allocation_id, job_id=e.job_id, rank=e.rank, pid=e.proc.pid if e.proc else 0,
                    device_ids=e.device_ids, running=e.running, exit_code=e.exit_code or 0,
                    log_path=str(e.log_path), step=e.step, loss=e.loss,
                    partition_id=e.grant.partition_id if e.grant else "", units=e.grant.units if e.grant else 0,
                )
                for e in self.mgr.executors.values()
            ],
            partitions=partitions_proto(self.mgr.parts),
        )

    async def ReadLogs(self, request, context):
        why = id_problem("job_id", request.job_id)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if not 0 <= request.tail_bytes <= MAX_TAIL_BYTES:
            # Bounded like the controller's GetJobLogs: a huge tail would read a whole
            # (possibly GiB) log into memory and exceed the reply's message limit.
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"tail_bytes: must be between 0 and {MAX_TAIL_BYTES} (0: the last 64 KiB), "
                                f"got {request.tail_bytes}")
        p = self.mgr.log_path(request.job_id)
        if not p.exists():
            await context.abort(grpc.StatusCode.NOT_FOUND, f"job {request.job_id} has no logs on node {self.node.name}")
        text, truncated = tail(p, request.tail_bytes or 64 << 10)
        return agent_pb2.ReadLogsResponse(text=text, truncated=truncated)

    async def ControlTask(self, request, context):
        why = self.node.check_token(request.fencing_token)
        if why:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        why = id_problem("allocation_id", request.allocation_id)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if request.op not in ("cancel", "add"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"op: must be 'cancel' or 'add', got {request.op!r}")
        if not request.task:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "task: is required")
        cmd: dict = {"op": request.op, "task": request.task}
        if request.op == "add":
            why, cmd = add_command(request)
            if why:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        try:
            path = self.mgr.append_control(request.allocation_id, cmd)
        except KeyError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))
        self.node.accept_token(request.fencing_token)  # only an accepted request (see LaunchExecutor)
        return agent_pb2.ControlTaskResponse(control_file=path)

    async def UpdateGrant(self, request, context):
        why = self.node.check_token(request.fencing_token)
        if why:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        why = id_problem("allocation_id", request.allocation_id)
        if why:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        if request.units < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"units: must be >= 1, got {request.units}")
        try:
            ex, g, old = self.mgr.update_grant(request.allocation_id, request.rank, request.units)
        except NotRunning as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except CapacityError as e:
            self.node.accept_token(request.fencing_token)  # a valid request the node could not satisfy
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except NotLive as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.node.accept_token(request.fencing_token)  # only an accepted request (see LaunchExecutor)
        return agent_pb2.UpdateGrantResponse(partition_id=g.partition_id, units=g.units, cores=list(g.cores),
                                             pid=ex.proc.pid, old_units=old)


def _kind(v) -> str:
    """The JSON name of ``v``'s type, for messages."""
    return ("null" if v is None else "a boolean" if isinstance(v, bool) else "a number" if isinstance(v, (int, float))
            else "a string" if isinstance(v, str) else "an array" if isinstance(v, list) else "an object")


def spec_problem(spec) -> str | None:
    """Why ``spec`` (a LaunchExecutor's parsed ``runtime_spec_json``) is no runtime spec the
    agent can launch, naming the field (``runtime_spec_json.workload...``); None when it is
    one. Checked: a JSON object with a ``workload`` object whose ``type`` is one of the
    runtime's runners (``WORKLOAD_TYPES``), and whose ``model``, ``plan``, ``peft``,
    ``multimodal`` sections, ``peft.tasks`` and each task's ``dataset``, when present, have
    the shape the agent reads (its profile labels) — the runtime validates the rest."""
    if not isinstance(spec, dict):
        return f"runtime_spec_json: must be a JSON object (a runtime spec), got {_kind(spec)}"
    w = spec.get("workload")
    if not isinstance(w, dict):
        return f"runtime_spec_json.workload: must be an object, got {_kind(w) if 'workload' in spec else 'none'}"
    if w.get("type") not in WORKLOAD_TYPES:
        return f"runtime_spec_json.workload.type: must be one of {', '.join(WORKLOAD_TYPES)}, got {w.get('type')!r}"
    for k in ("model", "plan", "peft", "multimodal"):
        if k in w and not isinstance(w[k], dict):
            return f"runtime_spec_json.workload.{k}: must be an object, got {_kind(w[k])}"
    tasks = (w.get("peft") or {}).get("tasks")
    if tasks is not None:
        if not isinstance(tasks, list):
            return f"runtime_spec_json.workload.peft.tasks: must be an array, got {_kind(tasks)}"
        for i, t in enumerate(tasks):
            if not isinstance(t, dict):
                return f"runtime_spec_json.workload.peft.tasks[{i}]: must be an object, got {_kind(t)}"
            if t.get("dataset") is not None and not isinstance(t["dataset"], dict):
                return f"runtime_spec_json.workload.peft.tasks[{i}].dataset: must be an object, got {_kind(t['dataset'])}"
    return None


def add_command(request: agent_pb2.ControlTaskRequest) -> tuple[str, dict]:
    """("", control-file command) for a ControlTask "add", or (why, {}) naming the bad field:
    ``task_json`` must be a JSON object whose "name" is ``task``; ``task_dir``, when given,
    an absolute path. The task spec itself is validated by the executor (an ``error``
    event naming the field; the other tasks keep training)."""
    try:
        task = json.loads(request.task_json) if request.task_json else None
    except ValueError as e:
        return f"task_json: not JSON ({e})", {}
    if not isinstance(task, dict):
        return "task_json: must be a JSON object (the task's spec)", {}
    if task.get("name") != request.task:
        return f"task_json.name: must equal task {request.task!r}, got {task.get('name')!r}", {}
    if request.task_dir and not request.task_dir.startswith("/"):
        return f"task_dir: must be an absolute path, got {request.task_dir!r}", {}
    cmd = {"op": "add", "task": task, "allocation": request.allocation_id}
    if request.task_dir:
        cmd["dir"] = request.task_dir
    return "", cmd


def partitions_proto(parts) -> list[types_pb2.Partition]:
    """The node's partitions with their free amounts now ([] without partitions)."""
    if parts is None:
        return []
    return [types_pb2.Partition(id=p.id, kind=p.kind, device_id=p.device_id, capacity_units=p.capacity_units,
                                unit=p.unit, memory_bytes=p.memory_bytes, free_units=p.free_units,
                                free_memory_bytes=p.free_memory_bytes, attributes=p.attributes)
            for p in parts.describe()]


def to_proto(d) -> types_pb2.Device:
    return types_pb2.Device(id=d.id, kind=d.kind, model=d.model, memory_bytes=d.memory_bytes,
                            capacity=d.capacity, cores=list(d.cores), uuid=d.uuid)
