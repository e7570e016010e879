"""The controller's state machine over the store: jobs, nodes, executor reports, and
the reconcile loop (snapshot -> pure policy -> fenced write -> dispatch -> observe).

Every method that changes state is a read-modify-write retried on ``Conflict`` and
refused with ``NotLeader`` when this controller does not hold the leader key. The gRPC
servicers (api.py) only translate messages and exceptions.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from controller.policy import DeviceView, JobView, NodeView, Placement, RunningJob, ScheduleRequest, Shard
from tessera import log, manifest
from tessera.api.v1 import agent_pb2, agent_pb2_grpc, controller_pb2, types_pb2
from tessera.errors import SpecError

from . import tasks as peft_tasks
from .config import ControllerConfig
from .store import Conflict, Fenced, Store

P = types_pb2.JobPhase
TERMINAL = (P.SUCCEEDED, P.FAILED, P.CANCELLED)
ACTIVE = (P.SCHEDULED, P.RUNNING)
RETRIES = 20


class NotFound(Exception):
    pass


class AlreadyExists(Exception):
    pass


class PreconditionFailed(Exception):
    pass


class NotLeader(Exception):
    pass


def new_job_id() -> str:
    return "j-" + secrets.token_hex(6)


def transition(job: types_pb2.Job, phase: int, reason: str, now: float) -> None:
    """Move ``job`` to ``phase`` and record the transition (no-op history if unchanged)."""
    if job.status.phase != phase:
        job.status.history.add(phase=phase, time=now, reason=reason)
    job.status.phase = phase
    job.status.reason = reason


def canonical_spec(spec: types_pb2.JobSpec) -> bytes:
    """Deterministic bytes of a spec, to compare two submissions for idempotency."""
    return spec.SerializeToString(deterministic=True)


class AgentPool:
    """gRPC channels to agents, one per address, reused."""

    def __init__(self) -> None:
        self._stubs: dict[str, agent_pb2_grpc.AgentServiceStub] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> agent_pb2_grpc.AgentServiceStub:
        if address not in self._stubs:
            ch = grpc.aio.insecure_channel(address)
            self._channels[address] = ch
            self._stubs[address] = agent_pb2_grpc.AgentServiceStub(ch)
        return self._stubs[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(None)
        self._channels.clear()
        self._stubs.clear()


@dataclass
class _Rank:
    node: str
    device_id: str
    rank: int


class Controller:
    def __init__(self, store: Store, cfg: ControllerConfig, policy, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.cfg = cfg
        self.policy = policy
        self.clock = clock
        self.agents = AgentPool()
        self.heartbeats: dict[str, float] = {}
        self.elected_at = 0.0
        self.leading = False
        self.kick = asyncio.Event()  # set on events that warrant an early reconcile
        self.log = log.get(component="controller")

    # -- leadership -------------------------------------------------------------------
    async def on_elected(self) -> None:
        self.leading = True
        # Nodes get a full grace period from takeover: the previous leader's heartbeat
        # times lived in its memory only.
        self.elected_at = self.clock()
        self.heartbeats.clear()
        self.kick.set()

    async def on_lost(self) -> None:
        self.leading = False

    def _require_leader(self) -> None:
        if not self.leading or self.store.fencing_token is None:
            raise NotLeader("this controller is not the leader; retry against the leader")

    async def _rmw(self, job_id: str, fn):
        """Read job, apply ``fn(job) -> (extra_cmp, extra_ops) | None`` and write it back
        with CAS, retrying on conflict. ``fn`` returning None means "no write". Returns
        the job as written (or as read when nothing was written)."""
        for _ in range(RETRIES):
            v = await self.store.get_job(job_id)
            if v is None:
                raise NotFound(f"job {job_id} not found")
            job = v.value
            out = fn(job)
            if out is None:
                return job
            cmp, ops = out
            try:
                job.revision = await self.store.update_job(job, v.mod_revision, cmp, ops)
                return job
            except Conflict:
                continue
            except Fenced as e:
                raise NotLeader(str(e)) from None
        raise Conflict(f"job {job_id}: too many concurrent updates")

    # -- jobs -------------------------------------------------------------------------
    async def submit(self, spec: types_pb2.JobSpec, idem: str) -> tuple[types_pb2.Job, bool]:
        """Validate and persist a job in PENDING; idempotent on ``idem``."""
        doc = manifest.validate(manifest.from_proto(spec))  # SpecError -> INVALID_ARGUMENT
        if len(idem) > 128:
            raise SpecError("idempotency_key", "must be at most 128 characters")
        if "/" in idem:
            raise SpecError("idempotency_key", "must not contain '/'")
        self._require_leader()
        norm = manifest.to_proto(doc)
        for _ in range(RETRIES):
            # Optimistic: one transaction creates the job and claims the key; only when
            # that fails (the key, or rarely the id, exists) is the key read back.
            now = self.clock()
            job = types_pb2.Job(id=new_job_id(), spec=norm, created=now, idempotency_key=idem)
            job.status.total_steps = doc["workload"]["steps"]
            transition(job, P.PENDING, "submitted; waiting for a placement", now)
            try:
                job.revision = await self.store.create_job(job, idem)
            except Conflict:
                if idem:
                    existing = await self.store.get_idem(norm.tenant, idem)
                    if existing is not None:
                        v = await self.store.get_job(existing)
                        if v is None:
                            raise Conflict("idempotency key points at a missing job") from None
                        if canonical_spec(v.value.spec) != canonical_spec(norm):
                            raise AlreadyExists(
                                f"idempotency_key {idem!r} was used for another spec (job {existing})") from None
                        return v.value, False
                continue
            except Fenced as e:
                raise NotLeader(str(e)) from None
            self.log.info("job submitted", job_id=job.id, tenant=norm.tenant, name=norm.name)
            self.kick.set()
            return job, True
        raise Conflict("too many concurrent submissions with this key")

    async def get(self, job_id: str) -> types_pb2.Job:
        """One job, or one task of a peft job as its own job (``<job id>/<task>``); NotFound."""
        parent_id, task = peft_tasks.split_id(job_id)
        v = await self.store.get_job(parent_id)
        if v is None:
            raise NotFound(f"job {parent_id} not found")
        if task is None:
            return v.value
        tv = peft_tasks.view(v.value, task)
        if tv is None:
            raise NotFound(f"job {parent_id} has no task {task!r}")
        return tv

    async def list(self, tenant: str, phases: list[int], page_size: int, page_token: str, include_tasks: bool = False):
        """A page of jobs (oldest first), filtered; with ``include_tasks`` each peft job's
        tasks follow it as jobs of their own (``<job id>/<task>``)."""
        if page_size < 0 or page_size > 1000:
            raise SpecError("page_size", f"must be between 0 and 1000, got {page_size}")
        try:
            offset = int(page_token) if page_token else 0
        except ValueError:
            raise SpecError("page_token", f"not a token this server issued: {page_token!r}") from None
        if offset < 0:
            raise SpecError("page_token", f"not a token this server issued: {page_token!r}")
        jobs, rev = await self.store.list_jobs()
        jobs.sort(key=lambda j: (j.created, j.id))
        if include_tasks:
            jobs = [x for j in jobs for x in [j, *peft_tasks.views(j)]]
        jobs = [j for j in jobs if (not tenant or j.spec.tenant == tenant) and (not phases or j.status.phase in phases)]
        size = page_size or 100
        page = jobs[offset: offset + size]
        nxt = str(offset + size) if offset + size < len(jobs) else ""
        return page, nxt, rev

    async def cancel(self, job_id: str, reason: str) -> types_pb2.Job:
        if "/" in job_id:
            return await self.cancel_task(job_id, reason)
        self._require_leader()
        now = self.clock()
        stop: list = []

        def fn(job):
            if job.status.phase == P.CANCELLED:
                return None
            if job.status.phase in (P.SUCCEEDED, P.FAILED):
                raise PreconditionFailed(f"job {job_id} already ended {P.Name(job.status.phase)}")
            cmp, ops = [], []
            if job.status.phase in ACTIVE:
                stop[:] = [(job.status.allocation_id, list(job.status.placement))]
                cmp, ops = self.store.release_ops(job.status.allocation_id, job.status.placement)
            transition(job, P.CANCELLED, reason or "cancelled by its tenant", now)
            return cmp, ops

        job = await self._rmw(job_id, fn)
        for alloc, shards in stop:
            await self._stop_alloc(alloc, shards, "job cancelled")
        self.log.info("job cancelled", job_id=job_id)
        self.kick.set()
        return job

    async def cancel_task(self, task_id: str, reason: str) -> types_pb2.Job:
        """Cancel one task of a running peft job (``<job id>/<task>``), the others untouched:
        the request is recorded on the task and sent to the agent of rank 0, which appends it
        to the executor's control file; the task turns CANCELLED when the executor reports
        it. Returns the task's view. NotFound for an unknown job or task;
        PreconditionFailed when the task already succeeded or the job is not running;
        ConnectionError (retry) when the agent cannot be reached."""
        self._require_leader()
        parent_id, task = peft_tasks.split_id(task_id)
        target: list = []

        def fn(job):
            if peft_tasks.view(job, task) is None:
                raise NotFound(f"job {parent_id} has no task {task!r}")
            t = peft_tasks.find(job, task)
            if t is not None and t.phase == P.CANCELLED:
                return None
            if t is not None and t.phase == P.SUCCEEDED:
                raise PreconditionFailed(f"task {task_id} already ended SUCCEEDED")
            if job.status.phase not in ACTIVE:
                raise PreconditionFailed(f"job {parent_id} is {P.Name(job.status.phase)}: a task is cancelled in a "
                                         "running job (cancel the job itself otherwise)")
            if t is None:
                t = job.status.tasks.add(name=task, phase=P.PENDING)
            t.reason = (reason or "cancel requested by its tenant")[:500]
            target[:] = [(job.status.allocation_id, job.status.placement[0].node)]
            return [], []

        job = await self._rmw(parent_id, fn)
        for alloc, node_name in target:
            v = await self.store.get_node(node_name)
            if v is None:
                raise ConnectionError(f"node {node_name} of job {parent_id} is unknown; retry")
            try:
                await self.agents.stub(v.value.agent_address).ControlTask(
                    agent_pb2.ControlTaskRequest(allocation_id=alloc, fencing_token=self.store.fencing_token or 0,
                                                 op="cancel", task=task), timeout=5)
            except grpc.aio.AioRpcError as e:
                raise ConnectionError(f"agent of node {node_name}: {e.details()}") from None
            self.log.info("task cancel requested", job_id=parent_id, task=task, allocation=alloc, node_id=node_name)
        return peft_tasks.view(job, task)

    # -- nodes ------------------------------------------------------------------------
    async def register(self, req: controller_pb2.RegisterNodeRequest) -> types_pb2.Node:
        if not req.name or not manifest.NAME_RE.match(req.name) or len(req.name) > 63:
            raise SpecError("name", f"must match {manifest.NAME_RE.pattern}, got {req.name!r}")
        if not req.agent_address or ":" not in req.agent_address:
            raise SpecError("agent_address", f"must be HOST:PORT, got {req.agent_address!r}")
        if not req.devices:
            raise SpecError("devices", "at least one device is required")
        seen = set()
        for i, d in enumerate(req.devices):
            if not d.id or d.id in seen:
                raise SpecError(f"devices[{i}].id", f"must be non-empty and unique, got {d.id!r}")
            seen.add(d.id)
            if d.kind not in ("cpu", "gpu"):
                raise SpecError(f"devices[{i}].kind", f"must be 'cpu' or 'gpu', got {d.kind!r}")
        self._require_leader()
        node = types_pb2.Node(
            name=req.name, agent_address=req.agent_address, profilerd_address=req.profilerd_address,
            devices=req.devices, state=types_pb2.READY, incarnation=uuid.uuid4().hex[:12],
            last_heartbeat=self.clock(),
        )
        try:
            await self.store.put_node(node, None)
        except Fenced as e:
            raise NotLeader(str(e)) from None
        self.heartbeats[node.name] = node.last_heartbeat
        # Executors of an earlier incarnation are gone or stale: requeue their jobs.
        await self._requeue_node_jobs(node.name, "node re-registered (agent restarted)")
        self.log.info("node registered", node_id=node.name, incarnation=node.incarnation, devices=len(node.devices))
        self.kick.set()
        return node

    async def heartbeat(self, req: controller_pb2.HeartbeatRequest) -> list[str]:
        self._require_leader()
        v = await self.store.get_node(req.name)
        if v is None or v.value.incarnation != req.incarnation:
            raise PreconditionFailed(f"node {req.name}: incarnation {req.incarnation!r} is not current; register again")
        now = self.clock()
        self.heartbeats[req.name] = now
        node = v.value
        if node.state != types_pb2.READY:
            node.state = types_pb2.READY
            node.last_heartbeat = now
            try:
                await self.store.put_node(node, v.mod_revision)
            except Conflict:
                pass
            except Fenced as e:
                raise NotLeader(str(e)) from None
            self.log.info("node ready again", node_id=req.name)
            self.kick.set()
        held = {a for (n, _), a in (await self.store.list_allocs()).items() if n == req.name}
        return [a for a in req.running_allocations if a not in held]

    async def list_nodes(self) -> list[types_pb2.Node]:
        allocs = await self.store.list_allocs()
        out = []
        for v in await self.store.list_nodes():
            n = v.value
            if n.name in self.heartbeats:
                n.last_heartbeat = self.heartbeats[n.name]
            n.allocated_device_ids.extend(sorted(d for (nn, d) in allocs if nn == n.name))
            out.append(n)
        return sorted(out, key=lambda n: n.name)

    # -- executor reports -------------------------------------------------------------
    async def report(self, r: controller_pb2.ExecutorReport) -> bool:
        """Apply an executor report; return True when its allocation is stale."""
        self._require_leader()
        now = self.clock()
        K = controller_pb2.ExecutorReport
        stale = [False]
        after: list = []
        if r.kind == K.EXITED:
            try:
                await self.store.put_exit(r.allocation_id, r.rank, r.exit_code)
            except Fenced as e:
                raise NotLeader(str(e)) from None
        exits = await self.store.rank_exits(r.allocation_id) if r.kind == K.EXITED else {}

        def fn(job):
            st = job.status
            if st.allocation_id != r.allocation_id or st.phase not in ACTIVE:
                stale[0] = st.allocation_id != r.allocation_id or st.phase in TERMINAL
                return None
            world = sum(len(s.device_ids) for s in st.placement)
            started = r.kind in (K.STARTED, K.PROGRESS, K.TASK) and st.phase == P.SCHEDULED
            if started:
                transition(job, P.RUNNING, f"executors started on {', '.join(s.node for s in st.placement)}", now)
            if r.kind == K.PROGRESS:
                st.step, st.loss, st.step_time_s = r.step, r.loss, r.step_time_s
                if r.total_steps:
                    st.total_steps = r.total_steps
                if st.first_loss == 0:
                    st.first_loss = r.loss
                return [], []
            if r.kind == K.TASK:
                changed = peft_tasks.apply_report(job, r.task, r.task_phase, r.step, r.total_steps, r.loss, r.tokens_per_s)
                return ([], []) if changed or started else None
            if r.kind == K.EXITED:
                if r.exit_code != 0:
                    after[:] = [(st.allocation_id, list(st.placement))]
                    cmp, ops = self.store.release_ops(st.allocation_id, st.placement)
                    st.exit_code = r.exit_code
                    transition(job, P.FAILED, f"rank {r.rank} on {r.node} exited {r.exit_code}: {r.message}"[:500], now)
                    return cmp, ops
                if len(exits) >= world and all(c == 0 for c in exits.values()):
                    cmp, ops = self.store.release_ops(st.allocation_id, st.placement)
                    transition(job, P.SUCCEEDED, f"all {world} ranks exited 0", now)
                    return cmp, ops
                return None
            return ([], []) if started else None

        job = await self._rmw(r.job_id, fn)
        for alloc, shards in after:
            await self._stop_alloc(alloc, shards, "another rank failed")
        if job.status.phase in TERMINAL and r.kind == K.EXITED:
            self.log.info("job ended", job_id=job.id, phase=P.Name(job.status.phase), reason=job.status.reason)
            self.kick.set()
        return stale[0]

    # -- reconcile --------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile every interval and whenever ``kick`` is set, while leading."""
        while not stop.is_set():
            try:
                async with asyncio.timeout(self.cfg.reconcile_interval_s):
                    await self.kick.wait()
            except TimeoutError:
                pass
            self.kick.clear()
            if not self.leading:
                continue
            try:
                await self.reconcile_once()
            except (NotLeader, Fenced):
                self.log.warning("reconcile stopped: not leader")
            except Exception:
                self.log.exception("reconcile failed")

    async def reconcile_once(self) -> dict:
        t0 = time.perf_counter()
        now = self.clock()
        nodes = [v for v in await self.store.list_nodes()]
        # 1. liveness
        lost = 0
        for v in nodes:
            n = v.value
            last = self.heartbeats.get(n.name, max(self.elected_at, 0.0))
            if n.state == types_pb2.READY and now - last > self.cfg.grace_s:
                n.state = types_pb2.NOT_READY
                try:
                    await self.store.put_node(n, v.mod_revision)
                except Conflict:
                    continue
                lost += 1
                self.log.warning("node not ready", node_id=n.name, silent_s=round(now - last, 1))
                await self._requeue_node_jobs(n.name, f"node {n.name} stopped heartbeating for {self.cfg.grace_s:g}s")
        # 2. schedule
        nodes = [v.value for v in await self.store.list_nodes()]
        jobs, _ = await self.store.list_jobs()
        allocs = await self.store.list_allocs()
        pending = [j for j in jobs if j.status.phase == P.PENDING]
        if not pending:
            return {"placed": 0, "lost_nodes": lost}
        req = self._request(nodes, pending, allocs)
        reply = self.policy.schedule(req)
        by_id = {j.id: j for j in jobs}
        placed = 0
        for p in reply.placements:
            if await self._place(by_id[p.job_id], p, {n.name: n for n in nodes}):
                placed += 1
        for inf in reply.infeasible:
            j = by_id[inf.job_id]
            if j.status.decision != inf.reason:
                try:
                    await self._rmw(j.id, lambda job, r=inf.reason: _set_decision(job, r))
                except NotFound:
                    pass
        dt = (time.perf_counter() - t0) * 1000
        self.log.info("decision cycle", pending=len(pending), placed=placed, infeasible=len(reply.infeasible), ms=round(dt, 2))
        return {"placed": placed, "lost_nodes": lost, "infeasible": len(reply.infeasible)}

    def _request(self, nodes, pending, allocs) -> ScheduleRequest:
        nv = tuple(
            NodeView(n.name, tuple(DeviceView(d.id, d.kind, d.model, d.memory_bytes, d.capacity) for d in n.devices),
                     n.state == types_pb2.READY)
            for n in nodes
        )
        held: dict[str, dict[str, list[str]]] = {}
        for (node, dev), a in allocs.items():
            held.setdefault(a, {}).setdefault(node, []).append(dev)
        running = tuple(
            RunningJob(JobView(a), Placement(a, tuple(Shard(n, tuple(ds)) for n, ds in shards.items())))
            for a, shards in held.items()
        )
        jv = tuple(
            JobView(j.id, j.spec.tenant, j.spec.resources.devices, j.spec.resources.device_kind, j.created,
                    model=j.spec.workload.type, workload=j.spec.workload.type)
            for j in pending
        )
        return ScheduleRequest(nodes=nv, pending=jv, running=running, now=self.clock())

    async def _place(self, job: types_pb2.Job, p: Placement, nodes: dict) -> bool:
        now = self.clock()
        alloc_id = "a-" + secrets.token_hex(6)
        shards = []
        rank = 0
        for s in p.shards:
            shards.append(types_pb2.Shard(node=s.node, device_ids=list(s.device_ids), first_rank=rank))
            rank += len(s.device_ids)

        def fn(j):
            if j.status.phase != P.PENDING:
                return None
            if j.status.attempts >= self.cfg.max_attempts:
                transition(j, P.FAILED, f"gave up after {j.status.attempts} placements: {j.status.reason}", now)
                return [], []
            del j.status.placement[:]
            j.status.placement.extend(shards)
            j.status.allocation_id = alloc_id
            j.status.attempts += 1
            where = ", ".join(f"{s.node}[{','.join(s.device_ids)}]" for s in shards)
            j.status.decision = f"{self.policy.name}: {p.reason or 'placed'} ({where})"
            transition(j, P.SCHEDULED, f"placed on {', '.join(s.node for s in shards)}", now)
            return self.store.alloc_ops(alloc_id, shards)

        try:
            job = await self._rmw(job.id, fn)
        except Conflict:
            return False
        if job.status.allocation_id != alloc_id or job.status.phase != P.SCHEDULED:
            return False
        self.log.info("job placed", job_id=job.id, allocation=alloc_id, decision=job.status.decision)
        ok, why = await self._launch(job, nodes)
        if not ok:
            await self._requeue(job.id, alloc_id, f"launch failed: {why}")
        return ok

    async def _launch(self, job: types_pb2.Job, nodes: dict) -> tuple[bool, str]:
        doc = manifest.validate(manifest.from_proto(job.spec))
        spec_json = json.dumps({"job_id": job.id, "workload": doc["workload"]})
        shards = list(job.status.placement)
        world = sum(len(s.device_ids) for s in shards)
        master = nodes[shards[0].node].agent_address.rsplit(":", 1)[0]
        port = 20000 + secrets.randbelow(20000)
        ckpt = os.path.abspath(os.path.join(self.cfg.checkpoint_root, job.id))
        calls = []
        for s in shards:
            node = nodes[s.node]
            for i, dev in enumerate(s.device_ids):
                req = agent_pb2.LaunchExecutorRequest(
                    allocation_id=job.status.allocation_id, job_id=job.id, fencing_token=self.store.fencing_token or 0,
                    incarnation=node.incarnation, rank=s.first_rank + i, world_size=world, device_ids=[dev],
                    master_addr=master, master_port=port, runtime_spec_json=spec_json, checkpoint_dir=ckpt,
                )
                calls.append((node.name, self.agents.stub(node.agent_address).LaunchExecutor(req, timeout=15)))
        results = await asyncio.gather(*(c for _, c in calls), return_exceptions=True)
        for (name, _), res in zip(calls, results):
            if isinstance(res, Exception):
                msg = res.details() if isinstance(res, grpc.aio.AioRpcError) else str(res)
                return False, f"{name}: {msg}"
        return True, ""

    async def _requeue(self, job_id: str, alloc_id: str, reason: str) -> None:
        now = self.clock()
        stop: list = []

        def fn(j):
            if j.status.allocation_id != alloc_id or j.status.phase not in ACTIVE:
                return None
            stop[:] = [(alloc_id, list(j.status.placement))]
            cmp, ops = self.store.release_ops(alloc_id, j.status.placement)
            j.status.allocation_id = ""
            transition(j, P.PENDING, f"requeued: {reason}"[:500], now)
            return cmp, ops

        await self._rmw(job_id, fn)
        for a, shards in stop:
            await self._stop_alloc(a, shards, reason)
        self.log.warning("job requeued", job_id=job_id, reason=reason)
        self.kick.set()

    async def _requeue_node_jobs(self, node: str, reason: str) -> None:
        jobs, _ = await self.store.list_jobs()
        for j in jobs:
            if j.status.phase in ACTIVE and any(s.node == node for s in j.status.placement):
                await self._requeue(j.id, j.status.allocation_id, reason)

    async def _stop_alloc(self, alloc_id: str, shards, reason: str) -> None:
        """Best effort: the heartbeat reply stops anything that this misses."""
        nodes = {v.value.name: v.value for v in await self.store.list_nodes()}
        for s in shards:
            n = nodes.get(s.node)
            if n is None or n.state != types_pb2.READY:
                continue
            try:
                await self.agents.stub(n.agent_address).StopExecutor(
                    agent_pb2.StopExecutorRequest(allocation_id=alloc_id, fencing_token=self.store.fencing_token or 0, reason=reason),
                    timeout=5,
                )
            except grpc.aio.AioRpcError as e:
                self.log.warning("stop failed", node_id=s.node, allocation=alloc_id, error=e.details())

    async def logs(self, job_id: str, tail: int) -> tuple[str, bool]:
        if tail < 0 or tail > 4 << 20:
            raise SpecError("tail_bytes", f"must be between 0 and {4 << 20}, got {tail}")
        await self.get(job_id)
        parts, truncated, errors = [], False, []
        for n in await self.list_nodes():
            if n.state != types_pb2.READY:
                continue
            try:
                r = await self.agents.stub(n.agent_address).ReadLogs(agent_pb2.ReadLogsRequest(job_id=job_id, tail_bytes=tail), timeout=5)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    errors.append(f"{n.name}: {e.details()}")
                continue
            parts.append(f"==> node {n.name} <==\n{r.text}")
            truncated |= r.truncated
        if not parts and errors:
            raise ConnectionError("; ".join(errors))
        return "\n".join(parts), truncated


def _set_decision(job: types_pb2.Job, reason: str):
    if job.status.phase != P.PENDING or job.status.decision == reason:
        return None
    job.status.decision = reason
    job.status.reason = f"waiting: {reason}"
    return [], []
