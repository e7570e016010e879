"""Thin gRPC servicers of the controller: translate messages and map errors to codes.

Error mapping: SpecError -> INVALID_ARGUMENT (message names the field); NotFound ->
NOT_FOUND (for a job id: says how long finished jobs are kept, ``finished_job_ttl_s``); AlreadyExists -> ALREADY_EXISTS; PreconditionFailed -> FAILED_PRECONDITION;
NotLeader / Conflict / etcd unreachable -> UNAVAILABLE (retry); AgentRefused (an agent's
refusal of a forwarded request) -> the agent's code; anything else -> INTERNAL, logged.

Ids a client names (``job_id``, ``allocation_id``, a node's ``name``) longer than
MAX_ID_CHARS are INVALID_ARGUMENT naming the field, before anything is read; echoed
input is cut short in messages, and every status message is capped at
MAX_MESSAGE_BYTES (UTF-8) so that it always fits gRPC's metadata limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math

import aetcd
import grpc

from tessera import log
from tessera.api.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from tessera.errors import SpecError
from tessera.wire import WATCH_OPEN_METADATA_KEY

from . import tasks as peft_tasks
from .core import AgentRefused, AlreadyExists, Controller, NotFound, NotLeader, PreconditionFailed
from .store import Conflict

_log = log.get(component="api")

MAX_ID_CHARS = 256
# The status message travels percent-encoded in a trailer (at most 3 bytes per byte);
# gRPC's default metadata limit is 8 KiB.
MAX_MESSAGE_BYTES = 2048


def check_id(field: str, value: str, required: bool = True) -> None:
    """SpecError(field) for an empty (when ``required``) or over-long id."""
    if required and not value:
        raise SpecError(field, "is required")
    if len(value) > MAX_ID_CHARS:
        raise SpecError(field, f"must be at most {MAX_ID_CHARS} characters, got {len(value)}")


def cap_message(text: str) -> str:
    """``text`` cut to at most MAX_MESSAGE_BYTES of UTF-8 (then "…")."""
    raw = text.encode()
    if len(raw) <= MAX_MESSAGE_BYTES:
        return text
    return raw[:MAX_MESSAGE_BYTES - 3].decode(errors="ignore") + "…"


def _code(e: Exception) -> grpc.StatusCode:
    if isinstance(e, AgentRefused):
        return e.code
    if isinstance(e, SpecError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(e, NotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(e, AlreadyExists):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(e, PreconditionFailed):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(e, aetcd.ClientError) and "request is too large" in str(e):
        return grpc.StatusCode.INVALID_ARGUMENT  # etcd will never take it: retrying cannot help
    if isinstance(e, (NotLeader, Conflict, aetcd.ClientError, ConnectionError)):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


def rpc(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            code = _code(e)
            if code == grpc.StatusCode.INTERNAL:
                _log.exception("internal error", rpc=fn.__name__)
            await context.abort(code, cap_message(str(e)))
    return wrapper


class JobService(controller_pb2_grpc.JobServiceServicer):
    """``stopping``: set when the controller begins to stop; every open WatchJobs stream
    then ends at once with UNAVAILABLE, which clients (tessera.client) answer by watching
    again from their last revision — at the next leader, or this one restarted. Without
    it a stop waited out the server's grace for streams that never end by themselves."""

    def __init__(self, ctl: Controller, stopping: asyncio.Event | None = None) -> None:
        self.ctl = ctl
        self.stopping = stopping or asyncio.Event()

    @rpc
    async def SubmitJob(self, request, context):
        if not request.HasField("spec"):
            raise SpecError("spec", "is required")
        job, created = await self.ctl.submit(request.spec, request.idempotency_key)
        return controller_pb2.SubmitJobResponse(job=job, created=created)

    @rpc
    async def GetJob(self, request, context):
        check_id("job_id", request.job_id)
        return await self.ctl.get(request.job_id)

    @rpc
    async def ListJobs(self, request, context):
        for i, p in enumerate(request.phases):
            if p not in types_pb2.JobPhase.values() or p == 0:
                raise SpecError(f"phases[{i}]", f"unknown phase {p}")
        jobs, nxt, rev = await self.ctl.list(request.tenant, list(request.phases), request.page_size, request.page_token,
                                             include_tasks=request.include_tasks)
        return controller_pb2.ListJobsResponse(jobs=jobs, next_page_token=nxt, revision=rev)

    @rpc
    async def CancelJob(self, request, context):
        check_id("job_id", request.job_id)
        return await self.ctl.cancel(request.job_id, request.reason)

    @rpc
    async def GetJobLogs(self, request, context):
        check_id("job_id", request.job_id)
        text, truncated = await self.ctl.logs(request.job_id, request.tail_bytes or 64 << 10)
        return controller_pb2.GetJobLogsResponse(text=text, truncated=truncated)

    async def WatchJobs(self, request, context):
        if request.start_revision < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start_revision: must be >= 0")
        try:
            check_id("job_id", request.job_id, required=False)
            if "/" in request.job_id:
                await self.ctl.get(request.job_id)  # NotFound for an unknown job or task, as GetJob
        except Exception as e:  # noqa: BLE001 - every error becomes a status, as in ``rpc``
            code = _code(e)
            if code == grpc.StatusCode.INTERNAL:
                _log.exception("internal error", rpc="WatchJobs")
            await context.abort(code, cap_message(str(e)))
        # Tell the client the watch is open now, not with a first event that a quiet job
        # may never send: its outage clock restarts on this (tessera.client).
        await context.send_initial_metadata(((WATCH_OPEN_METADATA_KEY, "1"),))
        try:
            async for ev in until_set(self.stopping, watch_jobs(self.ctl, request)):
                yield ev
            if self.stopping.is_set():
                await context.abort(grpc.StatusCode.UNAVAILABLE, "controller stopping; watch again from the last "
                                    "revision (another replica, or this one once restarted)")
        except aetcd.RevisionCompactedError as e:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                cap_message(f"start_revision: compacted ({e}); list again and watch from its revision"))
        except aetcd.ClientError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, cap_message(f"etcd: {e}"))


async def until_set(event: asyncio.Event, events):
    """The items of the async iterator ``events`` until ``event`` is set: then it stops at
    once, even while waiting for the next item (which is cancelled), and closes
    ``events`` (also when the consumer stops or is cancelled)."""
    it = aiter(events)
    stop = asyncio.ensure_future(event.wait())
    nxt = None
    try:
        while not event.is_set():
            nxt = asyncio.ensure_future(anext(it))
            await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                return  # stopped while waiting: the finally cancels the pending item
            try:
                item = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield item
    finally:
        stop.cancel()
        if nxt is not None and not nxt.done():
            nxt.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await nxt
        if hasattr(it, "aclose"):
            await it.aclose()


async def watch_jobs(ctl: Controller, request):
    """Yield JobEvents for matching jobs: a snapshot first when start_revision is 0,
    then every change after the start revision, in revision order.

    A ``job_id`` naming a peft task (``<job id>/<task>``) watches its job and yields the
    task's view (``tasks.view``, as GetJob returns it) for every change of the job, and
    DELETED with the task's id when the job is removed; like a job's watch, the stream
    goes on until the client ends it."""
    parent_id, task = peft_tasks.split_id(request.job_id)
    if task is not None:
        async for ev in watch_jobs(ctl, type(request)(tenant=request.tenant, job_id=parent_id,
                                                      start_revision=request.start_revision)):
            if ev.type == controller_pb2.JobEvent.DELETED:
                ev.job.id = request.job_id
                yield ev
                continue
            tv = peft_tasks.view(ev.job, task)
            if tv is not None:
                yield controller_pb2.JobEvent(type=ev.type, job=tv, revision=ev.revision)
        return
    store = ctl.store

    def match(j: types_pb2.Job) -> bool:
        return (not request.tenant or j.spec.tenant == request.tenant) and (not request.job_id or j.id == request.job_id)

    start = request.start_revision
    if start == 0:
        jobs, rev = await store.list_jobs()
        for j in sorted(jobs, key=lambda j: (j.created, j.id)):
            if match(j):
                yield controller_pb2.JobEvent(type=controller_pb2.JobEvent.SNAPSHOT, job=j, revision=rev)
        start = rev
    prefix = store.k("jobs") + b"/"
    # A deletion (retention removing a finished job) carries no value: a tenant's watch of
    # all its jobs asks etcd for the previous value too, to tell whose job it was.
    by_tenant = bool(request.tenant) and not request.job_id
    watch = await store.c.watch_prefix(prefix, start_revision=start + 1, prev_kv=by_tenant)
    try:
        async for ev in watch:
            rev = ev.kv.mod_revision
            if ev.kind == aetcd.EventKind.DELETE:
                job = types_pb2.Job(id=ev.kv.key[len(prefix):].decode())
                if by_tenant:
                    if ev.prev_kv is None or types_pb2.Job.FromString(ev.prev_kv.value).spec.tenant != request.tenant:
                        continue
                    job.spec.tenant = request.tenant
                if not request.job_id or job.id == request.job_id:
                    yield controller_pb2.JobEvent(type=controller_pb2.JobEvent.DELETED, job=job, revision=rev)
                continue
            job = types_pb2.Job.FromString(ev.kv.value)
            job.revision = rev
            if match(job):
                yield controller_pb2.JobEvent(type=controller_pb2.JobEvent.UPDATED, job=job, revision=rev)
    finally:
        await watch.cancel()


class NodeService(controller_pb2_grpc.NodeServiceServicer):
    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl

    @rpc
    async def RegisterNode(self, request, context):
        check_id("name", request.name, required=False)  # the rest is checked by Controller.register
        node = await self.ctl.register(request)
        return controller_pb2.RegisterNodeResponse(
            incarnation=node.incarnation,
            heartbeat_interval_s=self.ctl.cfg.heartbeat_interval_s,
            grace_s=self.ctl.cfg.grace_s,
        )

    @rpc
    async def Heartbeat(self, request, context):
        check_id("name", request.name)
        stop = await self.ctl.heartbeat(request)
        return controller_pb2.HeartbeatResponse(stop_allocations=stop)

    @rpc
    async def ListNodes(self, request, context):
        return controller_pb2.ListNodesResponse(nodes=await self.ctl.list_nodes())

    @rpc
    async def ReportExecutor(self, request, context):
        check_id("job_id", request.job_id)
        check_id("allocation_id", request.allocation_id)
        check_id("task", request.task, required=False)
        for name in ("step_time_s", "step_time_median_s"):  # a NaN loss is a real outcome: kept
            v = getattr(request, name)
            if not (math.isfinite(v) and v >= 0):
                raise SpecError(name, f"must be a finite number >= 0 seconds, got {v}")
        stale = await self.ctl.report(request)
        return controller_pb2.ReportExecutorResponse(stale=stale)
