"""The estimator's model RPCs over real loopback gRPC: measurements in, a fitted,
versioned model out (Estimate, EstimateBatch, GetModelSnapshot, ListProfiles), the
snapshot evaluated locally giving the service's numbers, and the model surviving a
restart."""

from __future__ import annotations

import json

import grpc
import pytest

from estimator import main as emain
from estimator.config import EstimatorConfig
from estimator.models import MODEL_NAME, WARMUP_STEPS
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc, profiler_pb2
from tessera.perfmodel import Candidate, PerfModel
from tessera.perfmodel.comm import steps_and_volume
from tests.unit.test_perfmodel_fit import TRUE, TRUE_P, samples

SRC = "profilerd/test"


class Est:
    def __init__(self, state_dir, port=0):
        self.state_dir, self.port = state_dir, port

    async def __aenter__(self):
        cfg = EstimatorConfig(listen=f"127.0.0.1:{self.port}", state_dir=str(self.state_dir), grace_s=0,
                              min_refit_interval_s=0)
        self.running, self.store = await emain.start(cfg)
        self.port = self.running.port
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = estimator_pb2_grpc.EstimatorServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.running.stop(0)
        self.store.close()


def run_measurements(s, job: str, seq0: int, steps: int = 6) -> list[profiler_pb2.Measurement]:
    """Step measurements of one single-device run of sample ``s`` (warm-up steps slower)."""
    labels = {"module": s.module, "workload_type": "gpt", "layers": s.layers, "hidden": s.hidden, "heads": s.heads,
              "vocab": s.vocab, "seq_len": s.seq, "batch": s.rows, "dp": 1, "tp": 1, "pp": 1,
              "micro_batches": s.micro_batches, "threads": s.q, "world_size": 1, "device_kind": "cpu", "rank": 0}
    out = []
    for i in range(1, steps + 1):
        t = s.seconds * (3.0 if i <= WARMUP_STEPS else 1.0)
        out.append(profiler_pb2.Measurement(source=SRC, seq=seq0 + i - 1, kind="step", job_id=job, step=i,
                                            step_time_s=t, labels={k: str(v) for k, v in labels.items()}))
    return out


def comm_measurements(seq0: int, alpha=50e-6, beta=1 / 2e9) -> list[profiler_pb2.Measurement]:
    out = []
    for op in ("all_reduce", "send_recv"):
        for nbytes in (4 << 10, 256 << 10, 4 << 20):
            st, vol = steps_and_volume(op, 2, nbytes)
            out.append(profiler_pb2.Measurement(
                source=SRC, seq=seq0 + len(out), kind="comm", labels={"op": op, "link": "lo"},
                values={"bytes": nbytes, "world": 2, "seconds": float(alpha * st + beta * vol)}))
    return out


async def report(stub, ms):
    return await stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(measurements=ms[i:i + 100])
                                               for i in range(0, len(ms), 100)]))


def to_pb(c: Candidate) -> estimator_pb2.Candidate:
    return estimator_pb2.Candidate(**{k: getattr(c, k) for k in estimator_pb2.Candidate.DESCRIPTOR.fields_by_name})


def cand(**kw) -> Candidate:
    base = dict(device_type="cpu", layers=3, hidden=96, heads=4, vocab=512, seq_len=64, batch=16, module="m3x96",
                quota=2.0, link="lo")
    base.update(kw)
    return Candidate(**base)


async def test_fit_serve_snapshot_and_restart(tmp_path):
    ss = samples()  # 72 configurations with known coefficients
    ms, seq = [], 1
    for i, s in enumerate(ss):
        ms += run_measurements(s, f"j-{i:03d}", seq)
        seq += 6
    ms += comm_measurements(seq)
    async with Est(tmp_path) as e:
        ack = await report(e.stub, ms)
        assert ack.accepted == len(ms)
        snap = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())
        assert snap.version == 1 and snap.format == "tessera.perfmodel/1" and not snap.unchanged
        model = PerfModel.from_dict(json.loads(snap.json))
        fit = model.compute["cpu"]
        assert fit.status == "ok" and fit.p == pytest.approx(TRUE_P, abs=0.03)
        for k in ("c_flops", "c_ops", "c_params"):  # warm-up steps were excluded: exact data, exact fit
            assert fit.coef[k] == pytest.approx(TRUE[k], rel=0.05), k
        assert set(model.comm["lo"].ops) == {"all_reduce", "send_recv"}

        # the service's numbers are the snapshot's numbers, one by one and in a batch
        c = cand(dp=2, pp=2, micro_batches=2, batch=32)
        one = await e.stub.Estimate(estimator_pb2.EstimateRequest(candidate=to_pb(c)))
        local = model.estimate(c)
        assert one.status == "ok" and one.model_version == 1
        assert one.seconds == local.seconds and one.confidence == local.confidence
        assert one.breakdown["bubble"] > 0
        cands = [cand(batch=b, quota=q, layers=L) for b in (8, 16, 32, 64) for q in (1.0, 2.0) for L in range(2, 8)] * 50
        batch = await e.stub.EstimateBatch(estimator_pb2.EstimateBatchRequest(candidates=[to_pb(x) for x in cands]))
        assert len(batch.estimates) == len(cands) == 2400
        assert [r.seconds for r in batch.estimates] == [x.seconds for x in model.estimate_batch(cands)]
        # a plan over a link never measured: says so
        nolink = await e.stub.Estimate(estimator_pb2.EstimateRequest(candidate=to_pb(cand(dp=2, link="nvlink"))))
        assert nolink.status == "insufficient_data" and "nvlink" in nolink.reason and nolink.seconds == 0

        same = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest(if_newer_than=1))
        assert same.unchanged and same.json == "" and same.version == 1
        prof = await e.stub.ListProfiles(estimator_pb2.ListProfilesRequest(module="m3x96"))
        assert len(prof.profiles) == 18 and {p.steps for p in prof.profiles} == {6 - WARMUP_STEPS}
        p0 = prof.profiles[0]
        assert p0.median_step_time_s == pytest.approx(next(
            s.seconds for s in ss if (s.module, s.rows, s.seq, s.micro_batches, s.q)
            == ("m3x96", p0.rows, p0.seq, p0.micro_batches, p0.quota)))
        assert len((await e.stub.ListProfiles(estimator_pb2.ListProfilesRequest())).profiles) == 72
        port = e.port

    # restart: same version and coefficients, served from model.json
    assert (tmp_path / MODEL_NAME).exists()
    async with Est(tmp_path, port) as e:
        again = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())
        assert again.version == 1 and json.loads(again.json) == json.loads(snap.json)
        # new profiles change the model: a new version
        extra = run_measurements(ss[0].__class__(**{**ss[0].__dict__, "seconds": ss[0].seconds * 1.5}), "j-new", seq + 100)
        await report(e.stub, extra)
        newer = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest(if_newer_than=1))
        assert newer.version == 2 and not newer.unchanged


async def test_few_profiles_answer_only_what_was_run(tmp_path):
    s = samples()[0]
    async with Est(tmp_path) as e:
        await report(e.stub, run_measurements(s, "j-one", 1, steps=8))
        snap = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())
        model = PerfModel.from_dict(json.loads(snap.json))
        assert model.compute["cpu"].status == "insufficient_data"
        exact = Candidate(device_type="cpu", layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab,
                          seq_len=s.seq, batch=s.rows, micro_batches=s.micro_batches, quota=s.q, module=s.module)
        r = await e.stub.Estimate(estimator_pb2.EstimateRequest(candidate=to_pb(exact)))
        assert r.status == "ok" and r.seconds == pytest.approx(s.seconds) and "measured profile" in r.reason
        assert 0 < r.confidence < 1 and r.memory_bytes > 0
        other = await e.stub.Estimate(estimator_pb2.EstimateRequest(candidate=to_pb(
            Candidate(**{**exact.__dict__, "batch": s.rows * 2}))))
        assert other.status == "insufficient_data" and "at least" in other.reason and other.seconds == 0


@pytest.mark.parametrize("rpc,field,expect", [
    ("Estimate", {"hidden": 98}, "candidate.hidden"),
    ("Estimate", {"device_type": ""}, "candidate.device_type"),
    ("EstimateBatch", {"layers": 0}, "candidates[1].layers"),
    ("EstimateBatch", {"quota": -1.0}, "candidates[1].quota"),
    # beyond the pipeline replay's bounds (pp = 8, m = 4096 took 1.6 s on the event loop)
    ("EstimateBatch", {"layers": 8, "pp": 8, "micro_batches": 4096, "batch": 4096},
     "candidates[1].micro_batches: must be <= 1024, got 4096"),
    ("Estimate", {"layers": 2048, "pp": 1025}, "candidate.pp: must be <= 1024, got 1025"),
    ("Estimate", {"layers": 1024, "pp": 1024, "micro_batches": 1024, "batch": 1024},
     "candidate.micro_batches: pp*micro_batches must be <= 8192 for a pipeline, got 1024*1024"),
    # what the runtime refuses (these came back OK-status, even ok with seconds)
    ("Estimate", {"seq": 4096}, "candidate.seq: must be <= seq_len (64), got 4096"),
    ("EstimateBatch", {"dp": 2, "micro_batches": 3}, "candidates[1].batch: must be divisible by dp*micro_batches"),
    ("Estimate", {"tp": 3}, "candidate.tp: must divide hidden (96) and heads (4), got 3"),
    ("Estimate", {"pp": 4}, "candidate.pp: must be <= layers (3), got 4"),
])
async def test_bad_candidate_is_invalid_argument_naming_the_field(tmp_path, rpc, field, expect):
    async with Est(tmp_path) as e:
        bad = estimator_pb2.Candidate(**{**{k: getattr(cand(), k) for k in
                                            estimator_pb2.Candidate.DESCRIPTOR.fields_by_name}, **field})
        req = (estimator_pb2.EstimateRequest(candidate=bad) if rpc == "Estimate"
               else estimator_pb2.EstimateBatchRequest(candidates=[to_pb(cand()), bad]))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await getattr(e.stub, rpc)(req)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith(expect)


async def test_a_profiled_workload_is_not_held_to_the_gpt_plan_rules(tmp_path):
    """A peft / multimodal candidate (its module a shape key) takes no gpt plan: a tp, pp
    or batch % micro-batches that a gpt plan may not have is not refused (the controller
    sends plan fields 1 for them, tessera.perfmodel.workload ignores them); the bounds every
    candidate shares (seq <= seq_len, micro_batches <= 1024) still are."""
    peft = dict(device_type="cpu", layers=2, hidden=32, heads=2, vocab=64, seq_len=32, batch=5, micro_batches=2,
                tp=3, pp=4, module="peft:l2-h32-a2-s32-v64:w0123456789ab")
    async with Est(tmp_path) as e:
        r = await e.stub.Estimate(estimator_pb2.EstimateRequest(candidate=estimator_pb2.Candidate(**peft)))
        assert r.status == "insufficient_data" and "no profile" in r.reason
        for field, expect in (({"seq": 33}, "candidate.seq"), ({"micro_batches": 1025}, "candidate.micro_batches")):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await e.stub.Estimate(estimator_pb2.EstimateRequest(
                    candidate=estimator_pb2.Candidate(**{**peft, **field})))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith(expect)


async def test_estimates_are_computed_off_the_event_loop(tmp_path, monkeypatch):
    """Estimate and EstimateBatch evaluate the model in a worker thread: a slow candidate
    (a long pipeline replay) does not stall the server's event loop."""
    import threading

    loop_thread = threading.get_ident()  # the server runs on this test's event loop
    threads = []
    real = PerfModel.estimate_batch

    def spy(self, cands):
        threads.append(threading.get_ident())
        return real(self, cands)

    monkeypatch.setattr(PerfModel, "estimate_batch", spy)
    async with Est(tmp_path) as e:
        one = await e.stub.Estimate(estimator_pb2.EstimateRequest(candidate=to_pb(cand())))
        many = await e.stub.EstimateBatch(estimator_pb2.EstimateBatchRequest(candidates=[to_pb(cand())] * 3))
    assert one.status == "insufficient_data" and len(many.estimates) == 3
    assert len(threads) == 2 and loop_thread not in threads


async def test_a_model_file_that_cannot_be_written_fails_no_model_rpc(tmp_path, monkeypatch):
    """model.json not writable (disk full, read-only state dir) while a refit is due: the
    model RPCs answer from the last durable model (before: UNKNOWN on every call), and the
    refit is retried and published once the disk is back."""
    import errno

    import estimator.models as em

    real = em.atomic_write
    broken = [True]

    def atomic_write(path, write):
        if broken[0]:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path, write)

    monkeypatch.setattr(em, "atomic_write", atomic_write)
    s = samples()[0]
    async with Est(tmp_path) as e:
        await report(e.stub, run_measurements(s, "j-one", 1, steps=8))
        snap = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())
        assert snap.version == 0  # the model of nothing: the refit was not published
        exact = to_pb(Candidate(device_type="cpu", layers=s.layers, hidden=s.hidden, heads=s.heads, vocab=s.vocab,
                                seq_len=s.seq, batch=s.rows, micro_batches=s.micro_batches, quota=s.q,
                                module=s.module))
        r = await e.stub.Estimate(estimator_pb2.EstimateRequest(candidate=exact))
        assert r.status == "insufficient_data" and r.model_version == 0
        b = await e.stub.EstimateBatch(estimator_pb2.EstimateBatchRequest(candidates=[exact]))
        assert b.model_version == 0
        assert (await e.stub.ListProfiles(estimator_pb2.ListProfilesRequest())).model_version == 0
        assert not (tmp_path / MODEL_NAME).exists()
        broken[0] = False
        r = await e.stub.Estimate(estimator_pb2.EstimateRequest(candidate=exact))
        assert r.status == "ok" and r.model_version == 1
        assert json.loads((tmp_path / MODEL_NAME).read_text())["snapshot"]["version"] == 1


async def test_a_store_that_cannot_reopen_its_log_after_compaction_is_unavailable(tmp_path):
    """Compaction replaced the log but the new file could not be opened (EMFILE here):
    the batch that triggered it stays acknowledged and durable; every later report is
    UNAVAILABLE (the profilerd keeps and resends it) — before, the closed handle raised
    ValueError, answered INVALID_ARGUMENT, and the profilerd dropped its data."""
    import errno

    def device(seq):
        return profiler_pb2.Measurement(source=SRC, seq=seq, kind="device", values={"cpu_util": 0.5})

    async with Est(tmp_path) as e:
        e.store.compact_bytes = 1  # device samples are not retained: compaction is due at once

        def emfile():
            raise OSError(errno.EMFILE, "Too many open files")

        e.store._open_append = emfile
        ack = await e.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(
            measurements=[device(i) for i in range(1, 11)])]))
        assert ack.accepted == 10 and e.store.compactions == 1
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await e.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(measurements=[device(11)])]))
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "reopening it failed" in ei.value.details()
        assert (await e.stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source=SRC))).seq == 10
    async with Est(tmp_path) as e:  # a restart reopens it: nothing acknowledged was lost
        assert e.store.watermark(SRC) == 10 and e.store.count == 10
        ack = await e.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(measurements=[device(11)])]))
        assert ack.accepted == 1


async def test_only_an_unindexable_measurement_is_the_batch_s_fault(tmp_path, monkeypatch):
    """INVALID_ARGUMENT (the profilerd drops the measurement) is for a record the store
    cannot index (store.Unindexable) only; any other error of the store is not the batch's
    fault and must not be answered so."""
    from tests.unit.test_estimator_store import _unindexable_job

    ok = profiler_pb2.Measurement(source=SRC, seq=1, kind="step", job_id="j", step=1, step_time_s=0.01)
    poison = profiler_pb2.Measurement(source=SRC, seq=1, kind="step", job_id="poison", step=1, step_time_s=0.01)
    async with Est(tmp_path) as e:
        real = e.store.append

        async def closed(ms):
            raise ValueError("I/O operation on closed file")

        e.store.append = closed
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await e.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(measurements=[ok])]))
        assert ei.value.code() != grpc.StatusCode.INVALID_ARGUMENT
        e.store.append = real
        _unindexable_job(monkeypatch, "poison")
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await e.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(measurements=[poison])]))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith("measurements[0]: ") and "cannot be indexed" in ei.value.details()


@pytest.mark.parametrize("kind,values,expect", [
    ("colocation", {"alone_s": 5e-324}, "measurements[1].values.alone_s"),
    ("comm", {"idle_s": 1e-320}, "measurements[1].values.idle_s"),
    ("comm", {"seconds": 5e-324}, "measurements[1].values.seconds"),
])
async def test_a_time_below_a_nanosecond_is_refused_naming_the_field(tmp_path, kind, values, expect):
    """Such a row froze the model (interference or refill fitted inf) or dropped its link's
    table: refused at ingestion, nothing of the batch persisted."""
    base = ({"bytes": 4096, "world": 2, "seconds": 1e-4} if kind == "comm"
            else {"colocated": 2, "oversubscription": 1.0, "alone_s": 0.02, "together_s": 0.03})
    labels = {"op": "refill", "link": "lo"} if kind == "comm" else {"mode": "split", "device_kind": "cpu"}
    ok = profiler_pb2.Measurement(source=SRC, seq=1, kind=kind, labels=labels, values=base)
    bad = profiler_pb2.Measurement(source=SRC, seq=2, kind=kind, labels=labels, values={**base, **values})
    async with Est(tmp_path) as e:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await e.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(measurements=[ok, bad])]))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith(expect)
        assert e.store.watermark(SRC) == 0 and e.store.count == 0


async def test_a_write_that_fails_is_unavailable_and_acknowledges_nothing(tmp_path, monkeypatch):
    """A disk error while persisting (ENOSPC here, injected at the file write) answers
    UNAVAILABLE — the client keeps the batch and resends — and moves no watermark; the
    next report, once the disk is back, is accepted."""
    import errno
    import os as _os

    ms = [profiler_pb2.Measurement(source=SRC, seq=i, kind="step", job_id="j", step=i, step_time_s=0.01)
          for i in (1, 2)]
    async with Est(tmp_path / "est") as est:
        real_fsync = _os.fsync
        broken = [True]

        def fsync(fd):
            if broken[0] and fd == est.store._file.fileno():
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fsync(fd)

        monkeypatch.setattr(_os, "fsync", fsync)
        batch = estimator_pb2.MeasurementBatch(measurements=ms)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await est.stub.ReportMeasurements(iter([batch]))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "not persisted" in e.value.details()
        assert (await est.stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source=SRC))).seq == 0
        assert est.store.path.stat().st_size == 0  # cut back: no half-written record left
        broken[0] = False
        ack = await est.stub.ReportMeasurements(iter([batch]))
        assert ack.accepted == 2 and ack.watermark[SRC] == 2


@pytest.mark.parametrize("labels,values,t,expect", [
    ({"world_size": "inf"}, {}, 0.01, "measurements[1].labels.world_size"),
    ({"threads": "x"}, {}, 0.01, "measurements[1].labels.threads"),
    ({}, {}, float("nan"), "measurements[1].step_time_s"),
])
async def test_malformed_measurement_is_invalid_argument_and_never_persisted(tmp_path, labels, values, t, expect):
    ok = profiler_pb2.Measurement(source=SRC, seq=1, kind="step", job_id="j", step=1, step_time_s=0.01)
    bad = profiler_pb2.Measurement(source=SRC, seq=2, kind="step", job_id="j", step=2, step_time_s=t,
                                   labels={"module": "m", "world_size": "1", **labels}, values=values)
    async with Est(tmp_path / "est") as est:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await est.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(measurements=[ok, bad])]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(expect)
        assert (await est.stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source=SRC))).seq == 0
    async with Est(tmp_path / "est") as est:  # reopens fine
        assert (await est.stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source=SRC))).seq == 0


async def test_estimate_batch_at_max_batch_fits_the_message_limits(tmp_path):
    """MAX_BATCH realistic candidates (over gRPC's default 4 MiB both ways) go through the
    estimator's server and the controller's EstimatorLink channel; one more is refused."""
    from controller.profiling import EstimatorLink
    from estimator.api import MAX_BATCH

    c = estimator_pb2.Candidate(device_type="cpu", layers=4, hidden=128, heads=4, vocab=256, seq_len=64, batch=16,
                                dp=2, quota=1.0, link="loopback-gloo", module="gpt:l4-h128-a4-s64-v256")
    req = estimator_pb2.EstimateBatchRequest(candidates=[c] * MAX_BATCH)
    assert req.ByteSize() > 4 << 20
    async with Est(tmp_path) as e:
        link = EstimatorLink(f"127.0.0.1:{e.port}")
        try:
            r = await link.stub.EstimateBatch(req, timeout=60)
            assert len(r.estimates) == MAX_BATCH and r.ByteSize() > 4 << 20
            req.candidates.append(c)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await link.stub.EstimateBatch(req, timeout=60)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "candidates" in ei.value.details()
        finally:
            await link.close()


async def test_snapshot_to_a_caller_ahead_is_the_full_snapshot(tmp_path):
    """A caller holding a higher version (another lineage: the estimator lost its state) is
    not told 'unchanged': it gets the snapshot, and EstimatorLink replaces its cache."""
    from controller.profiling import EstimatorLink

    async with Est(tmp_path) as e:
        await e.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(
            measurements=run_measurements(samples()[0], "j1", 1))]))
        cur = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())
        assert cur.version >= 1 and cur.json
        same = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest(if_newer_than=cur.version))
        assert same.unchanged and not same.json
        ahead = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest(if_newer_than=cur.version + 4))
        assert not ahead.unchanged and ahead.version == cur.version and json.loads(ahead.json)
        link = EstimatorLink(f"127.0.0.1:{e.port}")
        try:
            link.model = PerfModel(version=cur.version + 4)
            m = await link.snapshot()
            assert m.version == cur.version and link.model is m
        finally:
            await link.close()


@pytest.mark.parametrize("cut", ["half", "garbage"])
async def test_unreadable_model_file_is_refitted_from_the_log(tmp_path, cut):
    """A truncated or garbage model.json does not stop the estimator: it is moved aside and
    the model refitted from the log; a version still legible in it is never reissued."""
    async with Est(tmp_path) as e:
        await e.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(
            measurements=run_measurements(samples()[0], "j1", 1))]))
        before = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())
    path = tmp_path / MODEL_NAME
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if cut == "half" else b"\x00not json")
    async with Est(tmp_path) as e:
        after = await e.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest())
        assert json.loads(after.json)["profiles"] == json.loads(before.json)["profiles"]
        assert after.version > before.version if cut == "half" else after.version >= 1
        assert len(list(tmp_path.glob(MODEL_NAME + ".corrupt-*"))) == 1
        assert json.loads(path.read_text())["snapshot"]["version"] == after.version


async def test_seq_going_backwards_in_a_batch_is_refused_but_a_resend_is_not(tmp_path):
    """Seqs of one source must increase within a batch (else one would silently be taken for
    a duplicate): INVALID_ARGUMENT naming measurements[i].seq, nothing persisted. A resend of
    persisted seqs at the head of a batch (profilerd after a reconnect) is fine."""
    ms = run_measurements(samples()[0], "j1", 1)  # seqs 1..6

    def batch(*seqs):
        out = []
        for s in seqs:
            m = profiler_pb2.Measurement()
            m.CopyFrom(ms[s - 1])
            out.append(m)
        return iter([estimator_pb2.MeasurementBatch(measurements=out)])

    async with Est(tmp_path) as e:
        for bad in ((1, 2, 5, 3), (2, 1)):
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await e.stub.ReportMeasurements(batch(*bad))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert ei.value.details().startswith(f"measurements[{len(bad) - 1}].seq: must increase per source")
            assert e.store.watermark(SRC) == 0 and e.store.count == 0
        ack = await e.stub.ReportMeasurements(batch(1, 2, 2, 3))  # an exact repeat is a duplicate
        assert (ack.accepted, ack.duplicates) == (3, 1)
        ack = await e.stub.ReportMeasurements(batch(2, 3, 4, 5, 6))  # resent head, then new
        assert (ack.accepted, ack.duplicates, e.store.count) == (3, 2, 6)
