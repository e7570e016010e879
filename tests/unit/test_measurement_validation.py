"""``tessera.measurement.malformed`` bounds every number of a step (step time, phases,
time) and the estimator refuses such a batch naming the field, persisting nothing; the
estimator's aggregates are overflow-safe and never NaN/inf."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from estimator import models
from estimator.profiles import StepSample, summarize
from tessera.api.v1 import estimator_pb2, profiler_pb2
from tessera.measurement import MAX_STEP_TIME_S, malformed
from tests.integration.test_estimator_service import SRC, Est


def step(seq=1, t=0.01, **kw):
    return profiler_pb2.Measurement(source=SRC, seq=seq, kind="step", job_id="j1", step=seq, step_time_s=t, **kw)


@pytest.mark.parametrize("m, field", [
    (step(t=1e308), "step_time_s"),
    (step(t=MAX_STEP_TIME_S * 2), "step_time_s"),
    (step(phases={"forward": math.nan}), "phases.forward"),
    (step(phases={"forward": 0.1, "backward": -5.0}), "phases.backward"),
    (step(phases={"optimizer": math.inf}), "phases.optimizer"),
    (step(phases={"forward": 1e300}), "phases.forward"),
    (step(time=math.nan), "time"),
    (profiler_pb2.Measurement(source=SRC, seq=1, kind="device", time=math.inf), "time"),
])
def test_malformed_names_the_field(m, field):
    bad = malformed(m)
    assert bad is not None and bad.startswith(field + ":")


def test_plausible_step_is_fine():
    assert malformed(step(t=MAX_STEP_TIME_S, phases={"forward": 0.0, "backward": 0.5}, time=1.7e9)) is None


@pytest.mark.parametrize("phases, t, time, field", [
    ({"forward": math.nan}, 0.01, 0.0, "measurements[1].phases.forward"),
    ({}, 1e308, 0.0, "measurements[1].step_time_s"),
    ({}, 0.01, math.nan, "measurements[1].time"),
])
async def test_service_refuses_and_persists_nothing(tmp_path, phases, t, time, field):
    async with Est(tmp_path) as e:
        batch = [step(1), step(2, t=t, phases=phases, time=time)]
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await e.stub.ReportMeasurements(iter([estimator_pb2.MeasurementBatch(measurements=batch)]))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith(field + ":")
        assert e.store.watermark(SRC) == 0 and e.store.count == 0


def test_summarize_is_overflow_safe_and_finite():
    s = summarize([StepSample(1e308, {"forward": 1e308, "bad": math.nan}, t) for t in (1.0, math.nan, 2.0)])
    assert s.mean_step_time_s == pytest.approx(1e308) and math.isfinite(s.p90_step_time_s)
    assert s.mean_phases == {"forward": pytest.approx(1e308)} and s.last_time == 2.0


def test_profiles_median_is_overflow_safe():
    key = ("j1", "cpu", "m4x128", 4, 128, 4, 256, 64, 16, 1, 1.0)
    ps = models.profiles({key: {i: 1.7e308 for i in range(1, 7)}})
    assert len(ps) == 1 and ps[0].median_s == 1.7e308 and math.isfinite(ps[0].spread)
    assert models._median([1.7e308, 1.7e308]) == 1.7e308


async def test_non_finite_snapshot_is_never_published(tmp_path, monkeypatch):
    """A refit whose snapshot is not finite JSON keeps the last good model (and writes nothing)."""

    class Bad(models.PerfModel):
        def to_dict(self):
            d = super().to_dict()
            d["poison"] = math.inf
            return d

    class Store:
        model_revision, runs, run_fb, comm_rows, colocation_rows, rank_rows, count = 1, {}, {}, [], [], [], 0

    monkeypatch.setattr(models, "build_model", lambda runs, comm, colo, version, fb=None, ranks=None: Bad(version=version))
    k = models.ModelKeeper(Store(), tmp_path, min_refit_interval_s=0)
    m = await k.current()
    assert m.version == 0 and k.stale and not (tmp_path / models.MODEL_NAME).exists()
    json.dumps(m.to_dict(), allow_nan=False)
