"""profilerd's core (``profilerd.main.Profilerd``) behind its real gRPC server on loopback:
every buffer-full drop is logged eventually (rate-limited, and by ``stop``); a
measurement evicted while a call carries it is sent, not dropped, when the ack covers
it; the comm micro-benchmark's failures are logged, never raised; a seq state that
cannot be written makes ReportStep UNAVAILABLE (nothing changed) and costs the sampler
only the measurements that needed a number."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path

import grpc
import pytest
import structlog

from estimator.store import MeasurementStore, is_meta, read_log
from profilerd import main as pmain
from profilerd.config import ProfilerdConfig
from tessera import grpcserver
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc, profiler_pb2, profiler_pb2_grpc
from tests.unit.test_profilerd_stream_faults import _until

DROP_LINE = "buffer full: dropped oldest measurements"


def step(i: int, t: float = 0.1) -> profiler_pb2.Measurement:
    return profiler_pb2.Measurement(kind="step", job_id="j", step=i, step_time_s=t)


def dev(v: float) -> profiler_pb2.Measurement:
    return profiler_pb2.Measurement(kind="device", values={"cpu_util": v})


class Daemon:
    """A ``Profilerd`` with its ProfilerService on a loopback port and a client stub."""

    def __init__(self, tmp_path: Path, samplers=None, **kw) -> None:
        kw.setdefault("sample_interval_s", 0)
        self.cfg = ProfilerdConfig(node="n1", listen="127.0.0.1:0", state_dir=str(tmp_path / "prof"),
                                   flush_interval_s=0.02, reconnect_max_s=0.2, grace_s=2, **kw)
        self.d = pmain.Profilerd(self.cfg, samplers=samplers if samplers is not None else [])

    async def __aenter__(self) -> "Daemon":
        self.running = await grpcserver.start(self.d.servicers(), [pmain.SERVICE], self.cfg.listen)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.running.port}")
        self.stub = profiler_pb2_grpc.ProfilerServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await self.running.stop(0)
        if not self.d._stop.is_set():
            await self.d.stop()

    async def stats(self) -> profiler_pb2.ProfilerStats:
        return await self.stub.GetStats(profiler_pb2.GetStatsRequest())


def logged_drops(logs) -> list[int]:
    return [e["dropped"] for e in logs if e["event"] == DROP_LINE]


# --- 1. every drop is logged, still at most once per DROP_LOG_INTERVAL_S


async def test_drops_of_a_burst_are_all_logged_by_stop(tmp_path):
    async with Daemon(tmp_path, buffer_size=1) as dm:
        dm.d.start()
        with structlog.testing.capture_logs() as logs:
            for i in range(200):
                await dm.stub.ReportStep(step(i))
            s = await dm.stats()
            assert (s.buffered, s.dropped) == (1, 199)
            assert logged_drops(logs)[0] == 1  # the first drop at once; the next line waits 5 s
            await dm.d.stop()
    assert sum(logged_drops(logs)) == 199  # stop logs what the rate limit held back


async def test_drops_held_back_by_the_rate_limit_are_logged_while_running(tmp_path, monkeypatch):
    monkeypatch.setattr(pmain, "DROP_LOG_INTERVAL_S", 0.3)
    async with Daemon(tmp_path, buffer_size=1) as dm:
        dm.d.start()
        with structlog.testing.capture_logs() as logs:
            t0 = time.monotonic()
            for i in range(200):
                await dm.stub.ReportStep(step(i))
            dropped = (await dm.stats()).dropped
            assert dropped == 199
            await _until(lambda: sum(logged_drops(logs)) == dropped)  # no stop, no further drop needed
            elapsed = time.monotonic() - t0
        lines = logged_drops(logs)
        assert len(lines) <= 1 + elapsed / 0.3  # still rate-limited


# --- 2. evicted while in flight, acknowledged: sent, not dropped


class _HookedEstimator(estimator_pb2_grpc.EstimatorServiceServicer):
    """The estimator's stream semantics over the real store; ``hook`` runs when the first
    ReportMeasurements call has arrived, before its batches are read (the call is in
    flight from profilerd's point of view)."""

    def __init__(self, store: MeasurementStore, hook) -> None:
        self.store, self.hook, self.calls = store, hook, 0

    async def GetWatermark(self, request, context):
        return estimator_pb2.Watermark(source=request.source, seq=self.store.watermark(request.source))

    async def ReportMeasurements(self, request_iterator, context):
        self.calls += 1
        if self.calls == 1:
            self.hook()
        sources = set()
        async for batch in request_iterator:
            await self.store.append(batch.measurements)
            sources.update(m.source for m in batch.measurements)
        return estimator_pb2.ReportAck(watermark={s: self.store.watermark(s) for s in sources})


async def test_evicted_in_flight_and_acknowledged_is_sent_not_dropped(tmp_path):
    store = MeasurementStore(tmp_path / "estimator")
    server = grpc.aio.server()
    hooked = []
    port = server.add_insecure_port("127.0.0.1:0")
    try:
        async with Daemon(tmp_path, buffer_size=3, estimator=f"127.0.0.1:{port}") as dm:
            # while the first call carries seqs 1..3, a fourth measurement evicts seq 1
            servicer = _HookedEstimator(store, lambda: hooked.append(dm.d.add(step(3))))
            estimator_pb2_grpc.add_EstimatorServiceServicer_to_server(servicer, server)
            await server.start()
            for i in range(3):
                dm.d.add(step(i))
            with structlog.testing.capture_logs() as logs:
                dm.d.start()

                await _until(lambda: dm.d.buffer.sent + dm.d.buffer.dropped >= 4)
                s = await dm.stats()
                await dm.d.stop()
            assert hooked == [4]
            assert (s.sent, s.dropped, s.buffered) == (4, 0, 0)
            assert logged_drops(logs) == []  # nothing was lost: no "buffer full" line
            assert [r.seq for r in read_log(store.path)[0] if not is_meta(r)] == [1, 2, 3, 4]
    finally:
        await server.stop(0)
        store.close()


# --- 3. the comm micro-benchmark's failures are logged, never raised

# a child that writes its pid to argv[1] (whole: written aside, then renamed) and sleeps
SLEEPER = ("import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); "
           "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(60)")
# a table whose second row's op label (300 KiB) is larger than the whole buffer (256 KiB)
TOO_LARGE_ROW = ("import json; row = dict(op='all_reduce', bytes=1024, world=2, seconds=0.001); "
                 "print(json.dumps(dict(device_s=1, rows=[row, dict(row, op='x' * (300 << 10))])))")


async def _bench(tmp_path, which: str, argv: tuple, timeout_s: float = 2.0, **cfg) -> tuple:
    """A daemon (no samplers) whose ``which`` micro-benchmark ("comm", "colo") runs
    ``argv`` within ``timeout_s``; (daemon, what the benchmark returned, the logs)."""
    d = pmain.Profilerd(ProfilerdConfig(node="n1", state_dir=str(tmp_path / "prof"), sample_interval_s=0, **cfg),
                        samplers=[])
    setattr(d, f"{which}_bench_argv", argv)
    setattr(d, f"{which}_bench_timeout_s", timeout_s)
    with structlog.testing.capture_logs() as logs:
        got = await (d.comm_benchmark() if which == "comm" else d.colocation_benchmark())
    return d, got, logs


@pytest.mark.parametrize("case, rows, what", [
    ("spawn", 0, "FileNotFoundError"),
    ("bad json", 0, "JSONDecodeError"),
    ("missing key", 0, "KeyError('bytes')"),
    ("add refuses a row", 1, "MeasurementTooLarge"),
    ("timeout", 0, "no result within 2.0 s; killed it"),
])
async def test_comm_benchmark_failure_is_logged_not_raised(tmp_path, case, rows, what):
    pidfile = tmp_path / "child.pid"
    argv = {
        "spawn": (str(tmp_path / "no-such-python"),),
        "bad json": (sys.executable, "-c", "print('not json')"),
        "missing key": (sys.executable, "-c", "print('{\"rows\": [{\"op\": \"all_reduce\"}], \"device_s\": 1}')"),
        "add refuses a row": (sys.executable, "-c", TOO_LARGE_ROW),
        "timeout": (sys.executable, "-c", SLEEPER, str(pidfile)),
    }[case]
    d, got, logs = await _bench(tmp_path, "comm", argv, buffer_bytes=256 << 10)
    assert got == rows
    failed = [e for e in logs if e["event"] == "comm micro-benchmark failed"]
    assert len(failed) == 1 and what in failed[0]["error"] and failed[0]["rows"] == rows
    assert len(d.buffer) == rows
    if case == "timeout":  # the child was killed and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(int(pidfile.read_text()), 0)


async def test_comm_benchmark_failure_in_the_daemon_task_is_logged_and_stop_is_clean(tmp_path):
    async with Daemon(tmp_path, comm_benchmark=True) as dm:
        dm.d.comm_bench_argv = (sys.executable, "-c", "print('{\"rows\": 3}')")  # not a table
        with structlog.testing.capture_logs() as logs:
            dm.d.start()
            await _until(lambda: any(e["event"] == "comm micro-benchmark failed" for e in logs))
            await dm.d.stop()
        assert "TypeError" in next(e for e in logs if e["event"] == "comm micro-benchmark failed")["error"]


async def test_comm_benchmark_cancelled_kills_the_child_and_propagates(tmp_path):
    pidfile = tmp_path / "child.pid"
    d = pmain.Profilerd(ProfilerdConfig(node="n1", state_dir=str(tmp_path / "prof"), sample_interval_s=0),
                        samplers=[])
    d.comm_bench_argv = (sys.executable, "-c", SLEEPER, str(pidfile))
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(d.comm_benchmark())
        await _until(pidfile.exists)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)
    assert not [e for e in logs if e["event"] == "comm micro-benchmark failed"]  # a cancellation is no failure


COLO_ROWS = ("import json; r = dict(mode='shared', colocated=2, oversubscription=2.0, alone_s=0.01, together_s=0.022, "
             "layers=2, hidden=64, heads=4, vocab=256, rows=8, seq=64); print(json.dumps(dict(device_s=3, rows=[r])))")


@pytest.mark.parametrize("case, rows, what", [
    ("table", 1, ""),
    ("exit 3", 0, "code"),
    ("missing key", 0, "KeyError('layers')"),
    ("timeout", 0, "no result within 2.0 s; killed it"),
])
async def test_colocation_benchmark_buffers_its_pairs_or_logs_why_not(tmp_path, case, rows, what):
    argv = {
        "table": (sys.executable, "-c", COLO_ROWS),
        "exit 3": (sys.executable, "-c", "import sys; print('no', file=sys.stderr); sys.exit(3)"),
        "missing key": (sys.executable, "-c", "print('{\"rows\": [{\"mode\": \"split\"}], \"device_s\": 1}')"),
        "timeout": (sys.executable, "-c", SLEEPER, str(tmp_path / "child.pid")),
    }[case]
    d, got, logs = await _bench(tmp_path, "colo", argv)
    assert got == rows
    failed = [e for e in logs if e["event"] == "colocation micro-benchmark failed"]
    assert len(d.buffer) == rows
    if case == "table":
        assert not failed
        (m,) = d.buffer.pending()
        assert m.kind == "colocation" and m.labels["mode"] == "shared" and m.labels["device_kind"] == "cpu"
        assert m.labels["hidden"] == "64" and m.values["together_s"] == pytest.approx(0.022)
    elif case == "exit 3":
        assert len(failed) == 1 and failed[0]["code"] == 3 and "no" in failed[0]["stderr"]
    else:
        assert len(failed) == 1 and what in failed[0]["error"]


RANK_ROWS = ("import json; r = dict(mode='ranks', seconds=0.021, n=5, dp=1, tp=1, pp=2, micro_batches=1, quota=1.0, "
             "layers=2, hidden=64, heads=4, vocab=256, rows=8, seq=64); print(json.dumps(dict(device_s=10, rows=[r])))")


async def test_the_ranks_row_goes_out_as_a_rank_profile_the_estimator_fits(tmp_path):
    """colobench's ``ranks`` row (one job's 2-stage pipeline on two cores) is buffered as a
    ``kind="ranks"`` measurement on profilerd's comm link, which is what the estimator
    takes as a rank profile of that plan (estimator.models.rank_row) and nothing refuses."""
    from estimator.models import rank_row
    from tessera.measurement import malformed

    d, got, logs = await _bench(tmp_path, "colo", (sys.executable, "-c", RANK_ROWS), 10.0, comm_link="lo")
    assert got == 1
    (m,) = d.buffer.pending()
    assert m.kind == "ranks" and m.labels["link"] == "lo" and malformed(m) is None
    row = rank_row(m)
    assert row is not None and row["seconds"] == pytest.approx(0.021)
    assert {k: row["candidate"][k] for k in ("pp", "dp", "batch", "seq", "seq_len", "colocated", "quota")} == \
        {"pp": 2, "dp": 1, "batch": 8, "seq": 64, "seq_len": 64, "colocated": 2, "quota": 1.0}
    (done,) = [e for e in logs if e["event"] == "colocation micro-benchmark reported"]
    assert done["ranks_step_s"] == pytest.approx(0.021)


# --- 4. the seq state cannot be written


def break_seq_state(state_dir: Path) -> None:
    """Make every write of the reservation fail for real: ``seq`` becomes a non-empty
    directory, which the atomic rename cannot replace (EISDIR), even as root."""
    seq = state_dir / "seq"
    seq.unlink()
    seq.mkdir()
    (seq / "keep").write_text("")


def repair_seq_state(state_dir: Path, reserved: int) -> None:
    shutil.rmtree(state_dir / "seq")
    (state_dir / "seq").write_text(f"{reserved}\n")


async def test_report_step_is_unavailable_and_changes_nothing_when_the_seq_state_cannot_be_written(tmp_path):
    state = tmp_path / "prof"
    async with Daemon(tmp_path) as dm:
        dm.d.start()
        for i in range(1000):  # the first reserved block (1..1000), all used
            dm.d.add(step(i))
        before = await dm.stats()
        assert (before.buffered, before.next_seq, before.dropped) == (1000, 1001, 0)
        break_seq_state(state)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await dm.stub.ReportStep(step(1000))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        details = ei.value.details()
        assert details.startswith("sequence state not persisted: ") and details.endswith("; nothing buffered")
        assert str(state / "seq") in details
        assert await dm.stats() == before  # nothing buffered, numbered or counted
        assert sorted(os.listdir(state)) == ["seq"]  # no temp file left
        repair_seq_state(state, 1000)
        assert (await dm.stub.ReportStep(step(1000))).seq == 1001  # the number was not used


class ScriptedSampler:
    """Returns the next list of ``script`` per tick (none left: nothing); counts ticks."""

    def __init__(self) -> None:
        self.script: deque[list[profiler_pb2.Measurement]] = deque()
        self.ticks = 0

    def sample(self) -> list[profiler_pb2.Measurement]:
        self.ticks += 1
        return self.script.popleft() if self.script else []


async def test_sampler_drops_only_what_needs_an_unwritable_seq_and_counts_it(tmp_path):
    state = tmp_path / "prof"
    sampler = ScriptedSampler()
    async with Daemon(tmp_path, samplers=[sampler], sample_interval_s=0.01) as dm:
        for i in range(999):
            dm.d.add(step(i))  # seqs 1..999: 1000 is the last of the reserved block
        break_seq_state(state)
        sampler.script.append([dev(0.1), dev(0.2), dev(0.3)])  # 1000 fits, the next two need a new block
        with structlog.testing.capture_logs() as logs:
            dm.d.start()
            await _until(lambda: sampler.ticks >= 1)  # the tick's adds run right after sample()
        s = await dm.stats()
        assert (s.buffered, s.next_seq, s.dropped) == (1000, 1001, 2)
        assert [m.values["cpu_util"] for m in dm.d.buffer.pending()[-1:]] == [pytest.approx(0.1)]
        lost = [e for e in logs if e["event"] == "sequence state not persisted; dropped samples"]
        assert len(lost) == 1 and lost[0]["dropped"] == 2 and "sequence state not persisted" in lost[0]["error"]
        assert not [e for e in logs if e["event"] == "sampling failed"]

        repair_seq_state(state, 1000)
        sampler.script.append([dev(0.4)])
        await _until(lambda: len(dm.d.buffer) == 1001)
        s = await dm.stats()
        assert (s.next_seq, s.dropped) == (1002, 2)
