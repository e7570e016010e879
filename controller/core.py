"""The controller's state machine over the store: jobs, nodes, executor reports, and
the reconcile loop (snapshot -> pure policy -> fenced write -> dispatch -> observe).

Every method that changes state is a read-modify-write retried on ``Conflict`` and
refused with ``NotLeader`` when this controller does not hold the leader key. The gRPC
servicers (api.py) only translate messages and exceptions.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import json
import os
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from controller import measured
from controller.policy import Placement, Resize
from controller.policy.snapshot_estimator import SnapshotEstimator, job_key
from tessera import log, manifest, wire
from tessera.api.v1 import agent_pb2, agent_pb2_grpc, controller_pb2, types_pb2
from tessera.errors import SpecError
from tessera.perfmodel import PerfModel

from . import tasks as peft_tasks
from . import actions, adapter, fusion
from .records import alloc_keys, decide, is_profile_job, transition
from .config import ControllerConfig
from .store import CapacityExceeded, Conflict, Fenced, Store

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


class AgentRefused(Exception):
    """An agent answered a forwarded request with a status that retrying cannot change
    (e.g. INVALID_ARGUMENT): the API passes ``code`` on to the client unchanged."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# Client input echoed in an error message is cut to this many characters (a long id or
# token would otherwise make the status trailer exceed gRPC's metadata limit).
ECHO_CHARS = 64


def short(text: str) -> str:
    """``text`` as echoed in an error message: at most ECHO_CHARS characters, then "…"."""
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "…"


def new_job_id() -> str:
    return "j-" + secrets.token_hex(6)


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
            ch = grpc.aio.insecure_channel(address, options=GRPC_MESSAGE_OPTIONS)
            self._channels[address] = ch
            self._stubs[address] = agent_pb2_grpc.AgentServiceStub(ch)
        return self._stubs[address]

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close(None)
        self._channels.clear()
        self._stubs.clear()


# A normalised job spec larger than this is refused (etcd refuses requests over ~1.5 MiB,
# and every list reads every job).
MAX_SPEC_BYTES = 256 << 10
MAX_REASON_CHARS = 500
# Replies up to the largest log tail (GetJobLogs: 4 MiB per node) plus framing.
GRPC_MESSAGE_OPTIONS = wire.LARGE_MESSAGES


def _check_reason(reason: str) -> None:
    if len(reason) > MAX_REASON_CHARS:
        raise SpecError("reason", f"must be at most {MAX_REASON_CHARS} characters, got {len(reason)}")


def _encode_page_token(last: types_pb2.Job) -> str:
    """Opaque page token: the (created, id) of the last job of a page."""
    return base64.urlsafe_b64encode(json.dumps([last.created, last.id]).encode()).decode()


def _decode_page_token(token: str) -> tuple[float, str] | None:
    """(created, id) after which the next page starts; None for the first page;
    SpecError("page_token") for anything this server did not issue."""
    if not token:
        return None
    try:
        created, job_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        return float(created), str(job_id)
    except (ValueError, TypeError, binascii.Error):
        raise SpecError("page_token", f"not a token this server issued: {short(token)!r}") from None


# Finished jobs removed per reconcile round at most (retention): a backlog (the TTL just
# lowered, or a leader that was down for a while) drains over several rounds instead of
# stalling one; each removal is one etcd transaction.
MAX_REMOVALS_PER_ROUND = 500

# Transient requeues (a launch refused while the agent still holds a partition, an executor
# the agent stopped itself, a launch that never happened) back off: the n-th in a row keeps
# the job out of the policy's rounds for min(2^(n-1), TRANSIENT_BACKOFF_MAX_S) seconds after
# it (``transient_backoff``); the count restarts once the job runs, or when its last
# transient requeue is older than TRANSIENT_BACKOFF_RESET_S.
TRANSIENT_BACKOFF_MAX_S = 60.0
TRANSIENT_BACKOFF_RESET_S = 600.0


def transient_backoff(n: int) -> float:
    """Seconds a job is not re-placed after its ``n``-th transient requeue in a row (n >= 1)."""
    return min(2.0 ** max(n - 1, 0), TRANSIENT_BACKOFF_MAX_S)


def finished_at(job: types_pb2.Job) -> float:
    """When a terminal ``job`` ended: the time of its last history entry into its current
    phase; for a record without one (older records), its last history entry of any phase;
    else its creation time."""
    st = job.status
    t = next((h.time for h in reversed(st.history) if h.phase == st.phase), 0.0)
    return t or max((h.time for h in st.history), default=0.0) or job.created


def _needs(j: types_pb2.Job) -> tuple[str, ...]:
    """The ids of the jobs ``j``'s record names and needs kept while it is: its host
    (``status.fused_into``) and its profiling job (``status.estimate.profile_job_id``)."""
    return tuple(x for x in (j.status.fused_into, j.status.estimate.profile_job_id) if x and x != j.id)


def expired_jobs(jobs: list[types_pb2.Job], now: float, ttl_s: float,
                 limit: int = MAX_REMOVALS_PER_ROUND) -> list[types_pb2.Job]:
    """The finished jobs to remove at ``now`` (pure), at most ``limit``; none when ``ttl_s``
    is 0 (kept forever). Candidates: terminal jobs that ended more than ``ttl_s`` before
    ``now`` (:func:`finished_at`). Of those, a job is kept while another job that stays
    needs it: a guest fused into it (``status.fused_into``: a host outlives its guests'
    records), a job whose estimate names it as its profiling job
    (``status.estimate.profile_job_id``: removing that profiling job would make the
    profiling loop submit it again); and a guest is kept while its host is not finished.
    A job kept for these reasons protects the jobs it needs in turn. The keep set is
    computed over every candidate, and ``limit`` cuts only the removable ones (kept jobs
    never use up a round). Order: longest-finished first, except that a job comes after
    every removable job naming it (removed one by one, a job is never gone while a stored
    job still names it), so a cut at ``limit`` never takes a job without those naming it."""
    if not ttl_s > 0 or limit <= 0:
        return []
    old = [(finished_at(j), j.id, j) for j in jobs if j.status.phase in TERMINAL]
    old = sorted(x for x in old if now - x[0] > ttl_s)
    chosen = {j.id: j for _, _, j in old}
    if not chosen:
        return []
    by_id = {j.id: j for j in jobs}
    needed = {ref for j in jobs if j.id not in chosen for ref in _needs(j)}
    keep = [jid for jid, j in chosen.items() if jid in needed or (
        (h := by_id.get(j.status.fused_into)) is not None and h.status.phase not in TERMINAL)]
    while keep:
        j = chosen.pop(keep.pop(), None)
        if j is not None:
            keep.extend(ref for ref in _needs(j) if ref in chosen)
    # Removable jobs naming each removable job, longest-finished first.
    named_by: dict[str, list[str]] = {}
    for _, jid, j in old:
        if jid in chosen:
            for ref in _needs(j):
                if ref in chosen:
                    named_by.setdefault(ref, []).append(jid)
    out: list[types_pb2.Job] = []
    seen: set[str] = set()
    for _, jid, _j in old:
        if jid not in chosen or jid in seen:
            continue
        stack = [(jid, False)]  # depth-first, a job emitted after the jobs naming it
        while stack and len(out) < limit:
            x, ready = stack.pop()
            if ready:
                out.append(chosen[x])
                continue
            if x in seen:
                continue
            seen.add(x)
            stack.append((x, True))
            stack.extend((r, False) for r in reversed(named_by.get(x, ())) if r not in seen)
        if len(out) >= limit:
            break
    return out


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
        # Each node's last heartbeat: its time and the allocations it said were running (a
        # SCHEDULED job whose executor never started is found by their absence).
        self.node_allocs: dict[str, tuple[float, frozenset[str]]] = {}
        # When this controller last sent an allocation's launch (in memory: a new leader
        # counts from the scheduling time).
        self.launched_at: dict[str, float] = {}
        # The agents' last partition reports (free amounts), in memory like heartbeats.
        self.part_reports: dict[str, dict[str, types_pb2.Partition]] = {}
        # What the policy may ask for estimates (controller.policy.estimator.Estimator): a
        # fixed one when set (tests, simulations), else the live one built each round from
        # ``snapshot`` (the estimator's cached model, see ``round_estimator``); neither:
        # policies fall back to the requested resources.
        self.estimator: object | None = None
        self.snapshot: Callable[[], PerfModel | None] | None = None
        self._live: SnapshotEstimator | None = None
        self.elected_at = 0.0
        self.leading = False
        self.kick = asyncio.Event()  # set on events that warrant an early reconcile
        self._strays: set[tuple[str, str]] = set()  # (allocation, fused task) cancels already sent
        # Transient requeue backoff, in memory (a new leader starts every job at zero):
        # job id -> (transient requeues in a row, time of the last, not re-placed before).
        self._backoff: dict[str, tuple[int, float, float]] = {}
        # StopExecutor calls running in the background (requeues of a lost node's jobs),
        # awaited when ``run`` ends; ``_in_round``: a reconcile round is in progress.
        self._stops: set[asyncio.Task] = set()
        self._in_round = False
        self.log = log.get(component="controller")

    # -- leadership -------------------------------------------------------------------
    async def on_elected(self) -> None:
        self.leading = True
        # Nodes get a full grace period from takeover: the previous leader's heartbeat
        # times lived in its memory only.
        self.elected_at = self.clock()
        self.heartbeats.clear()
        self.node_allocs.clear()
        self.kick.set()

    async def on_lost(self) -> None:
        self.leading = False

    def not_found(self, job_id: str) -> NotFound:
        """The NOT_FOUND of a job id that is not (or no longer) stored."""
        ttl = self.cfg.finished_job_ttl_s
        job_id = short(job_id)
        if not ttl > 0:
            return NotFound(f"job {job_id} not found (finished jobs are kept forever here: finished_job_ttl_s=0)")
        return NotFound(f"job {job_id} not found: finished jobs are kept for finished_job_ttl_s={ttl:g}s "
                        f"({_span(ttl)}) after they end, then removed; it may have ended earlier than that")

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
                raise self.not_found(job_id)
            job = v.value
            out = fn(job)
            if inspect.isawaitable(out):  # an async fn may read (and compare) other keys
                out = await out
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
        if norm.ByteSize() > MAX_SPEC_BYTES:
            raise SpecError("spec", f"is {norm.ByteSize()} bytes once normalised; at most {MAX_SPEC_BYTES} are "
                                    "accepted (split the job, or shorten its task list)")
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
                    iv = await self.store.get_idem_versioned(norm.tenant, idem)
                    if iv is not None:
                        existing = iv.value
                        v = await self.store.get_job(existing)
                        if v is None:
                            # The key outlived its job (a record removed without it by an
                            # older version, or by hand): it names nothing, so it is freed
                            # and the submission creates a new job. Retention removes a
                            # job's key with it (Store.delete_job).
                            try:
                                await self.store.delete_idem(norm.tenant, idem, iv.mod_revision)
                            except Conflict:
                                pass
                            except Fenced as e:
                                raise NotLeader(str(e)) from None
                            self.log.warning("dangling idempotency key freed", tenant=norm.tenant, key=idem,
                                             job_id=existing)
                            continue
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
            raise self.not_found(parent_id)
        if task is None:
            return v.value
        tv = peft_tasks.view(v.value, task)
        if tv is None:
            raise NotFound(f"job {parent_id} has no task {short(task)!r}")
        return tv

    async def list(self, tenant: str, phases: list[int], page_size: int, page_token: str, include_tasks: bool = False):
        """A page of jobs (oldest first), filtered; with ``include_tasks`` each peft job's
        tasks follow it as jobs of their own (``<job id>/<task>``)."""
        if page_size < 0 or page_size > 1000:
            raise SpecError("page_size", f"must be between 0 and 1000, got {page_size}")
        after = _decode_page_token(page_token)
        jobs, rev = await self.store.list_jobs()
        jobs.sort(key=lambda j: (j.created, j.id))
        if include_tasks:
            jobs = [x for j in jobs for x in [j, *peft_tasks.views(j)]]
        jobs = [j for j in jobs if (not tenant or j.spec.tenant == tenant) and (not phases or j.status.phase in phases)]
        if after is not None:
            # Keyset, not offset: a job that changed phase (left the filter) between two
            # pages must not shift the next page past a job never returned.
            jobs = [j for j in jobs if (j.created, j.id) > after]
        size = page_size or 100
        page = jobs[:size]
        nxt = _encode_page_token(page[-1]) if len(jobs) > size else ""
        return page, nxt, rev

    async def cancel(self, job_id: str, reason: str) -> types_pb2.Job:
        _check_reason(reason)
        if "/" in job_id:
            return await self.cancel_task(job_id, reason)
        self._require_leader()
        now = self.clock()
        stop: list = []
        guest: list = []

        async def fn(job):
            if job.status.phase == P.CANCELLED:
                return None
            if job.status.phase in (P.SUCCEEDED, P.FAILED):
                raise PreconditionFailed(f"job {job_id} already ended {P.Name(job.status.phase)}")
            cmp, ops = [], []
            if job.status.phase in ACTIVE and job.status.fused_into:
                # Fused into another job's executor: cancel its tasks there; the host and
                # its other tasks are untouched, and no partition units are held.
                names = peft_tasks.task_names(job) + [t.name for t in job.status.tasks]
                live = []
                for n in dict.fromkeys(names):
                    t = peft_tasks.find(job, n)
                    if t is None:
                        t = job.status.tasks.add(name=n, phase=P.PENDING)
                    if t.phase not in TERMINAL:
                        t.phase, t.reason = P.CANCELLED, "job cancelled"
                        live.append(fusion.fused_name(job.id, n))
                guest[:] = [(job.status.allocation_id, job.status.placement[0].node, live)]
            elif job.status.phase in ACTIVE:
                stop[:] = [(job.status.allocation_id, list(job.status.placement))]
                cmp, ops = await self.store.realloc_ops(drop=job.status.allocation_id,
                                                        drop_keys=alloc_keys(job.status.placement))
            transition(job, P.CANCELLED, reason or "cancelled by its tenant", now)
            return cmp, ops

        job = await self._rmw(job_id, fn)
        for alloc, shards in stop:
            await self._stop_alloc(alloc, shards, "job cancelled")
        for alloc, node_name, names in guest:
            for n in names:
                await self._control(node_name, alloc, "cancel", n, quiet=True)
        self.log.info("job cancelled", job_id=job_id, fused_into=job.status.fused_into)
        self.kick.set()
        return job

    async def cancel_task(self, task_id: str, reason: str) -> types_pb2.Job:
        """Cancel one task of a running peft job (``<job id>/<task>``), the others untouched:
        the request is recorded on the task and sent to the agent of rank 0, which appends it
        to the executor's control file; the task turns CANCELLED when the executor reports
        it. Returns the task's view. NotFound for an unknown job or task;
        PreconditionFailed when the task already succeeded or the job is not running;
        ConnectionError (retry) when the agent cannot be reached."""
        _check_reason(reason)
        self._require_leader()
        parent_id, task = peft_tasks.split_id(task_id)
        target: list = []

        def fn(job):
            if peft_tasks.view(job, task) is None:
                raise NotFound(f"job {parent_id} has no task {short(task)!r}")
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
            # A task of a job fused into another's executor runs there under its fused name.
            name = fusion.fused_name(job.id, task) if job.status.fused_into else task
            target[:] = [(job.status.allocation_id, job.status.placement[0].node, name)]
            return [], []

        job = await self._rmw(parent_id, fn)
        for alloc, node_name, name in target:
            v = await self.store.get_node(node_name)
            if v is None:
                raise ConnectionError(f"node {node_name} of job {parent_id} is unknown; retry")
            try:
                await self.agents.stub(v.value.agent_address).ControlTask(
                    agent_pb2.ControlTaskRequest(allocation_id=alloc, fencing_token=self.store.fencing_token or 0,
                                                 op="cancel", task=name), timeout=5)
            except grpc.aio.AioRpcError as e:
                raise ConnectionError(f"agent of node {node_name}: {e.details()}") from None
            self.log.info("task cancel requested", job_id=parent_id, task=task, allocation=alloc, node_id=node_name)
        return peft_tasks.view(job, task)

    # -- nodes ------------------------------------------------------------------------
    async def register(self, req: controller_pb2.RegisterNodeRequest) -> types_pb2.Node:
        if not manifest.valid_name(req.name):
            raise SpecError("name", f"must match {manifest.NAME_RE.pattern} and be at most 63 characters, "
                                    f"got {short(req.name)!r}")
        if not req.agent_address or ":" not in req.agent_address:
            raise SpecError("agent_address", f"must be HOST:PORT, got {short(req.agent_address)!r}")
        if not req.devices:
            raise SpecError("devices", "at least one device is required")
        seen = set()
        for i, d in enumerate(req.devices):
            if not d.id or d.id in seen:
                raise SpecError(f"devices[{i}].id", f"must be non-empty and unique, got {short(d.id)!r}")
            seen.add(d.id)
            if d.kind not in ("cpu", "gpu"):
                raise SpecError(f"devices[{i}].kind", f"must be 'cpu' or 'gpu', got {short(d.kind)!r}")
            if d.capacity < 0:
                raise SpecError(f"devices[{i}].capacity", f"must be >= 0, got {d.capacity}")
            if d.memory_bytes < 0:
                raise SpecError(f"devices[{i}].memory_bytes", f"must be >= 0, got {d.memory_bytes}")
        pseen: set[str] = set()
        for i, p in enumerate(req.partitions):
            if not p.id or p.id in pseen or "/" in p.id:
                raise SpecError(f"partitions[{i}].id", f"must be non-empty, unique and without '/', got {short(p.id)!r}")
            pseen.add(p.id)
            if p.device_id not in seen:
                raise SpecError(f"partitions[{i}].device_id", f"must be one of the devices, got {short(p.device_id)!r}")
            if p.capacity_units <= 0:
                raise SpecError(f"partitions[{i}].capacity_units", f"must be > 0, got {p.capacity_units}")
            if p.memory_bytes < 0:
                raise SpecError(f"partitions[{i}].memory_bytes", f"must be >= 0, got {p.memory_bytes}")
        self._require_leader()
        node = types_pb2.Node(
            name=req.name, agent_address=req.agent_address, profilerd_address=req.profilerd_address,
            devices=req.devices, state=types_pb2.READY, incarnation=uuid.uuid4().hex[:12],
            last_heartbeat=self.clock(), partitions=req.partitions,
        )
        try:
            await self.store.put_node(node, None)
        except Fenced as e:
            raise NotLeader(str(e)) from None
        self.heartbeats[node.name] = node.last_heartbeat
        self.part_reports[node.name] = {p.id: p for p in req.partitions}
        # Executors of an earlier incarnation are gone or stale: requeue their jobs.
        await self._requeue_node_jobs({node.name: "node re-registered (agent restarted)"})
        self.log.info("node registered", node_id=node.name, incarnation=node.incarnation, devices=len(node.devices))
        self.kick.set()
        return node

    async def heartbeat(self, req: controller_pb2.HeartbeatRequest) -> list[str]:
        self._require_leader()
        v = await self.store.get_node(req.name)
        if v is None or v.value.incarnation != req.incarnation:
            raise PreconditionFailed(f"node {req.name}: incarnation {short(req.incarnation)!r} is not current; register again")
        now = self.clock()
        self.heartbeats[req.name] = now
        self.node_allocs[req.name] = (now, frozenset(req.running_allocations))
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
        if req.partitions:
            self.part_reports[req.name] = {p.id: p for p in req.partitions}
        held = {a for (n, _), hs in (await self.store.list_holders()).items() if n == req.name for a in hs}
        return [a for a in req.running_allocations if a not in held]

    async def list_nodes(self) -> list[types_pb2.Node]:
        """Every node with its partitions: allocated units (the controller's view, from
        etcd) and free units (the agent's last report)."""
        holders = await self.store.list_holders()
        out = []
        for v in await self.store.list_nodes():
            n = v.value
            if n.name in self.heartbeats:
                n.last_heartbeat = self.heartbeats[n.name]
            parts = adapter.node_partitions(n)
            reported = self.part_reports.get(n.name, {})
            held_devs = set()
            for p in parts:
                hs = holders.get((n.name, p.id), {})
                p.allocated_units = sum(u or p.capacity_units for u in hs.values())
                if hs:
                    held_devs.add(p.device_id)
                r = reported.get(p.id)
                if r is not None:
                    p.free_units, p.free_memory_bytes = r.free_units, r.free_memory_bytes
            del n.partitions[:]
            n.partitions.extend(parts)
            n.allocated_device_ids.extend(sorted(held_devs))
            out.append(n)
        return sorted(out, key=lambda n: n.name)

    # -- executor reports -------------------------------------------------------------
    async def report(self, r: controller_pb2.ExecutorReport) -> bool:
        """Apply an executor report; return True when its allocation is stale."""
        self._require_leader()
        now = self.clock()
        K = controller_pb2.ExecutorReport
        if r.kind == K.TASK and (fz := fusion.split_fused(r.task)) is not None:
            await self._guest_report(r, *fz)
            return False  # never stale: the executor is the host's, its own tasks go on
        stale = [False]
        after: list = []
        requeue: list[str] = []

        async def fn(job):
            st = job.status
            if st.allocation_id != r.allocation_id or st.phase not in ACTIVE:
                stale[0] = st.allocation_id != r.allocation_id or st.phase in TERMINAL
                return None
            world = sum(len(s.device_ids) for s in st.placement)
            started = r.kind in (K.STARTED, K.PROGRESS, K.TASK) and st.phase == P.SCHEDULED
            if started:
                transition(job, P.RUNNING, f"executors started on {', '.join(s.node for s in st.placement)}", now)
            if r.kind == K.PROGRESS:
                # A report without a step time (a resumed run with nothing left to train)
                # keeps the last one measured.
                st.step, st.loss, st.step_time_s = r.step, r.loss, r.step_time_s or st.step_time_s
                st.step_time_median_s = r.step_time_median_s or st.step_time_median_s
                if r.modules:
                    st.encoder_share = measured.fold_encoder_share(st.encoder_share, r.modules)
                if r.HasField("busy"):  # CPU busy fraction of the quota (agent, /proc)
                    st.busy = measured.fold_busy(st.busy, r.busy)
                if r.total_steps:
                    st.total_steps = r.total_steps
                if st.first_loss == 0:
                    st.first_loss = r.loss
                return [], []
            if r.kind == K.TASK:
                changed = peft_tasks.apply_report(job, r.task, r.task_phase, r.step, r.total_steps, r.loss, r.tokens_per_s)
                if changed and r.task_phase != "running" and st.phase == P.RUNNING:
                    # Its own tasks all ended while jobs fused into its executor still train:
                    # it stays RUNNING (the executor and its units are in use) and says so.
                    why = fusion.host_reason(job, fusion.guests_of(job.id, (await self.store.list_jobs())[0]))
                    if why:
                        st.reason = why
                return ([], []) if changed or started else None
            if r.kind == K.EXITED and r.stopped_by_agent:
                # The agent stopped it (its shutdown, or self-fencing): not the job's fault.
                requeue[:] = [f"its executor on {r.node} was stopped by the agent (rank {r.rank}, "
                              f"exit {r.exit_code}): {r.message}"[:400]]
                return None
            if r.kind == K.EXITED:
                # The rank's exit is recorded in the same transaction as the job, and only
                # for the current allocation: a late EXITED of a stopped allocation (whose
                # exits the reallocation deleted) writes nothing, so no key is left behind.
                exits = {**await self.store.rank_exits(r.allocation_id), r.rank: r.exit_code}
                if r.exit_code != 0:
                    after[:] = [(st.allocation_id, list(st.placement))]
                    cmp, ops = await self.store.realloc_ops(drop=st.allocation_id, drop_keys=alloc_keys(st.placement))
                    st.exit_code = r.exit_code
                    transition(job, P.FAILED, f"rank {r.rank} on {r.node} exited {r.exit_code}: {r.message}"[:500], now)
                    return cmp, ops
                if len(exits) >= world and all(c == 0 for c in exits.values()):
                    cmp, ops = await self.store.realloc_ops(drop=st.allocation_id, drop_keys=alloc_keys(st.placement))
                    transition(job, P.SUCCEEDED, f"all {world} ranks exited 0", now)
                    return cmp, ops
                return [], [self.store.put_exit_op(r.allocation_id, r.rank, r.exit_code)]
            return ([], []) if started else None

        job = await self._rmw(r.job_id, fn)
        if job.status.phase == P.RUNNING and job.status.allocation_id == r.allocation_id:
            self._backoff.pop(job.id, None)  # it runs: the next transient requeue starts over
        if requeue:
            # Back to PENDING from its last checkpoint, counted as a preemption; its other
            # ranks (if any) are stopped by the requeue.
            await self._requeue(job.id, r.allocation_id, requeue[0], transient=True)
            return stale[0]
        for alloc, shards in after:
            await self._stop_alloc(alloc, shards, "another rank failed")
        if job.status.phase in TERMINAL and r.kind == K.EXITED:
            self.log.info("job ended", job_id=job.id, phase=P.Name(job.status.phase), reason=job.status.reason)
            self.kick.set()
        return stale[0]

    # -- reconcile --------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile every interval and whenever ``kick`` is set, while leading. Node
        liveness also runs on its own timer (``_liveness_loop``) while a round is in
        progress, so that a round waiting on a slow agent (a StopExecutor answers once the
        ranks checkpointed, up to 60 s) never delays the detection of a lost node. On
        return, background stops still running are awaited."""
        live = asyncio.create_task(self._liveness_loop(stop))
        try:
            while not stop.is_set():
                try:
                    async with asyncio.timeout(self.cfg.reconcile_interval_s):
                        await self.kick.wait()
                except TimeoutError:
                    pass
                self.kick.clear()
                if not self.leading:
                    continue
                self._in_round = True
                try:
                    await self.reconcile_once()
                except (NotLeader, Fenced):
                    self.log.warning("reconcile stopped: not leader")
                except Exception:
                    self.log.exception("reconcile failed")
                finally:
                    self._in_round = False
        finally:
            live.cancel()
            await asyncio.gather(live, return_exceptions=True)
            await self.drain_stops()

    async def drain_stops(self, timeout_s: float = 5.0) -> None:
        """Await the background StopExecutor calls still running, for at most ``timeout_s``
        (a controller shutting down must not wait out a hung agent's 60 s RPC); the rest
        are cancelled and logged: best effort, as they always were (the next leader's
        heartbeat replies stop whatever is still running)."""
        if not self._stops:
            return
        pending = list(self._stops)
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        for t in late:
            t.cancel()
        if late:
            await asyncio.gather(*late, return_exceptions=True)
            self.log.warning("background stops cancelled at shutdown", count=len(late), waited_s=timeout_s)

    def _stop_later(self, alloc_id: str, shards, reason: str) -> None:
        """``_stop_alloc`` as a tracked background task (nothing waits for it: the stop is
        best effort, the heartbeat reply stops what it misses); an error is logged."""
        t = asyncio.create_task(self._stop_alloc(alloc_id, shards, reason))
        self._stops.add(t)

        def done(task: asyncio.Task) -> None:
            self._stops.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self.log.warning("background stop failed", allocation=alloc_id,
                                 error=f"{type(task.exception()).__name__}: {task.exception()}"[:300])

        t.add_done_callback(done)

    async def _liveness_loop(self, stop: asyncio.Event) -> None:
        """While a reconcile round is in progress, check node liveness every
        ``min(grace_s / 4, reconcile_interval_s)`` seconds (``check_liveness``): a round
        blocked on an agent does not delay marking a silent node NOT_READY and requeueing
        its jobs. Between rounds the round itself checks."""
        period = max(min(self.cfg.grace_s / 4, self.cfg.reconcile_interval_s), 0.05)
        while not stop.is_set():
            try:
                async with asyncio.timeout(period):
                    await stop.wait()
            except TimeoutError:
                pass
            if stop.is_set() or not self.leading or not self._in_round:
                continue
            try:
                await self.check_liveness()
            except (NotLeader, Fenced):
                pass  # the round says so
            except Exception:
                self.log.exception("liveness check failed")

    async def check_liveness(self, nodes=None, jobs: list[types_pb2.Job] | None = None) -> tuple[int, int]:
        """Node liveness: a READY node silent for more than ``grace_s`` is marked NOT_READY
        (compare-and-swap on its record), and the active jobs of every node that is not
        READY are requeued (idempotent: the requeue compares the allocation), their
        stops sent in the background. ``nodes``/``jobs``: as already read (else read
        here). Returns (nodes marked lost, jobs requeued)."""
        now = self.clock()
        if nodes is None:
            nodes = [v for v in await self.store.list_nodes()]
        lost = 0
        down: dict[str, str] = {}
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
                down[n.name] = f"node {n.name} stopped heartbeating for {self.cfg.grace_s:g}s"
            elif n.state != types_pb2.READY:
                down[n.name] = f"node {n.name} is not ready"
        if not down:
            return lost, 0
        if jobs is None:
            jobs, _ = await self.store.list_jobs()
        requeued = await self._requeue_node_jobs(down, jobs)
        if lost:
            self.kick.set()
        return lost, requeued

    async def reconcile_once(self) -> dict:
        t0 = time.perf_counter()
        now = self.clock()
        nodes = [v for v in await self.store.list_nodes()]
        # One read of every job per round; another only after a step changed some.
        jobs, _ = await self.store.list_jobs()
        # 1. liveness (check_liveness; also on its own timer while a round runs). Every
        # round, not only the one that marks a node NOT_READY: the jobs of any node that is
        # not READY are requeued (idempotent), so a sweep cut short by a crash, a failover
        # or an error is finished by the next round or the next leader.
        lost, requeued = await self.check_liveness(nodes, jobs)
        requeued += await self._requeue_never_launched(now, jobs)
        if requeued:
            jobs, _ = await self.store.list_jobs()
        # 2. schedule: the policy sees every partition and every pending and running job;
        # its reply is carried out as fenced writes, then agent RPCs.
        nodes = [v.value for v in await self.store.list_nodes()]
        # Jobs fused into an executor that is gone (host ended, moved, never reported):
        # back to PENDING as a preemption, before the policy sees the cluster.
        orphaned = fusion.orphans(jobs, now, max(2 * self.cfg.grace_s, 30.0))
        for g, why in orphaned:
            await self._guard("requeue of an orphaned fused job", g.id, self._requeue(g.id, g.status.allocation_id, why))
        if orphaned:
            jobs, _ = await self.store.list_jobs()
        pending = [j for j in jobs if j.status.phase == P.PENDING]
        active = [j for j in jobs if j.status.phase in ACTIVE]
        # Jobs backing off after transient requeues are not offered to the policy this round.
        current = {j.id for j in pending + active}
        self._backoff = {k: b for k, b in self._backoff.items() if k in current}
        waiting = {j.id for j in pending if self._backoff.get(j.id, (0, 0.0, 0.0))[2] > now}
        if waiting:
            pending = [j for j in pending if j.id not in waiting]
            jobs = [j for j in jobs if j.id not in waiting]
        # Cancels remembered for strays of allocations that ended: their executors are gone.
        live = {j.status.allocation_id for j in active}
        self._strays = {k for k in self._strays if k[0] in live}
        if not pending and not active:
            return {"placed": 0, "lost_nodes": lost, "removed": await self.remove_finished(jobs, now)}
        decision_id = "d-" + secrets.token_hex(4)
        dlog = self.log.bind(decision_id=decision_id)
        # Partitions an agent still holds for an allocation that etcd no longer has (a
        # stopped executor not gone yet) are not offered this round.
        nodes = adapter.hide_unreleased(nodes, await self.store.list_holders(), self.part_reports)
        est = self.round_estimator(nodes, pending + active)
        req = adapter.build_request(nodes, jobs, now, est)
        reply = self.policy.schedule(req)
        by_id = {j.id: j for j in jobs}
        node_map = {n.name: n for n in nodes}
        out = {"placed": 0, "lost_nodes": lost, "infeasible": len(reply.infeasible), "resized": 0, "preempted": 0}
        # Moves first: they free the partitions that this round's placements may take.
        # A job whose write or RPC fails unexpectedly is logged and skipped (``_guard``): the
        # round goes on with the others.
        for pre in reply.preemptions:
            if pre.job_id in by_id and await self._guard("preempt", pre.job_id,
                                                         self._preempt(by_id[pre.job_id], pre.reason, decision_id)):
                out["preempted"] += 1
        for rz in reply.resizes:
            if rz.job_id in by_id and await self._guard("resize", rz.job_id,
                                                        self._resize(by_id[rz.job_id], rz, node_map, decision_id)):
                out["resized"] += 1
        # Reshards (checkpoint + relaunch under a new encoder:LLM split) and repartitions
        # (live for CPU core sets, else checkpoint + relaunch): controller/actions.py.
        out["resharded"] = out["repartitioned"] = 0
        for rs in reply.reshards:
            if rs.job_id in by_id and await self._guard(
                    "reshard", rs.job_id, actions.reshard(self, by_id[rs.job_id], rs, node_map, decision_id)):
                out["resharded"] += 1
        for rp in reply.repartitions:
            out["repartitioned"] += await self._guard(f"repartition of group {rp.group_id}", "",
                                                      actions.repartition(self, rp, by_id, node_map, decision_id), 0)
        out["fused"] = 0
        placed: dict[str, tuple[str, str]] = {}  # this round: job id -> (node, partition) of a 1-device placement
        # This round: host id -> tasks fused into its executor (``jobs`` predates them).
        fused_tasks: dict[str, int] = {}
        for p in reply.placements:
            if p.job_id not in by_id:
                continue
            if fusion.is_fused_placement(p.reason) and by_id[p.job_id].spec.workload.type == "peft":
                got = await self._guard("fuse", p.job_id,
                                        self._fuse(by_id[p.job_id], p, jobs, decision_id, placed, fused_tasks), None)
                if got is True:
                    out["fused"] += 1
                    continue
                if isinstance(got, str):  # no executor to fuse into: its own, packed
                    p = replace(p, reason=f"packed on a shared device (not fused: {got})")
                else:
                    continue
            if await self._guard("place", p.job_id, self._place(by_id[p.job_id], p, node_map, decision_id)):
                out["placed"] += 1
                if len(p.shards) == 1 and len(p.shards[0].device_ids) == 1:
                    placed[p.job_id] = (p.shards[0].node, p.shards[0].device_ids[0])
        for inf in reply.infeasible:
            j = by_id.get(inf.job_id)
            if j is not None and (j.status.last_decision.action, j.status.last_decision.reason) != ("wait", inf.reason):
                await self._guard("wait decision", j.id, self._rmw(
                    j.id, lambda job, r=inf.reason: _set_decision(job, self.policy.name, r, now, decision_id)))
        dt = (time.perf_counter() - t0) * 1000
        dlog.info("decision cycle", policy=self.policy.name, nodes=len(nodes), pending=len(pending), running=len(active),
                  placements=[(p.job_id, p.reason) for p in reply.placements],
                  resizes=[(r.job_id, r.kind) for r in reply.resizes], preemptions=[p.job_id for p in reply.preemptions],
                  reshards=[(r.job_id, r.encoder_ranks, r.llm_ranks) for r in reply.reshards],
                  repartitions=[(r.group_id, r.quotas) for r in reply.repartitions], starving=list(reply.starving),
                  ms=round(dt, 2), **out)
        # Last: removals never delay this round's placements.
        out["removed"] = await self.remove_finished(jobs, now)
        return out

    async def _guard(self, what: str, job_id: str, coro, default=False):
        """Await ``coro`` (one job's part of a round); any failure but ``NotLeader`` /
        ``Fenced`` (which end the round) and a job gone meanwhile (``NotFound``, quiet) is
        logged and answered ``default``, so that one job's failing write (e.g. a record etcd
        refuses) does not abort the round's other placements, moves and removals."""
        try:
            return await coro
        except (NotLeader, Fenced):
            raise
        except NotFound:
            return default
        except Exception as e:
            self.log.exception(f"{what} failed; the round goes on with the other jobs", job_id=job_id,
                               error=f"{type(e).__name__}: {e}"[:300])
            return default

    async def remove_finished(self, jobs: list[types_pb2.Job], now: float) -> int:
        """Retention: remove the finished jobs of ``jobs`` (every job as read this round)
        that :func:`expired_jobs` selects, in its order (a job after those naming it), each
        in one fenced transaction compared on the job's mod revision (a job changed since it
        was read is left for a later round, and so are the jobs it names) that
        also deletes its idempotency key, its allocation's rank exits and any partition
        units the allocation still holds (a guest's allocation is its host's: untouched).
        ``Fenced`` propagates (a deposed leader removes nothing). Returns how many were
        removed."""
        doomed = expired_jobs(jobs, now, self.cfg.finished_job_ttl_s, MAX_REMOVALS_PER_ROUND)
        if not doomed:
            return 0
        t0 = time.perf_counter()
        live = {j.status.allocation_id for j in jobs if j.status.phase not in TERMINAL and j.status.allocation_id}
        holders = await self.store.list_holders()
        removed, deferred = 0, 0
        blocked: set[str] = set()  # named by a job this round left stored: they stay too
        for j in doomed:
            if j.id in blocked:
                deferred += 1
                blocked.update(_needs(j))
                continue
            alloc = j.status.allocation_id
            cmp, ops = [], []
            if alloc and not j.status.fused_into and alloc not in live:
                held = [key for key, hs in holders.items() if alloc in hs]
                cmp, ops = await self.store.realloc_ops(drop=alloc, drop_keys=held)
            try:
                await self.store.delete_job(j, j.revision, cmp, ops)
            except Conflict:
                deferred += 1  # changed (or a partition record moved) since read: next round
                blocked.update(_needs(j))
                continue
            except Fenced:
                raise
            except Exception as e:  # one failing removal does not stop the others
                self.log.warning("finished job removal failed; retried next round", job_id=j.id,
                                 error=f"{type(e).__name__}: {e}"[:300])
                deferred += 1
                blocked.update(_needs(j))
                continue
            removed += 1
            self.launched_at.pop(alloc, None)
            self.log.debug("finished job removed", job_id=j.id, phase=P.Name(j.status.phase),
                           finished_s_ago=round(now - finished_at(j), 1))
        self.log.info("finished jobs removed", removed=removed, deferred=deferred, ttl_s=self.cfg.finished_job_ttl_s,
                      oldest_finished_s_ago=round(now - min(finished_at(d) for d in doomed), 1),
                      ms=round((time.perf_counter() - t0) * 1000, 2))
        return removed

    def round_estimator(self, nodes: list[types_pb2.Node], jobs: list[types_pb2.Job]) -> object | None:
        """The estimator of this round: ``self.estimator`` when set; else a
        ``SnapshotEstimator`` over the newest cached snapshot (kept across rounds while the
        snapshot and the device classes are the same, so the policy's grids stay cached)
        with every job of ``jobs`` that has a shape registered (``adapter.job_shape``: gpt,
        and peft / multimodal by their step shape); None without a fitted snapshot."""
        if self.estimator is not None:
            return self.estimator
        model = self.snapshot() if self.snapshot is not None else None
        if model is None or model.version <= 0:
            return None
        classes = adapter.device_classes(nodes)
        live = self._live
        if live is None or live.model is not model or live.classes != classes:
            live = self._live = SnapshotEstimator(model, classes)
            self.log.info("live estimator", model_version=model.version,
                          classes={t: (c.kind, c.quota) for t, c in classes.items()})
        for j in jobs:
            s = adapter.job_shape(j)
            if s is not None:
                live.register(job_key(s), s)
        return live

    def _estimate_note(self, job: types_pb2.Job) -> str:
        """" [estimates: perf model vN]" when the live estimator answered for ``job``."""
        live = self._live
        if live is None or self.estimator is not None:
            return ""
        key = adapter.model_key(job)
        return f" [estimates: perf model v{live.version}]" if live.knows(key) else ""

    def _capacity(self, nodes: dict) -> dict[tuple[str, str], int]:
        return {(n.name, p.id): p.capacity_units for n in nodes.values() for p in adapter.node_partitions(n)}

    async def _place(self, job: types_pb2.Job, p: Placement, nodes: dict, decision_id: str = "") -> bool:
        """Persist a placement (partitions and quotas taken in the same fenced transaction
        that moves the job to SCHEDULED), then launch its executors; a launch refused by an
        agent requeues the job. A partition found full (the policy's view was stale) leaves
        the job PENDING with a "wait" decision saying which."""
        now = self.clock()
        alloc_id = "a-" + secrets.token_hex(6)
        try:
            shards = adapter.shards_for(p, nodes)
        except KeyError as e:
            self.log.warning("placement names an unknown partition", job_id=job.id, error=str(e))
            return False
        # A placement on another count than the job's plan asks for (the policy shrank or
        # expanded it at placement, or it resumes on another count after a resize): run it
        # under a plan for that count, like a resize.
        n = sum(len(s.device_ids) for s in shards)
        sp = job.spec.workload.plan
        plan = None
        if job.spec.workload.type == "gpt" and n != max(sp.dp, 1) * max(sp.tp, 1) * max(sp.pp, 1):
            stages = p.plan.stages if p.plan is not None else 0
            plan = adapter.replan(sp, job.spec.workload.model, job.spec.workload.batch_size, n, stages)
            if plan is None:
                self.log.info("placement skipped: no plan fits", job_id=job.id, devices=n)
                return False
        want = adapter.shard_units(shards, nodes)
        caps = self._capacity(nodes)
        action = "pack" if p.quota < 1.0 else "place"
        note = self._estimate_note(job)
        if plan is not None:
            note = f"; plan dp={plan.dp} tp={plan.tp} pp={plan.pp}{note}"

        async def fn(j):
            if j.status.phase != P.PENDING:
                return None
            if j.status.attempts - j.status.preemptions >= self.cfg.max_attempts:
                transition(j, P.FAILED, f"gave up after {j.status.attempts} placements: {j.status.reason}", now)
                return [], []
            try:
                cmp, ops = await self.store.realloc_ops(add=alloc_id, add_units=want, capacity=caps)
            except CapacityExceeded as e:
                return _set_decision(j, self.policy.name, f"waiting: {e}", now, decision_id)
            del j.status.placement[:]
            j.status.placement.extend(shards)
            j.status.allocation_id = alloc_id
            j.status.attempts += 1
            # A new placement, on new units: busy (a fraction of the old quota) is not
            # measured under it yet (0; the policy falls back to the requested share).
            j.status.busy = 0.0
            actions.forget_step_times(j)  # likewise the step times
            j.status.ClearField("plan")
            if plan is not None:
                j.status.plan.CopyFrom(plan)
            where = ", ".join(f"{s.node}[{','.join(s.partition_ids)}]" + (f" {s.units} units" if s.units else "")
                              for s in shards)
            decide(j, self.policy.name, action, f"{p.reason or 'placed'} ({where}){note}", now, decision_id, p.quota)
            transition(j, P.SCHEDULED, f"placed on {', '.join(s.node for s in shards)}", now)
            return cmp, ops

        try:
            job = await self._rmw(job.id, fn)
        except Conflict:
            return False
        if job.status.allocation_id != alloc_id or job.status.phase != P.SCHEDULED:
            return False
        self.log.info("job placed", job_id=job.id, allocation=alloc_id, decision=job.status.decision,
                      decision_id=decision_id)
        return await self._launch_or_requeue(job, nodes, "launch")

    async def _fuse(self, job: types_pb2.Job, p: Placement, jobs: list[types_pb2.Job], decision_id: str,
                    placed: dict[str, tuple[str, str]] | None = None,
                    fused_tasks: dict[str, int] | None = None) -> bool | str | None:
        """Carry out a "fused with LoRA tasks on backbone ..." placement (controller/fusion.py):
        pick the host (a running peft job's executor on the placement's partition, same
        backbone), then one fenced write moves ``job`` to SCHEDULED fused into it
        (``fused_into``, the host's allocation id and placement; no units of its own) with
        the decision, then its tasks are added to the host's executor (agent ControlTask
        "add", names ``<job id>_<task>``, each checkpointing under the job's own checkpoint
        directory). The job turns RUNNING on its first routed task report. ``fused_tasks``
        (host id -> tasks fused into it this round, updated here) counts toward the host's
        ``MAX_TASKS`` load, which ``jobs`` (read at the round's start) does not show.

        A job of the same backbone whose executor is about to start there (placed this
        round, or SCHEDULED: ``fusion.starting_host``) is waited for: ``job`` stays PENDING
        with a "wait" decision and fuses into it on a later round.

        Returns True when fused; a string (why) when no host can take it (the caller packs
        it in its own executor instead); None when nothing was done (waiting for a starting
        host, the job moved on, or the agent refused the add: the job is requeued as a
        preemption)."""
        sh = p.shards[0]
        fused_tasks = {} if fused_tasks is None else fused_tasks
        host, why = fusion.pick_host(job, sh.node, sh.device_ids[0], jobs, fused_tasks)
        if host is None:
            starting = fusion.starting_host(job, sh.node, sh.device_ids[0], jobs, placed or {})
            if starting:
                now = self.clock()
                reason = f"{p.reason}: waiting for the executor of job {starting} to start, to fuse into it"
                try:
                    await self._rmw(job.id, lambda j: _set_decision(j, self.policy.name, reason, now, decision_id))
                except (NotFound, Conflict):
                    pass
                return None
            self.log.info("fusion not possible; own executor", job_id=job.id, why=why, decision_id=decision_id)
            return why
        try:
            adds = fusion.guest_tasks(job, os.path.abspath(os.path.join(self.cfg.checkpoint_root, job.id)))
        except SpecError as e:
            return f"{e.field}: {e}"
        now = self.clock()
        alloc = host.status.allocation_id
        node = host.status.placement[0].node
        note = (f"{p.reason}: {len(adds)} tasks added to the executor of job {host.id} "
                f"(allocation {alloc}, {node}[{','.join(sh.device_ids)}])")

        def fn(j):
            if j.status.phase != P.PENDING:
                return None
            if j.status.attempts - j.status.preemptions >= self.cfg.max_attempts:
                transition(j, P.FAILED, f"gave up after {j.status.attempts} placements: {j.status.reason}", now)
                return [], []
            del j.status.placement[:]
            j.status.placement.extend(host.status.placement)
            j.status.allocation_id = alloc
            j.status.fused_into = host.id
            j.status.attempts += 1
            j.status.ClearField("plan")
            decide(j, self.policy.name, "fuse", note, now, decision_id, p.quota)
            transition(j, P.SCHEDULED, f"fused into the executor of job {host.id}", now)
            return [], []

        try:
            job = await self._rmw(job.id, fn)
        except Conflict:
            return None
        if job.status.fused_into != host.id or job.status.phase != P.SCHEDULED:
            return None
        # Counted from the fenced write on (also when an add then fails and the job is
        # requeued: an overcount only sends a later guest of this round elsewhere).
        fused_tasks[host.id] = fused_tasks.get(host.id, 0) + len(adds)
        self.log.info("job fused", job_id=job.id, host=host.id, allocation=alloc, tasks=[a[0] for a in adds],
                      decision_id=decision_id)
        for name, spec, tdir in adds:
            err = await self._control(node, alloc, "add", name, task_json=json.dumps(spec), task_dir=tdir)
            if err:
                # The executor gone or the agent unreachable: a preemption; refused as invalid:
                # counts toward max_attempts (no endless re-fusing).
                await self._requeue(job.id, alloc, f"adding its tasks to the executor of job {host.id} failed: {err}",
                                    refused=err.startswith("INVALID_ARGUMENT"))
                return None
        return True

    async def _control(self, node_name: str, alloc: str, op: str, task: str, task_json: str = "", task_dir: str = "",
                       quiet: bool = False) -> str:
        """One ControlTask RPC to the agent of ``node_name``; "" on success, else why (logged)."""
        v = await self.store.get_node(node_name)
        if v is None:
            return f"node {node_name} is unknown"
        try:
            await self.agents.stub(v.value.agent_address).ControlTask(
                agent_pb2.ControlTaskRequest(allocation_id=alloc, fencing_token=self.store.fencing_token or 0, op=op,
                                             task=task, task_json=task_json, task_dir=task_dir), timeout=5)
        except grpc.aio.AioRpcError as e:
            (self.log.info if quiet else self.log.warning)("task control failed", node_id=node_name, allocation=alloc,
                                                           op=op, task=task, error=e.details())
            return f"{e.code().name}: {e.details()}"
        return ""

    async def _guest_report(self, r: controller_pb2.ExecutorReport, guest_id: str, task: str) -> None:
        """A TASK report of a host's executor about a fused task ``<guest id>_<task>``: folded
        into the guest's own record (tasks table, step, loss; RUNNING on the first,
        SUCCEEDED once all its tasks ended). A report for a guest not fused into that
        allocation any more (cancelled, requeued) is a stray: dropped, and the task is
        cancelled in the executor when it still runs."""
        now = self.clock()
        stray, ended = [False], [False]

        def fn(g):
            st = g.status
            if st.fused_into != r.job_id or st.allocation_id != r.allocation_id or st.phase not in ACTIVE:
                stray[0] = True
                return None
            started = st.phase == P.SCHEDULED
            if started:
                transition(g, P.RUNNING, f"its tasks train in the executor of job {r.job_id} on {r.node}", now)
            changed = peft_tasks.apply_report(g, task, r.task_phase, r.step, r.total_steps, r.loss, r.tokens_per_s)
            if not (changed or started):
                return None
            fusion.fold_progress(g)
            out = fusion.guest_outcome(g)
            if out is not None:
                transition(g, out[0], out[1], now)
                ended[0] = True
            return [], []

        try:
            g = await self._rmw(guest_id, fn)
        except NotFound:
            stray[0], g = True, None
        if stray[0]:
            key = (r.allocation_id, r.task)
            if r.task_phase == "running" and key not in self._strays:
                self.log.info("stray fused task: cancelling it in the executor", job_id=guest_id, host=r.job_id,
                              allocation=r.allocation_id, task=r.task)
                # Remembered only once the cancel went through: a failed one is retried at
                # the task's next running report.
                if not await self._control(r.node, r.allocation_id, "cancel", r.task, quiet=True):
                    self._strays.add(key)
            return
        if ended[0] and g is not None:
            self.log.info("job ended", job_id=g.id, phase=P.Name(g.status.phase), reason=g.status.reason,
                          fused_into=r.job_id)
            self.kick.set()

    async def _resize(self, job: types_pb2.Job, rz: Resize, nodes: dict, decision_id: str) -> bool:
        """Carry out a resize / migrate / type change of a running job: the new partitions
        (and, on another device count, a plan for it) go through :func:`actions.relaunch`
        — one fenced write moves the allocation, SIGTERM checkpoints the old ranks, the
        new ones resume (and reshard) from the checkpoint under the new plan."""
        old_shards = list(job.status.placement)
        try:
            shards = adapter.shards_for(rz.placement, nodes)
        except KeyError as e:
            self.log.warning("resize names an unknown partition", job_id=job.id, error=str(e))
            return False
        n = sum(len(s.device_ids) for s in shards)
        cur = job.status.plan if job.status.HasField("plan") else job.spec.workload.plan
        plan = None
        if n != sum(len(s.device_ids) for s in old_shards):
            if job.spec.workload.type != "gpt":
                self.log.info("resize skipped: only gpt jobs change device count", job_id=job.id, kind=rz.kind)
                return False
            stages = rz.placement.plan.stages if rz.placement.plan is not None else 0
            plan = adapter.replan(cur, job.spec.workload.model, job.spec.workload.batch_size, n, stages)
            if plan is None:
                self.log.info("resize skipped: no plan fits", job_id=job.id, devices=n)
                return False
        ptxt = f"; plan dp={plan.dp} tp={plan.tp} pp={plan.pp}" if plan is not None else ""

        def mutate(j: types_pb2.Job) -> None:
            if plan is not None:
                j.status.plan.CopyFrom(plan)

        return await actions.relaunch(self, job, rz.kind, f"{rz.reason or rz.kind}{ptxt}{self._estimate_note(job)}",
                                      nodes, decision_id, mutate=mutate, quota=rz.placement.quota, shards=shards,
                                      where=" on " + ", ".join(s.node for s in shards))

    async def _preempt(self, job: types_pb2.Job, reason: str, decision_id: str) -> bool:
        """Stop a running job at a checkpoint and return it to PENDING (not a failure)."""
        now = self.clock()
        alloc_id, shards = job.status.allocation_id, list(job.status.placement)

        async def fn(j):
            if j.status.allocation_id != alloc_id or j.status.phase not in ACTIVE:
                return None
            cmp, ops = await self.store.realloc_ops(drop=alloc_id, drop_keys=alloc_keys(j.status.placement))
            j.status.allocation_id = ""
            j.status.preemptions += 1
            peft_tasks.wait_to_resume(j, f"job requeued: preempted: {reason}")
            decide(j, self.policy.name, "preempt", reason or "preempted", now, decision_id)
            transition(j, P.PENDING, f"preempted: {reason}; resumes from its checkpoint"[:500], now)
            return cmp, ops

        try:
            job = await self._rmw(job.id, fn)
        except Conflict:
            return False
        if job.status.phase != P.PENDING:
            return False
        self.log.info("job preempted", job_id=job.id, allocation=alloc_id, reason=reason, decision_id=decision_id)
        await self._stop_alloc(alloc_id, shards, f"preempted: {reason}")
        return True

    async def _launch(self, job: types_pb2.Job, nodes: dict) -> tuple[bool, str]:
        doc = manifest.validate(manifest.from_proto(job.spec))
        if job.status.HasField("plan"):  # resized: the plan of the current allocation
            pl = job.status.plan
            doc["workload"]["plan"] = {"dp": pl.dp, "tp": pl.tp, "pp": pl.pp, "micro_batches": pl.micro_batches}
        actions.apply_overrides(job, doc)  # a reshard's encoder:LLM split
        rt = {"job_id": job.id, "workload": doc["workload"]}
        if is_profile_job(job):  # its steps are the profile of its step shape (tessera.modelkey.profile_labels)
            rt["profiling"] = True
        spec_json = json.dumps(rt)
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
                    partition_id=s.partition_ids[i] if len(s.partition_ids) > i else "", units=s.units,
                    memory_bytes=s.memory_bytes,
                )
                calls.append((node.name, self.agents.stub(node.agent_address).LaunchExecutor(req, timeout=15)))
        results = await asyncio.gather(*(c for _, c in calls), return_exceptions=True)
        # A heartbeat older than this (plus the grace) cannot show the allocation yet: a
        # relaunch waits for the old ranks to checkpoint before it launches.
        self.launched_at[job.status.allocation_id] = self.clock()
        for (name, _), res in zip(calls, results):
            if isinstance(res, Exception):
                msg = res.details() if isinstance(res, grpc.aio.AioRpcError) else str(res)
                if isinstance(res, grpc.aio.AioRpcError) and res.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # The agent still holds the partition (an executor of a stopped allocation
                    # not gone yet): transient, the job is requeued without counting a failure.
                    return False, f"busy: {name}: {msg}"
                return False, f"{name}: {msg}"
        return True, ""

    async def _launch_or_requeue(self, job: types_pb2.Job, nodes: dict, what: str) -> bool:
        """Launch ``job``'s executors on its current allocation; when an agent refuses,
        requeue it (``what failed: why``). A partition an agent still holds (an executor
        of a stopped allocation not gone yet, "busy: ...") is transient and does not
        count toward ``max_attempts``; any other refusal does."""
        ok, why = await self._launch(job, nodes)
        if not ok:
            await self._requeue(job.id, job.status.allocation_id, f"{what} failed: {why}",
                                transient=why.startswith("busy: "))
        return ok

    async def _requeue(self, job_id: str, alloc_id: str, reason: str, transient: bool = False,
                       refused: bool = False, backoff: bool | None = None, wait_stop: bool = True) -> None:
        """Return an active job to PENDING and stop its executors; ``transient`` (a
        partition still busy at the agent, an executor the agent stopped, a launch that
        never happened, a lost node) does not count toward ``max_attempts`` (counted in
        ``preemptions`` instead). ``backoff`` (default: ``transient``): the job is not
        offered to the policy again for ``transient_backoff(n)`` seconds, n = its transient
        requeues in a row; the wait is in its reason and its "wait" decision. A job
        fused into another's executor is only detached, counted as a preemption unless
        ``refused`` (the agent refused its tasks as invalid: counts toward
        ``max_attempts``): the host's executor and allocation are the host's.
        ``wait_stop=False``: the executors are stopped in the background (``_stop_later``)."""
        now = self.clock()
        stop: list = []
        backoff = transient if backoff is None else backoff
        prev = self._backoff.get(job_id)
        n = prev[0] + 1 if prev is not None and now - prev[1] < TRANSIENT_BACKOFF_RESET_S else 1
        delay = transient_backoff(n) if backoff else 0.0
        wrote = [False]

        async def fn(j):
            if j.status.allocation_id != alloc_id or j.status.phase not in ACTIVE:
                return None
            if j.status.fused_into:
                # Fused into a host's executor: no units or executor of its own to release
                # (the allocation is the host's). Not a failure: it resumes from its tasks'
                # checkpoints (state.pt; ended tasks: adapter.pt if succeeded, outcome.json if cancelled).
                j.status.allocation_id = ""
                j.status.fused_into = ""
                if not refused:
                    j.status.preemptions += 1
                peft_tasks.wait_to_resume(j, f"job requeued: {reason}")
                transition(j, P.PENDING, f"requeued: {reason}; resumes from its tasks' checkpoints"[:500], now)
                return [], []
            stop[:] = [(alloc_id, list(j.status.placement))]
            cmp, ops = await self.store.realloc_ops(drop=alloc_id, drop_keys=alloc_keys(j.status.placement))
            j.status.allocation_id = ""
            if transient:
                j.status.preemptions += 1
            peft_tasks.wait_to_resume(j, f"job requeued: {reason}")
            text = f"requeued: {reason}"[:500]
            if delay:
                wait = f"not re-placed for {delay:g}s (backoff after {n} transient requeues in a row)"
                text = f"{text[:490 - len(wait)]}; {wait}"
                decide(j, self.policy.name, "wait", f"{wait}: {reason}", now, "")
            transition(j, P.PENDING, text, now)
            wrote[0] = True
            return cmp, ops

        await self._rmw(job_id, fn)
        if wrote[0] and backoff:
            self._backoff[job_id] = (n, now, now + delay)
        for a, shards in stop:
            if wait_stop:
                await self._stop_alloc(a, shards, reason)
            else:
                self._stop_later(a, shards, reason)
        self.log.warning("job requeued", job_id=job_id, reason=reason)
        self.kick.set()

    async def _requeue_never_launched(self, now: float, jobs: list[types_pb2.Job]) -> int:
        """Requeue (transient) every job SCHEDULED for more than ``grace_s`` whose
        allocation a node of its placement left out of a heartbeat sent more than
        ``grace_s`` after the scheduling: its launch never happened (the controller that
        wrote it died or was deposed before the RPC, or the launch failed and its requeue
        did not go through). The grace counts from the later of the scheduling and this
        controller's launch of the allocation (a relaunch first waits for the old ranks to
        checkpoint and exit). Fused guests have no executor of their own: skipped.
        ``jobs``: every job as read this round. Returns how many were requeued."""
        grace = self.cfg.grace_s
        requeued = 0
        live = {j.status.allocation_id for j in jobs if j.status.phase in ACTIVE}
        self.launched_at = {a: t for a, t in self.launched_at.items() if a in live}
        for j in jobs:
            st = j.status
            if st.phase != P.SCHEDULED or st.fused_into or not st.allocation_id:
                continue
            since = max((h.time for h in st.history if h.phase == P.SCHEDULED), default=0.0)
            since = max(since, self.launched_at.get(st.allocation_id, since))
            if now - since <= grace:
                continue
            missing = [s.node for s in st.placement
                       if (hb := self.node_allocs.get(s.node)) is not None and hb[0] > since + grace
                       and st.allocation_id not in hb[1]]
            if missing:
                try:
                    await self._requeue(j.id, st.allocation_id,
                                        f"executor never started on {missing[0]} (allocation {st.allocation_id} "
                                        f"absent from its heartbeats {grace:g}s after scheduling)", transient=True)
                    requeued += 1
                except (NotLeader, Fenced):
                    raise
                except Exception as e:  # Conflict, or any failing write: the others still go
                    self.log.warning("requeue of a never-launched job deferred", job_id=j.id,
                                     error=f"{type(e).__name__}: {e}"[:300])
        return requeued

    async def _requeue_node_jobs(self, down: dict[str, str], jobs: list[types_pb2.Job] | None = None) -> int:
        """Requeue every active job placed on a node of ``down`` (node -> reason: lost, or
        its agent re-registered) as a preemption (``preemptions`` + 1, not toward
        ``max_attempts``, no backoff; the reason is in its history), its executors stopped
        in the background (a slow agent delays no other requeue); ``jobs``:
        every job as already read (else read here). A job whose requeue conflicts is left
        for the next round; the others still go. Returns how many were requeued."""
        if jobs is None:
            jobs, _ = await self.store.list_jobs()
        requeued = 0
        for j in jobs:
            hit = [s.node for s in j.status.placement if s.node in down]
            if j.status.phase in ACTIVE and hit:
                try:
                    # Not the job's fault: a preemption, not a failed attempt, and no backoff.
                    await self._requeue(j.id, j.status.allocation_id, down[hit[0]], transient=True, backoff=False,
                                        wait_stop=False)
                    requeued += 1
                except (NotLeader, Fenced):
                    raise
                except Exception as e:  # Conflict, or any failing write: the others still go
                    self.log.warning("requeue of a lost node's job deferred", job_id=j.id,
                                     error=f"{type(e).__name__}: {e}"[:300])
        return requeued

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
                    # The agent answers once its ranks are gone (SIGTERM, checkpoint, exit; SIGKILL
                    # after its grace): waiting lets a relaunch on the same partitions find them free.
                    timeout=60,
                )
            except grpc.aio.AioRpcError as e:
                self.log.warning("stop failed", node_id=s.node, allocation=alloc_id, error=e.details())

    async def logs(self, job_id: str, tail: int) -> tuple[str, bool]:
        """The last ``tail`` bytes of a job's executor log from every READY node that has
        one. A peft task (``<job id>/<task>``) shares its job's executor: its log is the
        job's; a job fused into another's executor (``status.fused_into``; likewise its
        tasks) reads its host's. NotFound for an unknown job or task; a node without the
        log is skipped; an agent that cannot be reached (UNAVAILABLE, DEADLINE_EXCEEDED)
        is ConnectionError (retry) when no node answered; any other refusal of an agent
        is AgentRefused with the agent's code (the first refusal's) when no node returned
        a log, and otherwise a line ``==> node NAME: log not read (CODE: details) <==``
        after the logs that were read."""
        if tail < 0 or tail > wire.MAX_LOG_TAIL_BYTES:
            raise SpecError("tail_bytes", f"must be between 0 and {wire.MAX_LOG_TAIL_BYTES}, got {tail}")
        await self.get(job_id)  # NotFound for an unknown job or task
        parent_id, _ = peft_tasks.split_id(job_id)
        job = await self.get(parent_id)
        log_id = job.status.fused_into or parent_id  # a guest's output is in its host's executor log
        parts, truncated, errors = [], False, []
        refused: list[tuple[str, grpc.StatusCode, str]] = []
        for n in await self.list_nodes():
            if n.state != types_pb2.READY:
                continue
            try:
                r = await self.agents.stub(n.agent_address).ReadLogs(agent_pb2.ReadLogsRequest(job_id=log_id, tail_bytes=tail), timeout=5)
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    errors.append(f"{n.name}: {e.details()}")
                elif e.code() != grpc.StatusCode.NOT_FOUND:
                    refused.append((n.name, e.code(), e.details() or ""))
                continue
            parts.append(f"==> node {n.name} <==\n{r.text}")
            truncated |= r.truncated
        if not parts and refused:
            name, code, details = refused[0]
            raise AgentRefused(code, f"agent of node {name}: {details}")
        if not parts and errors:
            raise ConnectionError("; ".join(errors))
        parts += [f"==> node {name}: log not read ({code.name}: {details}) <==" for name, code, details in refused]
        return "\n".join(parts), truncated


def _set_decision(job: types_pb2.Job, policy: str, reason: str, now: float, decision_id: str):
    """Record a "wait" decision on a PENDING job; None (no write) when unchanged."""
    d = job.status.last_decision
    if job.status.phase != P.PENDING or (d.action, d.reason) == ("wait", reason[:500]):
        return None
    decide(job, policy, "wait", reason, now, decision_id)
    job.status.reason = reason if reason.startswith("waiting") else f"waiting: {reason}"
    return [], []


def _span(seconds: float) -> str:
    """A duration for people: "7d", "36h", "90m", "45s"."""
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{seconds / n:g}{unit}"
    return f"{seconds:g}s"
