"""Python client of the Tessera controller: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

The CLI is built on this module; programs that submit jobs without the CLI use it too::

    from tessera.client import Client

    with Client() as c:                      # address: arg > $TESSERA_CONTROLLER > .tessera/testbed.json
        job = c.submit("examples/gpt-small.yaml")   # path, manifest dict or JobSpec
        job = c.wait(job.id, timeout=300)          # follows WatchJobs until a terminal phase
        print(c.phase_name(job.status.phase), job.status.loss)

Contracts:

- Every failed call raises ``TesseraError`` carrying the gRPC status ``code`` and the
  server's ``message`` (INVALID_ARGUMENT names the field at fault).
- A manifest is validated locally first (``tessera.manifest.validate``): an invalid one
  raises ``SpecError`` and nothing is sent.
- ``submit`` uses an idempotency key (a fresh uuid4 unless given) and retries UNAVAILABLE
  with the same key, so a retried submission never creates a second job.
- ``watch`` yields ``JobEvent``s; it resumes after the last revision it yielded when the
  stream breaks with UNAVAILABLE, and re-lists (as SNAPSHOT events) when that revision
  was compacted (OUT_OF_RANGE). It gives up when the controller stays unreachable for
  ``WATCH_GIVE_UP_S`` seconds in a row (``TesseraError(UNAVAILABLE)`` naming it), and at
  its ``timeout`` raises ``TesseraError(DEADLINE_EXCEEDED)`` naming the job, its last
  known phase and the limit (the job itself keeps running).
- An UNAVAILABLE error says where the address came from when it was not passed
  explicitly (``TESSERA_CONTROLLER``, or a testbed.json whose testbed is not running).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import grpc

from . import manifest
from . import wire
from .wire import WATCH_OPEN_METADATA_KEY
from .api.v1 import controller_pb2, controller_pb2_grpc, types_pb2

__all__ = [
    "AsyncClient", "Client", "NoControllerAddress", "TesseraError", "TERMINAL_PHASES", "phase_name", "parse_phase",
    "resolve_address", "TESTBED_FILE", "WATCH_GIVE_UP_S",
]

TESTBED_FILE = Path(".tessera") / "testbed.json"
TERMINAL_PHASES = frozenset({types_pb2.SUCCEEDED, types_pb2.FAILED, types_pb2.CANCELLED})
DEFAULT_TIMEOUT_S = 10.0
_RETRY_CODES = (grpc.StatusCode.UNAVAILABLE,)
# A watch whose controller stays unreachable this many seconds in a row gives up (UNAVAILABLE).
WATCH_GIVE_UP_S = 30.0
# A watch call that stayed open this long before failing had connected (a controller
# too old to send WATCH_OPEN_METADATA_KEY): without wait_for_ready a call fails as soon
# as its connection attempt does, and gRPC's connect timeout is 20 s — a peer that
# accepts TCP but never answers HTTP/2 fails a call at exactly 20 s, which must not count
# as connected (it would restart the outage clock and stretch WATCH_GIVE_UP_S), hence the
# margin above it.
_WATCH_CONNECTED_AFTER_S = 30.0
# Replies up to GetJobLogs' largest tail (4 MiB per node, several nodes) fit.
MESSAGE_OPTIONS = wire.LARGE_MESSAGES


class TesseraError(Exception):
    """A failed call: ``code`` is a ``grpc.StatusCode``, ``message`` the server's details."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> "TesseraError":
        code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
        details = e.details() if callable(getattr(e, "details", None)) else str(e)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


def phase_name(phase: int) -> str:
    """``types_pb2.RUNNING`` -> ``"RUNNING"``."""
    return types_pb2.JobPhase.Name(phase)


def parse_phase(name: str) -> int:
    """``"running"`` (any case) -> ``types_pb2.RUNNING``; ``ValueError`` listing the phases,
    also for ``JOB_PHASE_UNSPECIFIED`` (value 0: no phase, which no job has)."""
    try:
        value = types_pb2.JobPhase.Value(name.upper())
    except ValueError:
        value = 0
    if value == 0:
        names = [n for n in types_pb2.JobPhase.keys() if n != "JOB_PHASE_UNSPECIFIED"]
        raise ValueError(f"unknown phase {name!r} (one of {', '.join(names)})")
    return value


def _error(e: grpc.RpcError, source: str) -> TesseraError:
    err = TesseraError.from_rpc(e)
    if err.code == grpc.StatusCode.UNAVAILABLE:
        hint = _source_hint(source)
        if hint:
            err = TesseraError(err.code, err.message + hint)
    return err


class NoControllerAddress(TesseraError):
    """No controller address anywhere (flag, env, testbed file): a usage error of the
    client, raised before any server is contacted (the CLI exits 2)."""


def resolve_address(address: str | None = None, testbed_dir: str | Path | None = None) -> str:
    """Controller address: ``address`` if given, else env TESSERA_CONTROLLER, else the
    ``controller`` entry of ``<testbed_dir or .tessera>/testbed.json``. ``TesseraError``
    (FAILED_PRECONDITION) explaining the three options when none is found."""
    return resolve_address_source(address, testbed_dir)[0]


def resolve_address_source(address: str | None = None, testbed_dir: str | Path | None = None) -> tuple[str, str]:
    """``resolve_address`` and where the address came from: ``""`` (given), ``"env"``
    (TESSERA_CONTROLLER) or the path of the testbed.json it was read from."""
    if address:
        return address, ""
    env = os.environ.get("TESSERA_CONTROLLER")
    if env:
        return env, "env"
    path = Path(testbed_dir) / "testbed.json" if testbed_dir else TESTBED_FILE
    try:
        addr = json.loads(path.read_text()).get("controller")
        if addr:
            return str(addr), str(path)
    except (OSError, AttributeError, ValueError):
        pass
    raise NoControllerAddress(
        grpc.StatusCode.FAILED_PRECONDITION,
        f"no controller address: pass --controller HOST:PORT, set TESSERA_CONTROLLER, or start a "
        f"local testbed with `tessera up` (writes {path})",
    )


def _source_hint(source: str) -> str:
    """Why an unreachable address was dialled: where it came from, and for a testbed.json
    whether the testbed recorded there is running at all."""
    if source == "env":
        return " (address from the environment variable TESSERA_CONTROLLER)"
    if not source:
        return ""
    from .testbed import Testbed

    tb = Testbed(Path(source).parent)
    down = "tessera down" + ("" if Path(source) == TESTBED_FILE else f" --dir {Path(source).parent}")
    if tb.running():
        return f" (address from {source}; its testbed's controller does not answer: see {tb.logs / 'controller.log'})"
    return f" (address from {source}; the testbed there is not running — `tessera up`, or `{down}` to clear it)"


def to_spec(spec: Any) -> types_pb2.JobSpec:
    """A JobSpec, a manifest dict, or a path to a YAML manifest -> validated ``JobSpec``.
    Raises ``SpecError`` (field and message) for an invalid manifest."""
    if isinstance(spec, types_pb2.JobSpec):
        return manifest.to_proto(manifest.validate(manifest.from_proto(spec)))
    if isinstance(spec, (str, Path)):
        return manifest.to_proto(manifest.load_file(spec))
    return manifest.to_proto(manifest.validate(spec))


def _list_request(tenant: str, phases: Any, page_size: int, token: str,
                  include_tasks: bool = False) -> controller_pb2.ListJobsRequest:
    ph = [parse_phase(p) if isinstance(p, str) else int(p) for p in (phases or [])]
    return controller_pb2.ListJobsRequest(tenant=tenant or "", phases=ph, page_size=page_size, page_token=token,
                                          include_tasks=include_tasks)


class _WatchState:
    """Bookkeeping of one ``watch``: the overall deadline, the last phase seen of each job,
    and how long the controller has been unreachable. The outage clock (``lost_since``)
    runs from the first of a run of consecutive failed calls: it is reset whenever a call
    connects (``connected``: its initial metadata or an event arrived, or it stayed open
    longer than a connection attempt can take), so a watch that reconnected and stayed
    quiet does not inherit the previous outage."""

    def __init__(self, address: str, source: str, job_id: str, timeout: float | None,
                 on_retry: Callable[[str], None] | None) -> None:
        self.address, self.source, self.job_id, self.timeout = address, source, job_id, timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.on_retry = on_retry
        self.phases: dict[str, int] = {}
        self.lost_since: float | None = None
        self.delay = 0.2
        self.attempt_at = time.monotonic()

    def attempt(self) -> None:
        """A new WatchJobs call is being made."""
        self.attempt_at = time.monotonic()

    def connected(self) -> None:
        """The current call reached the controller: the outage, if any, is over."""
        self.lost_since, self.delay = None, 0.2

    def opened(self, metadata: Any) -> None:
        """The current call's initial metadata: ``connected`` when the controller sent its
        watch-open key."""
        if any(getattr(m, "key", m[0] if isinstance(m, tuple) else None) == WATCH_OPEN_METADATA_KEY
               for m in (metadata or ())):
            self.connected()

    def remaining(self) -> float | None:
        """Seconds left before the deadline (None: no deadline); raises at the deadline."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timed_out()
        return left

    def seen(self, ev: controller_pb2.JobEvent) -> None:
        self.phases[ev.job.id] = ev.job.status.phase
        self.connected()

    def lost(self, e: grpc.RpcError) -> float:
        """The stream broke with UNAVAILABLE: note it once, give up after WATCH_GIVE_UP_S
        seconds unreachable, else return the backoff before the next attempt."""
        now = time.monotonic()
        if now - self.attempt_at >= _WATCH_CONNECTED_AFTER_S:
            self.connected()  # this call had connected: a new outage starts now
        if self.lost_since is None:
            self.lost_since = now
            if self.on_retry is not None:
                self.on_retry(f"controller {self.address} unreachable, retrying for up to {WATCH_GIVE_UP_S:.0f}s…")
        elif now - self.lost_since >= WATCH_GIVE_UP_S:
            what = f"job {self.job_id}" if self.job_id else "the jobs"
            detail = e.details() if callable(getattr(e, "details", None)) else ""
            raise TesseraError(grpc.StatusCode.UNAVAILABLE,
                               f"controller {self.address} unreachable for {now - self.lost_since:.0f}s while following "
                               f"{what}; gave up{f' ({detail})' if detail else ''}" + _source_hint(self.source)
                               + (f"; the job may still be running: `tessera get {self.job_id}` once the controller "
                                  "is back" if self.job_id else ""))
        delay = self.delay
        self.delay = min(self.delay * 2, 2.0)
        if self.deadline is not None:
            delay = min(delay, max(0.0, self.deadline - now))
        return delay

    def timed_out(self) -> TesseraError:
        if self.job_id:
            ph = self.phases.get(self.job_id)
            what = (f"job {self.job_id} did not finish within {self.timeout:g}s (last known phase "
                    f"{phase_name(ph) if ph is not None else 'unknown'})")
        else:
            last = ", ".join(f"{j} {phase_name(p)}" for j, p in self.phases.items()) or "none seen"
            what = f"the jobs did not finish within {self.timeout:g}s (last known phases: {last})"
        return TesseraError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}; the job keeps running, this only stopped "
                                                                "following it")


class Client:
    """Blocking client. ``address`` resolved by ``resolve_address``; ``timeout`` is the
    deadline of each unary call in seconds. Use as a context manager or call ``close()``."""

    def __init__(self, address: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 channel: grpc.Channel | None = None) -> None:
        self.address, self.address_source = resolve_address_source(address) if channel is None else (address or "", "")
        self.timeout = timeout
        self._channel = channel or grpc.insecure_channel(self.address, options=MESSAGE_OPTIONS)
        self.jobs = controller_pb2_grpc.JobServiceStub(self._channel)
        self.nodes_stub = controller_pb2_grpc.NodeServiceStub(self._channel)

    phase_name = staticmethod(phase_name)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable, req: Any, retries: int = 0, timeout: float | None = None) -> Any:
        delay = 0.2
        for attempt in range(retries + 1):
            try:
                return fn(req, timeout=timeout or self.timeout)
            except grpc.RpcError as e:
                if attempt < retries and e.code() in _RETRY_CODES:
                    time.sleep(delay)  # backoff between retries of an idempotent call
                    delay = min(delay * 2, 2.0)
                    continue
                raise _error(e, self.address_source) from None

    def submit(self, spec: Any, idempotency_key: str | None = None, retries: int = 3) -> types_pb2.Job:
        """Validate ``spec`` locally and submit it; returns the persisted Job (PENDING, or
        the earlier job when the key was already used with the same spec)."""
        req = controller_pb2.SubmitJobRequest(spec=to_spec(spec), idempotency_key=idempotency_key or str(uuid.uuid4()))
        return self._call(self.jobs.SubmitJob, req, retries=retries).job

    def get(self, job_id: str) -> types_pb2.Job:
        """The job ``job_id``; ``TesseraError(NOT_FOUND)`` if unknown."""
        return self._call(self.jobs.GetJob, controller_pb2.GetJobRequest(job_id=job_id), retries=2)

    def list(self, tenant: str = "", phases: Any = None, page_size: int = 100,
             include_tasks: bool = False) -> list[types_pb2.Job]:
        """Every matching job, oldest first; follows pagination to the end. With
        ``include_tasks`` each peft job's tasks follow it as jobs ``<job id>/<task>``."""
        return self.list_with_revision(tenant, phases, page_size, include_tasks)[0]

    def list_with_revision(self, tenant: str = "", phases: Any = None, page_size: int = 100,
                           include_tasks: bool = False) -> tuple[list[types_pb2.Job], int]:
        """Like ``list``, also returning the etcd revision of the first page's read."""
        out: list[types_pb2.Job] = []
        token, revision = "", 0
        while True:
            resp = self._call(self.jobs.ListJobs, _list_request(tenant, phases, page_size, token, include_tasks), retries=2)
            out.extend(resp.jobs)
            revision = revision or resp.revision
            token = resp.next_page_token
            if not token:
                return out, revision

    def cancel(self, job_id: str, reason: str = "") -> types_pb2.Job:
        """Cancel a job; a no-op when already CANCELLED, FAILED_PRECONDITION when finished."""
        return self._call(self.jobs.CancelJob, controller_pb2.CancelJobRequest(job_id=job_id, reason=reason), retries=2)

    def nodes(self) -> list[types_pb2.Node]:
        """Every registered node with its devices and state."""
        return list(self._call(self.nodes_stub.ListNodes, controller_pb2.ListNodesRequest(), retries=2).nodes)

    def logs(self, job_id: str, tail_bytes: int = 0) -> controller_pb2.GetJobLogsResponse:
        """The tail of a job's executor logs (``text``, ``truncated``)."""
        return self._call(self.jobs.GetJobLogs, controller_pb2.GetJobLogsRequest(job_id=job_id, tail_bytes=tail_bytes),
                          timeout=max(self.timeout, 30))

    def watch(self, job_id: str = "", tenant: str = "", start_revision: int = 0,
              timeout: float | None = None, reconnect: bool = True,
              on_retry: Callable[[str], None] | None = None) -> Iterator[controller_pb2.JobEvent]:
        """Yield job events (SNAPSHOT first when ``start_revision`` is 0). Reconnects on
        UNAVAILABLE from the last revision yielded; re-lists when it was compacted.
        ``on_retry(note)`` is called once each time the stream is lost and being retried
        (not on every attempt); after ``WATCH_GIVE_UP_S`` seconds without reaching the
        controller ``TesseraError(UNAVAILABLE)`` naming it. ``timeout``: overall deadline
        in seconds, then ``TesseraError(DEADLINE_EXCEEDED)`` naming the job(s), the last
        known phase and the limit; the job keeps running."""
        state = _WatchState(self.address, self.address_source, job_id, timeout, on_retry)
        rev = start_revision
        while True:
            remaining = state.remaining()
            state.attempt()
            call = self.jobs.WatchJobs(controller_pb2.WatchJobsRequest(tenant=tenant, job_id=job_id, start_revision=rev),
                                       timeout=remaining)
            try:
                if callable(getattr(call, "initial_metadata", None)):
                    # Blocks until the controller accepts the watch (or the call ends).
                    state.opened(call.initial_metadata())
                for ev in call:
                    rev = max(rev, ev.revision)
                    state.seen(ev)
                    yield ev
                return  # the server ended the stream
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.OUT_OF_RANGE and reconnect:
                    jobs, rev = self.list_with_revision(tenant)
                    for j in jobs:
                        if not job_id or j.id == job_id:
                            ev = controller_pb2.JobEvent(type=controller_pb2.JobEvent.SNAPSHOT, job=j, revision=rev)
                            state.seen(ev)
                            yield ev
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and state.deadline is not None:
                    raise state.timed_out() from None
                if code in _RETRY_CODES and reconnect:
                    time.sleep(state.lost(e))  # backoff before reconnecting
                    continue
                raise _error(e, self.address_source) from None
            finally:
                call.cancel()

    def wait(self, job_id: str, timeout: float | None = None,
             on_event: Callable[[types_pb2.Job], None] | None = None) -> types_pb2.Job:
        """Follow ``job_id`` until SUCCEEDED, FAILED or CANCELLED and return the final Job;
        ``on_event(job)`` is called on every change. ``TesseraError(DEADLINE_EXCEEDED)`` on timeout."""
        for ev in self.watch(job_id=job_id, timeout=timeout):
            if ev.job.id != job_id:
                continue
            if on_event is not None:
                on_event(ev.job)
            if ev.job.status.phase in TERMINAL_PHASES:
                return ev.job
        # The stream ended without a terminal phase (server shutdown): read it directly.
        return self.get(job_id)


class AsyncClient:
    """asyncio client with the same methods as ``Client`` (coroutines; ``watch`` is an
    async iterator). Use ``async with AsyncClient() as c`` or ``await c.close()``."""

    def __init__(self, address: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 channel: grpc.aio.Channel | None = None) -> None:
        self.address, self.address_source = resolve_address_source(address) if channel is None else (address or "", "")
        self.timeout = timeout
        self._channel = channel or grpc.aio.insecure_channel(self.address, options=MESSAGE_OPTIONS)
        self.jobs = controller_pb2_grpc.JobServiceStub(self._channel)
        self.nodes_stub = controller_pb2_grpc.NodeServiceStub(self._channel)

    phase_name = staticmethod(phase_name)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, fn: Callable, req: Any, retries: int = 0, timeout: float | None = None) -> Any:
        delay = 0.2
        for attempt in range(retries + 1):
            try:
                return await fn(req, timeout=timeout or self.timeout)
            except grpc.aio.AioRpcError as e:
                if attempt < retries and e.code() in _RETRY_CODES:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                raise _error(e, self.address_source) from None

    async def submit(self, spec: Any, idempotency_key: str | None = None, retries: int = 3) -> types_pb2.Job:
        req = controller_pb2.SubmitJobRequest(spec=to_spec(spec), idempotency_key=idempotency_key or str(uuid.uuid4()))
        return (await self._call(self.jobs.SubmitJob, req, retries=retries)).job

    async def get(self, job_id: str) -> types_pb2.Job:
        return await self._call(self.jobs.GetJob, controller_pb2.GetJobRequest(job_id=job_id), retries=2)

    async def list(self, tenant: str = "", phases: Any = None, page_size: int = 100) -> list[types_pb2.Job]:
        return (await self.list_with_revision(tenant, phases, page_size))[0]

    async def list_with_revision(self, tenant: str = "", phases: Any = None, page_size: int = 100) -> tuple[list[types_pb2.Job], int]:
        out: list[types_pb2.Job] = []
        token, revision = "", 0
        while True:
            resp = await self._call(self.jobs.ListJobs, _list_request(tenant, phases, page_size, token), retries=2)
            out.extend(resp.jobs)
            revision = revision or resp.revision
            token = resp.next_page_token
            if not token:
                return out, revision

    async def cancel(self, job_id: str, reason: str = "") -> types_pb2.Job:
        return await self._call(self.jobs.CancelJob, controller_pb2.CancelJobRequest(job_id=job_id, reason=reason), retries=2)

    async def nodes(self) -> list[types_pb2.Node]:
        return list((await self._call(self.nodes_stub.ListNodes, controller_pb2.ListNodesRequest(), retries=2)).nodes)

    async def logs(self, job_id: str, tail_bytes: int = 0) -> controller_pb2.GetJobLogsResponse:
        return await self._call(self.jobs.GetJobLogs, controller_pb2.GetJobLogsRequest(job_id=job_id, tail_bytes=tail_bytes),
                                timeout=max(self.timeout, 30))

    async def watch(self, job_id: str = "", tenant: str = "", start_revision: int = 0,
                    timeout: float | None = None, reconnect: bool = True,
                    on_retry: Callable[[str], None] | None = None) -> AsyncIterator[controller_pb2.JobEvent]:
        """As ``Client.watch``."""
        state = _WatchState(self.address, self.address_source, job_id, timeout, on_retry)
        rev = start_revision
        while True:
            remaining = state.remaining()
            state.attempt()
            call = self.jobs.WatchJobs(controller_pb2.WatchJobsRequest(tenant=tenant, job_id=job_id, start_revision=rev),
                                       timeout=remaining)
            try:
                if callable(getattr(call, "initial_metadata", None)):
                    try:
                        state.opened(await call.initial_metadata())
                    except grpc.RpcError:
                        pass  # the call failed: iterating it raises the error below
                async for ev in call:
                    rev = max(rev, ev.revision)
                    state.seen(ev)
                    yield ev
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.OUT_OF_RANGE and reconnect:
                    jobs, rev = await self.list_with_revision(tenant)
                    for j in jobs:
                        if not job_id or j.id == job_id:
                            ev = controller_pb2.JobEvent(type=controller_pb2.JobEvent.SNAPSHOT, job=j, revision=rev)
                            state.seen(ev)
                            yield ev
                    continue
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and state.deadline is not None:
                    raise state.timed_out() from None
                if code in _RETRY_CODES and reconnect:
                    await asyncio.sleep(state.lost(e))
                    continue
                raise _error(e, self.address_source) from None
            finally:
                call.cancel()

    async def wait(self, job_id: str, timeout: float | None = None,
                   on_event: Callable[[types_pb2.Job], None] | None = None) -> types_pb2.Job:
        async for ev in self.watch(job_id=job_id, timeout=timeout):
            if ev.job.id != job_id:
                continue
            if on_event is not None:
                on_event(ev.job)
            if ev.job.status.phase in TERMINAL_PHASES:
                return ev.job
        return await self.get(job_id)
