"""profilerd's Streamer against measurements the estimator refuses and estimators that
keep failing: a refused measurement is dropped (counted, logged) and the stream goes
on; the backoff grows while ReportMeasurements keeps failing (a successful
GetWatermark is no progress) and resets after a flush that advanced the watermark;
batches are cut by serialized size. Real loopback gRPC against small servicers."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import structlog

from estimator.store import MeasurementStore, is_meta, read_log
from profilerd import stream as stream_mod
from profilerd.buffer import SeqBuffer
from profilerd.stream import Streamer
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc, profiler_pb2
from tessera.measurement import malformed
from tests.unit.test_profilerd_stream_faults import _until

SRC = "profilerd/n1"


def step(i: int, t: float = 0.1, **labels) -> profiler_pb2.Measurement:
    return profiler_pb2.Measurement(source=SRC, kind="step", job_id="j", step=i, step_time_s=t, labels=labels)


def logged(store: MeasurementStore) -> list[int]:
    """The seqs the estimator persisted, in log order."""
    return [r.seq for r in read_log(store.path)[0] if not is_meta(r)]


def filled(ms) -> SeqBuffer:
    b = SeqBuffer(10_000)
    for m in ms:
        b.add(m)
    return b


class _Est(estimator_pb2_grpc.EstimatorServiceServicer):
    """The estimator's batch semantics over the real store: batches before a refused one
    stay persisted, the refused one is not. ``name_seq``: whether the refusal names the
    seq (as estimator.api does) or only ``measurements[i]`` (an older estimator).
    ``fail``: a status code every ReportMeasurements aborts with while set."""

    def __init__(self, store: MeasurementStore, name_seq: bool = True) -> None:
        self.store, self.name_seq = store, name_seq
        self.fail: grpc.StatusCode | None = None
        self.calls = self.watermarks = 0
        self.batch_sizes: list[int] = []

    async def GetWatermark(self, request, context):
        self.watermarks += 1
        return estimator_pb2.Watermark(source=request.source, seq=self.store.watermark(request.source))

    async def ReportMeasurements(self, request_iterator, context):
        self.calls += 1
        if self.fail is not None:
            await context.abort(self.fail, "measurements not persisted (disk error); retry later")
        acc = dup = 0
        async for batch in request_iterator:
            self.batch_sizes.append(batch.ByteSize())
            for i, m in enumerate(batch.measurements):
                bad = malformed(m)
                if bad:
                    suffix = f" (seq {m.seq})" if self.name_seq else ""
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"measurements[{i}].{bad}{suffix}")
            a, d = await self.store.append(batch.measurements)
            acc, dup = acc + a, dup + d
        return estimator_pb2.ReportAck(accepted=acc, duplicates=dup, watermark={SRC: self.store.watermark(SRC)})


@pytest.fixture
async def server(tmp_path):
    store = MeasurementStore(tmp_path / "estimator")
    servers = []

    async def start(**kw):
        est = _Est(store, **kw)
        srv = grpc.aio.server()
        estimator_pb2_grpc.add_EstimatorServiceServicer_to_server(est, srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        await srv.start()
        servers.append(srv)
        return est, f"127.0.0.1:{port}"

    yield start
    for srv in servers:
        await srv.stop(0)
    store.close()


async def _run_until(st: Streamer, cond) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(st.run(stop))
    try:
        await _until(lambda: cond() or task.done())
        assert not task.done(), f"the stream task ended: {task.exception()!r}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


# --- a refused measurement is dropped, counted and logged; the stream goes on

@pytest.mark.parametrize("name_seq", [True, False], ids=["seq-named", "located-by-watermark"])
@pytest.mark.parametrize("poison", [step(0, math.nan), step(0, math.inf), step(0, world_size="two")],
                         ids=["nan", "inf", "label"])
async def test_refused_measurement_is_dropped_and_the_rest_delivered(server, name_seq, poison):
    est, addr = await server(name_seq=name_seq)
    # 3 batches of 4: the poison is measurements[1] of the second batch (seq 6)
    ms = [step(i) for i in range(1, 6)] + [poison] + [step(i) for i in range(6, 12)]
    buf = filled(ms)
    st = Streamer(buf, SRC, addr, batch_size=4, flush_interval_s=0.01, backoff_min_s=0.01, backoff_max_s=0.05)
    with structlog.testing.capture_logs() as logs:
        await _run_until(st, lambda: len(buf) == 0)
    assert buf.dropped == buf.refused == 1 and buf.sent == 11
    assert logged(est.store) == [s for s in range(1, 13) if s != 6]
    assert est.store.watermark(SRC) == 12
    [ev] = [e for e in logs if e["event"] == "measurement refused; dropped it"]
    assert ev["seq"] == 6 and ev["refused_total"] == 1 and "measurements[1]" in ev["error"]
    assert st.errors == 0


async def test_unlocatable_refusal_drops_nothing_and_backs_off(server, monkeypatch):
    """INVALID_ARGUMENT that names no measurement: nothing is dropped (it might be
    good data), the session ends like any gRPC error and is retried at the backoff."""
    est, addr = await server()
    est.fail = grpc.StatusCode.INVALID_ARGUMENT
    buf = filled([step(i) for i in range(3)])
    st = Streamer(buf, SRC, addr, backoff_min_s=0.1, backoff_max_s=0.4)
    delays = _record_backoff(monkeypatch, n=4)
    await _run_until(st, lambda: len(delays) >= 4)
    assert len(buf) == 3 and buf.dropped == 0
    assert delays == [0.1, 0.2, 0.4, 0.4]


# --- backoff: grows while ReportMeasurements keeps failing, resets after progress

def _record_backoff(monkeypatch, n: int) -> list[float]:
    """Replace the reconnect wait (wait_any on the stop event alone, with a timeout that
    is not the flush interval, 0.01 in these tests) by a recorder that returns at once;
    other waits are real."""
    delays: list[float] = []
    real = stream_mod.wait_any

    async def wait_any(*events, timeout=None):
        if len(events) == 1 and timeout not in (None, 0.01) and len(delays) < n:
            delays.append(timeout)
            return
        await real(*events, timeout=timeout)

    monkeypatch.setattr(stream_mod, "wait_any", wait_any)
    return delays


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
async def test_backoff_grows_while_reports_fail_though_get_watermark_succeeds(server, monkeypatch, code):
    est, addr = await server()
    est.fail = code
    buf = filled([step(i) for i in range(3)])
    st = Streamer(buf, SRC, addr, flush_interval_s=0.01, backoff_min_s=0.1, backoff_max_s=0.5)
    delays = _record_backoff(monkeypatch, n=6)
    await _run_until(st, lambda: len(delays) >= 6)
    assert delays == [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    assert est.watermarks >= 6 and est.calls >= 6  # it did reconnect (GetWatermark OK) every time


async def test_backoff_resets_after_a_flush_that_advanced_the_watermark(server, monkeypatch):
    est, addr = await server()
    est.fail = grpc.StatusCode.UNAVAILABLE
    buf = filled([step(i) for i in range(3)])
    st = Streamer(buf, SRC, addr, flush_interval_s=0.01, backoff_min_s=0.1, backoff_max_s=0.5)
    delays = _record_backoff(monkeypatch, n=6)
    real_flush = st._flush

    async def flush(stub, pending):
        # the 4th call goes through (and advances), then the estimator fails again
        est.fail = None if est.calls == 3 else grpc.StatusCode.UNAVAILABLE
        await real_flush(stub, pending)
        buf.add(step(99))  # something for the next flush of this session

    st._flush = flush
    await _run_until(st, lambda: len(delays) >= 6)
    assert buf.sent == 3
    assert delays == [0.1, 0.2, 0.4, 0.1, 0.2, 0.4]


# --- batches by serialized size

def test_cut_bounds_count_and_serialized_size():
    from profilerd.stream import cut

    ms = [step(i, plan="x" * 300_000) for i in range(10)] + [step(i) for i in range(10, 20)]
    for m, s in zip(ms, range(1, 21)):
        m.seq = s
    batches = cut(ms, max_count=4, max_bytes=1 << 20)
    assert [m.seq for b in batches for m in b] == list(range(1, 21))  # all, in order
    for b in batches:
        assert len(b) <= 4
        assert estimator_pb2.MeasurementBatch(measurements=b).ByteSize() <= 1 << 20
    assert [len(b) for b in batches] == [3, 3, 3, 1 + 3, 4, 3]  # 3 big ones fit a MiB, not 4
    assert cut([], 4) == []


async def test_many_large_measurements_reach_the_estimator_in_batches_under_the_limit(server):
    """25 measurements of 200 KiB (each accepted by ReportStep) pending at once: one
    count-cut batch (5 MB) would exceed the estimator's 4 MiB receive limit."""
    est, addr = await server()
    buf = filled([step(i, plan="x" * (200 << 10)) for i in range(25)])
    st = Streamer(buf, SRC, addr, flush_interval_s=0.01, backoff_min_s=0.01, backoff_max_s=0.05)
    await _run_until(st, lambda: len(buf) == 0)
    assert buf.sent == 25 and buf.dropped == 0 and est.store.watermark(SRC) == 25
    assert max(est.batch_sizes) <= stream_mod.MAX_BATCH_BYTES


async def test_a_measurement_larger_than_a_batch_is_dropped_not_sent(server):
    est, addr = await server()
    buf = filled([step(0), step(1, plan="x" * 5000), step(2)])
    st = Streamer(buf, SRC, addr, flush_interval_s=0.01, backoff_min_s=0.01, backoff_max_s=0.05, max_batch_bytes=4096)
    await _run_until(st, lambda: len(buf) == 0)
    assert buf.sent == 2 and buf.dropped == buf.refused == 1
    assert logged(est.store) == [1, 3]
