"""profilerd's Streamer: renumbering when its seq state was lost (the estimator holds an
earlier run's seqs) and recovery from an unexpected exception in a session. The stream
runs against a minimal estimator servicer over real loopback gRPC, backed by the real
MeasurementStore in tmp_path."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from estimator.store import MeasurementStore
from profilerd.buffer import SeqBuffer
from profilerd.stream import Streamer
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc, profiler_pb2

SRC = "profilerd/n1"


def dev(v: float = 0.5) -> profiler_pb2.Measurement:
    return profiler_pb2.Measurement(source=SRC, kind="device", values={"cpu_util": v})


def filled(n: int, next_seq: int = 1) -> SeqBuffer:
    b = SeqBuffer(10_000, next_seq)
    for i in range(n):
        b.add(dev(i))
    return b


class _Stub:
    """ReportMeasurements acknowledging up to a given watermark (no server needed)."""

    def __init__(self, wm: int) -> None:
        self.wm, self.calls = wm, 0

    async def ReportMeasurements(self, batches, timeout=None):
        self.calls += 1
        return estimator_pb2.ReportAck(watermark={SRC: self.wm})


def test_first_watermark_from_a_previous_run_renumbers_instead_of_trimming():
    # Seq state lost: this run restarted at 1 and buffered 3000 before connecting; the
    # estimator holds seqs up to 2000 from the previous run.
    buf = filled(3000)
    seen = []
    st = Streamer(buf, SRC, "127.0.0.1:1", on_seq_change=seen.append)
    st._apply_watermark(2000)
    assert len(buf) == 3000 and buf.sent == 0  # nothing taken for sent
    seqs = [m.seq for m in buf.pending()]
    assert seqs[0] > 2000 and seqs == sorted(set(seqs))
    assert seen == [buf.next_seq] and buf.next_seq == seqs[-1] + 1
    st._apply_watermark(2000)  # the same watermark again (a reconnect): nothing moves
    assert [m.seq for m in buf.pending()] == seqs and buf.sent == 0


def test_intact_seq_state_is_not_renumbered():
    # Seq state intact: this run starts past the reserved block, the estimator is behind it.
    buf = filled(10, next_seq=3001)
    st = Streamer(buf, SRC, "127.0.0.1:1", on_seq_change=lambda s: pytest.fail("renumbered"))
    st._apply_watermark(2500)
    assert [m.seq for m in buf.pending()] == list(range(3001, 3011)) and buf.sent == 0


async def test_after_sending_a_watermark_below_next_seq_trims():
    buf = filled(10)
    st = Streamer(buf, SRC, "127.0.0.1:1", on_seq_change=lambda s: pytest.fail("renumbered"))
    st._apply_watermark(0)
    await st._flush(_Stub(6), buf.pending())  # the estimator persisted 1..6 of this run
    assert [m.seq for m in buf.pending()] == [7, 8, 9, 10] and buf.sent == 6
    st._apply_watermark(8)  # a reconnect's GetWatermark: ours, so trimmed
    assert [m.seq for m in buf.pending()] == [9, 10] and buf.sent == 8


class _Estimator(estimator_pb2_grpc.EstimatorServiceServicer):
    def __init__(self, store: MeasurementStore) -> None:
        self.store = store

    async def GetWatermark(self, request, context):
        return estimator_pb2.Watermark(source=request.source, seq=self.store.watermark(request.source))

    async def ReportMeasurements(self, request_iterator, context):
        acc = dup = 0
        sources = set()
        async for batch in request_iterator:
            a, d = await self.store.append(batch.measurements)
            acc, dup = acc + a, dup + d
            sources.update(m.source for m in batch.measurements)
        return estimator_pb2.ReportAck(accepted=acc, duplicates=dup,
                                       watermark={s: self.store.watermark(s) for s in sources})


@pytest.fixture
async def estimator(tmp_path):
    store = MeasurementStore(tmp_path / "estimator")
    server = grpc.aio.server()
    estimator_pb2_grpc.add_EstimatorServiceServicer_to_server(_Estimator(store), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield store, f"127.0.0.1:{port}"
    await server.stop(0)
    store.close()


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_stream_delivers_everything_after_seq_state_loss(estimator):
    store, addr = estimator
    old = SeqBuffer(10_000)
    for i in range(20):
        old.add(dev(i))
    assert await store.append(old.pending()) == (20, 0)  # the previous run's seqs 1..20
    buf = filled(30)  # this run: seq state lost, restarted at 1
    st = Streamer(buf, SRC, addr, flush_interval_s=0.01, backoff_min_s=0.01, backoff_max_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(st.run(stop))
    try:
        await _until(lambda: len(buf) == 0)
    finally:
        stop.set()
        await task
    assert store.count == 50 and buf.sent == 30 and buf.dropped == 0


async def test_oserror_writing_seq_state_during_rebase_does_not_end_the_stream(estimator):
    store, addr = estimator
    await store.append([profiler_pb2.Measurement(source=SRC, seq=s, kind="device") for s in (1, 2, 3)])
    buf = filled(5)
    writes = []

    def on_seq_change(seq: int) -> None:
        writes.append(seq)
        if len(writes) == 1:
            raise OSError(28, "No space left on device")  # the seq state file write

    st = Streamer(buf, SRC, addr, on_seq_change=on_seq_change, flush_interval_s=0.01, backoff_min_s=0.01,
                  backoff_max_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(st.run(stop))
    try:
        await _until(lambda: len(buf) == 0 or task.done())
        assert not task.done(), f"the stream task ended: {task.exception()!r}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert st.errors == 1 and store.count == 8 and buf.sent == 5
    assert store.watermark(SRC) == buf.next_seq - 1


async def test_unexpected_exception_in_a_session_disconnects_and_reconnects(estimator):
    store, addr = estimator
    buf = filled(5)
    st = Streamer(buf, SRC, addr, flush_interval_s=0.01, backoff_min_s=0.3, backoff_max_s=0.5)
    failed = asyncio.Event()
    real_pending = buf.pending

    def pending(*a, **kw):
        if not failed.is_set():
            failed.set()
            raise RuntimeError("injected")
        return real_pending(*a, **kw)

    buf.pending = pending
    stop = asyncio.Event()
    task = asyncio.create_task(st.run(stop))
    try:
        await asyncio.wait_for(failed.wait(), 10)
        await asyncio.sleep(0)
        assert not st.connected and st.errors == 1 and not task.done()
        await _until(lambda: len(buf) == 0 or task.done())
        assert not task.done(), f"the stream task ended: {task.exception()!r}"
        assert st.connected
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert store.count == 5 and store.watermark(SRC) == 5 and buf.sent == 5
