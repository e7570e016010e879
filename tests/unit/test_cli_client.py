"""tessera.client without servers: address resolution, error mapping, local validation,
pagination and watch resumption (fake stubs)."""

from __future__ import annotations

import json

import grpc
import pytest

from tessera import client as tc
from tessera.api.v1 import controller_pb2, types_pb2
from tessera.errors import SpecError
from tessera.wire import WATCH_OPEN_METADATA_KEY

DOC = {"apiVersion": "tessera/v1", "kind": "Job", "name": "c-job", "workload": {"type": "gpt", "steps": 5},
       "resources": {"devices": 1}}


class RpcErr(grpc.RpcError):
    def __init__(self, code, details=""):
        self._c, self._d = code, details

    def code(self):
        return self._c

    def details(self):
        return self._d


class Stream:
    """A fake server stream: yields events, then optionally raises."""

    def __init__(self, events, error=None):
        self.events, self.error, self.cancelled = events, error, False

    def __iter__(self):
        yield from self.events
        if self.error:
            raise self.error

    def cancel(self):
        self.cancelled = True


def ev(jid, rev, phase=types_pb2.RUNNING):
    return controller_pb2.JobEvent(type=controller_pb2.JobEvent.UPDATED, revision=rev,
                                   job=types_pb2.Job(id=jid, status=types_pb2.JobStatus(phase=phase)))


class FakeJobs:
    def __init__(self):
        self.requests: list = []
        self.submit_errors: list = []
        self.streams: list[Stream] = []
        self.pages = {"": (["a", "b"], "t1"), "t1": (["c"], "")}

    def SubmitJob(self, req, timeout=None):
        self.requests.append(("submit", req))
        if self.submit_errors:
            raise self.submit_errors.pop(0)
        return controller_pb2.SubmitJobResponse(job=types_pb2.Job(id="j-1", spec=req.spec), created=True)

    def ListJobs(self, req, timeout=None):
        self.requests.append(("list", req))
        ids, nxt = self.pages[req.page_token]
        return controller_pb2.ListJobsResponse(jobs=[types_pb2.Job(id=i) for i in ids], next_page_token=nxt, revision=42)

    def GetJob(self, req, timeout=None):
        raise RpcErr(grpc.StatusCode.NOT_FOUND, f"job {req.job_id} not found")

    def WatchJobs(self, req, timeout=None):
        self.requests.append(("watch", req))
        return self.streams.pop(0)


@pytest.fixture
def c(monkeypatch):
    monkeypatch.setattr(tc.time, "sleep", lambda s: None)  # no real backoff in unit tests
    cl = tc.Client("127.0.0.1:1")
    cl.jobs = FakeJobs()
    yield cl
    cl.close()


def test_resolve_address_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TESSERA_CONTROLLER", raising=False)
    with pytest.raises(tc.TesseraError) as ei:
        tc.resolve_address()
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION and "tessera up" in ei.value.message
    (tmp_path / ".tessera").mkdir()
    (tmp_path / ".tessera" / "testbed.json").write_text(json.dumps({"controller": "file:1"}))
    assert tc.resolve_address() == "file:1"
    monkeypatch.setenv("TESSERA_CONTROLLER", "env:2")
    assert tc.resolve_address() == "env:2"
    assert tc.resolve_address("arg:3") == "arg:3"


def test_submit_validates_locally_and_sends_nothing_when_invalid(c):
    bad = dict(DOC, workload={"type": "gpt", "steps": 0})
    with pytest.raises(SpecError) as ei:
        c.submit(bad)
    assert ei.value.field == "workload.steps"
    assert c.jobs.requests == []


def test_submit_auto_key_and_retry_keeps_key(c):
    c.jobs.submit_errors = [RpcErr(grpc.StatusCode.UNAVAILABLE, "not leader")]
    job = c.submit(DOC)
    assert job.id == "j-1"
    (_, r1), (_, r2) = c.jobs.requests
    assert r1.idempotency_key and r1.idempotency_key == r2.idempotency_key
    assert r1.spec.workload.batch_size == 8  # defaults filled before sending
    c.submit(DOC, idempotency_key="k")
    assert c.jobs.requests[-1][1].idempotency_key == "k"


def test_errors_carry_status_code(c):
    c.jobs.submit_errors = [RpcErr(grpc.StatusCode.ALREADY_EXISTS, "key reused")]
    with pytest.raises(tc.TesseraError) as ei:
        c.submit(DOC, idempotency_key="k")
    assert ei.value.code == grpc.StatusCode.ALREADY_EXISTS and ei.value.message == "key reused"
    with pytest.raises(tc.TesseraError) as ei:
        c.get("j-x")
    assert ei.value.code == grpc.StatusCode.NOT_FOUND and "ALREADY" not in str(ei.value)


def test_list_follows_pages(c):
    jobs = c.list(tenant="t", phases=["running"])
    assert [j.id for j in jobs] == ["a", "b", "c"]
    reqs = [r for k, r in c.jobs.requests if k == "list"]
    assert [r.page_token for r in reqs] == ["", "t1"]
    assert list(reqs[0].phases) == [types_pb2.RUNNING] and reqs[0].tenant == "t"


def test_watch_resumes_after_unavailable_from_last_revision(c):
    c.jobs.streams = [Stream([ev("j", 5), ev("j", 7)], RpcErr(grpc.StatusCode.UNAVAILABLE)),
                      Stream([ev("j", 9, types_pb2.SUCCEEDED)])]
    got = [e.revision for e in c.watch(job_id="j")]
    assert got == [5, 7, 9]
    starts = [r.start_revision for k, r in c.jobs.requests if k == "watch"]
    assert starts == [0, 7]


def test_watch_relists_when_compacted(c):
    c.jobs.pages = {"": (["j", "other"], "")}
    c.jobs.streams = [Stream([], RpcErr(grpc.StatusCode.OUT_OF_RANGE, "compacted")), Stream([ev("j", 50)])]
    got = list(c.watch(job_id="j", start_revision=3))
    assert [(e.type, e.job.id) for e in got] == [(controller_pb2.JobEvent.SNAPSHOT, "j"), (controller_pb2.JobEvent.UPDATED, "j")]
    starts = [r.start_revision for k, r in c.jobs.requests if k == "watch"]
    assert starts == [3, 42]


def test_watch_other_errors_raise(c):
    c.jobs.streams = [Stream([], RpcErr(grpc.StatusCode.PERMISSION_DENIED, "tenant"))]
    with pytest.raises(tc.TesseraError) as ei:
        list(c.watch())
    assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_wait_returns_terminal_job(c):
    c.jobs.streams = [Stream([ev("other", 1), ev("j", 2), ev("j", 3, types_pb2.CANCELLED), ev("j", 4)])]
    seen = []
    job = c.wait("j", on_event=lambda j: seen.append(j.status.phase))
    assert job.status.phase == types_pb2.CANCELLED
    assert seen == [types_pb2.RUNNING, types_pb2.CANCELLED]


def test_phase_helpers():
    assert tc.phase_name(types_pb2.SUCCEEDED) == "SUCCEEDED"
    assert tc.parse_phase("pending") == types_pb2.PENDING
    with pytest.raises(ValueError, match="one of"):
        tc.parse_phase("nope")


# --- AsyncClient ---------------------------------------------------------------------------

class AioRpcErr(grpc.aio.AioRpcError):
    def __init__(self, code, details=""):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class AStream:
    def __init__(self, events, error=None):
        self.events, self.error = events, error

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for e in self.events:
            yield e
        if self.error:
            raise self.error

    def cancel(self):
        pass


class AFakeJobs:
    def __init__(self):
        self.requests: list = []
        self.streams: list = []
        self.submit_errors: list = []

    async def SubmitJob(self, req, timeout=None):
        self.requests.append(("submit", req))
        if self.submit_errors:
            raise self.submit_errors.pop(0)
        return controller_pb2.SubmitJobResponse(job=types_pb2.Job(id="j-a"))

    async def GetJob(self, req, timeout=None):
        raise AioRpcErr(grpc.StatusCode.NOT_FOUND, "nope")

    def WatchJobs(self, req, timeout=None):
        self.requests.append(("watch", req))
        return self.streams.pop(0)


@pytest.fixture
async def ac(monkeypatch):
    async def no_sleep(s):
        return None

    monkeypatch.setattr(tc.asyncio, "sleep", no_sleep)
    cl = tc.AsyncClient("127.0.0.1:1")
    cl.jobs = AFakeJobs()
    yield cl
    await cl.close()


async def test_async_submit_retry_same_key_and_errors(ac):
    ac.jobs.submit_errors = [AioRpcErr(grpc.StatusCode.UNAVAILABLE, "x")]
    job = await ac.submit(DOC)
    assert job.id == "j-a"
    (_, r1), (_, r2) = ac.jobs.requests
    assert r1.idempotency_key == r2.idempotency_key != ""
    with pytest.raises(tc.TesseraError) as ei:
        await ac.get("j-x")
    assert ei.value.code == grpc.StatusCode.NOT_FOUND


async def test_async_watch_resumes_and_wait(ac):
    ac.jobs.streams = [AStream([ev("j", 4)], AioRpcErr(grpc.StatusCode.UNAVAILABLE)),
                       AStream([ev("j", 6, types_pb2.SUCCEEDED)])]
    job = await ac.wait("j")
    assert job.status.phase == types_pb2.SUCCEEDED
    assert [r.start_revision for k, r in ac.jobs.requests if k == "watch"] == [0, 4]


class FakeTime:
    """A clock for watch's give-up and backoff: ``sleep`` advances ``monotonic``."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def sleep(self, s):
        self.now += s


def test_watch_timeout_names_the_job_its_last_phase_and_the_limit(c):
    c.jobs.streams = [Stream([ev("j", 5, types_pb2.PENDING)], RpcErr(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))]
    with pytest.raises(tc.TesseraError) as ei:
        list(c.watch(job_id="j", timeout=2))
    e = ei.value
    assert e.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "job j did not finish within 2s" in e.message and "PENDING" in e.message
    assert "keeps running" in e.message and "Deadline Exceeded" not in e.message


def test_watch_gives_up_once_the_controller_stays_unreachable(c, monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(tc, "time", clock)
    c.jobs.streams = [Stream([ev("j", 5)], RpcErr(grpc.StatusCode.UNAVAILABLE, "Connection refused"))] + [
        Stream([], RpcErr(grpc.StatusCode.UNAVAILABLE, "Connection refused")) for _ in range(100)]
    notes = []
    with pytest.raises(tc.TesseraError) as ei:
        list(c.watch(job_id="j", on_retry=notes.append))
    e = ei.value
    assert e.code == grpc.StatusCode.UNAVAILABLE
    assert "controller 127.0.0.1:1 unreachable" in e.message and "job j" in e.message
    assert len(notes) == 1 and "127.0.0.1:1 unreachable, retrying" in notes[0]  # once, not per attempt
    assert tc.WATCH_GIVE_UP_S <= clock.now - 1000.0 < tc.WATCH_GIVE_UP_S + 3


def test_watch_unreachable_count_restarts_after_an_event(c, monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(tc, "time", clock)
    down = RpcErr(grpc.StatusCode.UNAVAILABLE, "leader moved")
    c.jobs.streams = [Stream([], down) for _ in range(12)] + [Stream([ev("j", 7)], down)] + [
        Stream([], down) for _ in range(12)] + [Stream([ev("j", 9, types_pb2.SUCCEEDED)])]
    notes = []
    got = [e.revision for e in c.watch(job_id="j", on_retry=notes.append)]
    assert got == [7, 9] and len(notes) == 2  # two outages, each shorter than the give-up


class QuietStream(Stream):
    """A stream that stays open ``open_s`` seconds of ``clock`` without an event, then fails;
    ``metadata``: what its ``initial_metadata()`` returns (None: the method is absent)."""

    def __init__(self, clock, open_s, error, metadata=None):
        super().__init__([], error)
        self.clock, self.open_s, self.metadata = clock, open_s, metadata
        if metadata is not None:
            self.initial_metadata = lambda: self.metadata

    def __iter__(self):
        self.clock.now += self.open_s
        raise self.error


@pytest.mark.parametrize("open_s, metadata", [(100, None), (10, ((WATCH_OPEN_METADATA_KEY, "1"),))])
def test_watch_outage_clock_restarts_when_a_call_connected_without_an_event(c, monkeypatch, open_s, metadata):
    """Lost, reconnected (quiet: no event, but the call was open: its open metadata came, or
    it stayed open longer than a connection attempt can take), lost again more than
    WATCH_GIVE_UP_S after the first loss: a new outage, not a give-up."""
    clock = FakeTime()
    monkeypatch.setattr(tc, "time", clock)
    down = RpcErr(grpc.StatusCode.UNAVAILABLE, "leader moved")
    assert open_s + 25 > tc.WATCH_GIVE_UP_S
    c.jobs.streams = [QuietStream(clock, 25, down), QuietStream(clock, open_s, down, metadata),
                      Stream([], down), Stream([ev("j", 9, types_pb2.SUCCEEDED)])]
    notes = []
    got = [e.revision for e in c.watch(job_id="j", on_retry=notes.append)]
    assert got == [9] and len(notes) == 2


async def test_async_watch_outage_clock_restarts_on_open_metadata(ac, monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(tc, "time", clock)
    down = AioRpcErr(grpc.StatusCode.UNAVAILABLE, "leader moved")

    class AQuiet(AStream):
        def __init__(self, open_s, metadata=None):
            super().__init__([], down)
            self.open_s = open_s
            if metadata is not None:
                async def md():
                    return metadata
                self.initial_metadata = md

        async def _gen(self):
            clock.now += self.open_s
            raise self.error
            yield  # an async generator

    ac.jobs.streams = [AQuiet(25), AQuiet(10, grpc.aio.Metadata((WATCH_OPEN_METADATA_KEY, "1"))),
                       AStream([], down), AStream([ev("j", 9, types_pb2.SUCCEEDED)])]
    notes = []
    got = [e.revision async for e in ac.watch(job_id="j", on_retry=notes.append)]
    assert got == [9] and len(notes) == 2


def test_watch_without_a_connection_still_gives_up(c, monkeypatch):
    """Calls that fail without connecting (no open metadata, short) keep the outage clock."""
    clock = FakeTime()
    monkeypatch.setattr(tc, "time", clock)
    down = RpcErr(grpc.StatusCode.UNAVAILABLE, "refused")
    c.jobs.streams = [QuietStream(clock, 10, down, ()) for _ in range(10)]
    with pytest.raises(tc.TesseraError) as ei:
        list(c.watch(job_id="j"))
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE


def test_unavailable_from_a_stale_testbed_file_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TESSERA_CONTROLLER", raising=False)
    (tmp_path / ".tessera").mkdir()
    (tmp_path / ".tessera" / "testbed.json").write_text(json.dumps(
        {"marker": "gone", "controller": "127.0.0.1:1", "processes": []}))
    with tc.Client() as cl:
        with pytest.raises(tc.TesseraError) as ei:
            cl.logs("j-1")
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    assert "address from .tessera/testbed.json; the testbed there is not running" in ei.value.message
    assert "`tessera down`" in ei.value.message
    monkeypatch.setenv("TESSERA_CONTROLLER", "127.0.0.1:1")
    with tc.Client() as cl:
        with pytest.raises(tc.TesseraError) as ei:
            cl.logs("j-1")
    assert "TESSERA_CONTROLLER" in ei.value.message
    with tc.Client("127.0.0.1:1") as cl:  # given explicitly: the plain error
        with pytest.raises(tc.TesseraError) as ei:
            cl.logs("j-1")
    assert "address from" not in ei.value.message


def test_watch_gives_up_on_a_peer_that_accepts_but_never_answers(c, monkeypatch):
    """Each call to a peer that accepts TCP but never answers HTTP/2 fails at gRPC's 20 s
    connect timeout: that is not a connected call, so the outage clock is not restarted
    and the watch gives up within WATCH_GIVE_UP_S of the first failure."""
    clock = FakeTime()
    monkeypatch.setattr(tc, "time", clock)
    down = RpcErr(grpc.StatusCode.UNAVAILABLE, "failed to connect: timeout")
    c.jobs.streams = [QuietStream(clock, 20.0, down) for _ in range(50)]
    with pytest.raises(tc.TesseraError) as ei:
        list(c.watch(job_id="j"))
    assert ei.value.code == grpc.StatusCode.UNAVAILABLE
    assert clock.now - 1000.0 < 20.0 + tc.WATCH_GIVE_UP_S + 20.0 + 3  # first failure + give-up + one last attempt
