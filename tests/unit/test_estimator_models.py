"""estimator/models.py: which measurements become profiles, and the profile fallback
of the pure model."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator.models import MIN_MEASURED, WARMUP_STEPS, build_model, comm_row, profiles, run_key
from tessera.api.v1 import profiler_pb2
from tessera.perfmodel import Candidate, PerfModel

LABELS = {"module": "gpt:l2-h64-a4-s32-v256", "workload_type": "gpt", "layers": "2", "hidden": "64", "heads": "4",
          "vocab": "256", "seq_len": "32", "batch": "8", "dp": "1", "tp": "1", "pp": "1", "micro_batches": "1",
          "threads": "1", "world_size": "1", "device_kind": "cpu", "rank": "0"}


def step(job="j1", i=1, t=0.01, **labels):
    return profiler_pb2.Measurement(kind="step", job_id=job, step=i, step_time_s=t, labels={**LABELS, **labels})


def test_only_single_device_gpt_runs_with_labels_are_profiles():
    assert run_key(step()) == ("j1", "cpu", LABELS["module"], 2, 64, 4, 256, 32, 8, 1, 1.0)
    assert run_key(step(world_size="2")) is None          # a rank of a multi-rank plan
    assert run_key(step(rank="1")) is None
    assert run_key(step(workload_type="peft")) is None     # a peft run must carry its shape key
    assert run_key(step(module="peft:l2-h64-a4-s32-v256:w0123456789ab")) is None  # a gpt run under a peft key
    assert run_key(step(hidden="0")) is None
    assert run_key(step(t=0.0)) is None
    assert run_key(profiler_pb2.Measurement(kind="step", job_id="j", step=1, step_time_s=0.1)) is None  # old agent


PEFT = "peft:l2-h64-a4-s32-v256:w0123456789ab"


def test_peft_and_multimodal_runs_are_profiles_of_their_shape_key_on_rank_0_of_any_world():
    assert run_key(step(workload_type="peft", module=PEFT))[:3] == ("j1", "cpu", PEFT)
    mm = "multimodal:l2-h64-a4-s32-v256:wba9876543210"
    assert run_key(step(workload_type="multimodal", module=mm, world_size="2"))[2] == mm
    assert run_key(step(workload_type="multimodal", module=mm, world_size="2", rank="1")) is None
    assert run_key(step(workload_type="multimodal", module=PEFT)) is None       # key of another workload
    assert run_key(step(workload_type="peft", module=PEFT, world_size="0")) is None
    assert run_key(step(workload_type="peft", module="")) is None              # an executor whose tasks changed


def test_the_compute_curve_is_fitted_on_gpt_profiles_only_and_peft_answers_from_its_own():
    gpt = {run_key(step(job=f"g{i}", batch=str(b), layers=str(l), hidden=str(h))): {k: 1e-4 * b * l * h / 64 + 1e-3
                                                                                      for k in range(1, 7)}
           for i, (b, l, h) in enumerate([(b, l, h) for b in (2, 4, 8, 16) for l, h in ((1, 32), (2, 64), (4, 64))])}
    peft = {run_key(step(job="p", workload_type="peft", module=PEFT, threads="2")): {k: 5.0 for k in range(1, 7)}}
    with_peft = build_model({**gpt, **peft}, [], [], 1)
    alone = build_model(gpt, [], [], 1)
    assert with_peft.compute["cpu"].status == "ok"
    assert with_peft.compute["cpu"].coef == alone.compute["cpu"].coef      # a 5 s peft step did not move the curve
    assert PEFT not in with_peft.compute["cpu"].modules
    e = with_peft.estimate(Candidate(device_type="cpu", layers=2, hidden=64, heads=4, vocab=256, seq_len=32, batch=8,
                                     quota=2.0, module=PEFT))
    assert e.ok and e.seconds == 5.0
    assert with_peft.estimate(Candidate(device_type="cpu", layers=2, hidden=64, heads=4, vocab=256, seq_len=32,
                                        batch=8, quota=1.0, module=PEFT)).seconds > 5.0   # scaled to fewer cores


def test_profile_is_median_after_warmup_and_needs_enough_steps():
    times = [1.0, 0.5] + [0.010, 0.012, 0.011, 0.013, 0.011]  # two slow warm-up steps
    runs = {run_key(step()): {i + 1: t for i, t in enumerate(times)}}
    (p,) = profiles(runs)
    assert p.steps == len(times) - WARMUP_STEPS and p.median_s == pytest.approx(0.011)
    assert 0 < p.spread < 0.3 and p.rows == 8 and p.quota == 1.0
    short = {run_key(step()): {i + 1: 0.01 for i in range(WARMUP_STEPS + MIN_MEASURED - 1)}}
    assert profiles(short) == []


def test_a_peft_profile_is_the_mean_step_where_a_gpt_one_is_the_median():
    """A temporal LoRA job alternates its tasks: 5 measured steps of tasks costing 10 and
    30 ms are 3 of one and 2 of the other, and their median is one task's step."""
    times = [1.0, 0.5] + [0.010, 0.030, 0.010, 0.030, 0.010]
    gpt = {run_key(step()): {i + 1: t for i, t in enumerate(times)}}
    peft = {run_key(step(job="p", workload_type="peft", module=PEFT)): {i + 1: t for i, t in enumerate(times)}}
    (g,), (p,) = profiles(gpt), profiles(peft)
    assert g.median_s == pytest.approx(0.010) and p.median_s == pytest.approx(0.018)
    assert p.spread == pytest.approx((np.percentile(times[2:], 90) - np.percentile(times[2:], 10)) / 0.018)
    assert build_model(peft, [], [], 1).profiles["cpu"][0].seconds == pytest.approx(0.018)


def test_malformed_comm_rows_are_ignored():
    ok = profiler_pb2.Measurement(kind="comm", labels={"op": "all_reduce", "link": "lo"},
                                  values={"bytes": 4096, "world": 2, "seconds": 1e-4})
    assert comm_row(ok) == {"link": "lo", "op": "all_reduce", "bytes": 4096.0, "world": 2, "seconds": 1e-4}
    bad = profiler_pb2.Measurement(kind="comm", labels={"op": "all_reduce", "link": "lo"}, values={"world": 1, "seconds": 1e-4})
    assert comm_row(bad) is None


def test_sync_rows_carry_their_compute_and_give_the_straggler_term():
    rows = [comm_row(profiler_pb2.Measurement(kind="comm", labels={"op": "sync", "link": "lo"},
                                              values={"bytes": 8, "world": 2, "seconds": 2e-4 + 0.05 * c,
                                                      "compute_s": c})) for c in (5e-4, 8e-3)]
    assert [r["compute_s"] for r in rows] == [5e-4, 8e-3]
    plain = [comm_row(profiler_pb2.Measurement(kind="comm", labels={"op": "all_reduce", "link": "lo"},
                                               values={"bytes": b, "world": 2, "seconds": 1e-4 + b * 1e-9}))
             for b in (4096, 1 << 20)]
    model = build_model({}, rows + plain, [], 1)
    assert model.comm["lo"].sync["kappa"] == pytest.approx(0.05, rel=1e-6)


def test_resume_rows_reach_the_comm_fit():
    """profilerd's ``--sync`` table carries ``op="resume"`` rows (bytes 0): the store's row
    parser keeps them and the fit prices their mean on every blocking op."""
    rows = [comm_row(profiler_pb2.Measurement(kind="comm", labels={"op": "resume", "link": "lo"},
                                              values={"bytes": 0, "world": 2, "seconds": s})) for s in (6e-5, 1e-4)]
    assert all(r is not None and r["op"] == "resume" for r in rows)
    plain = [comm_row(profiler_pb2.Measurement(kind="comm", labels={"op": "all_reduce", "link": "lo"},
                                               values={"bytes": b, "world": 2, "seconds": 1e-4 + b * 1e-9}))
             for b in (4096, 1 << 20)]
    model = build_model({}, rows + plain, [], 1)
    assert model.comm["lo"].resume_time() == pytest.approx(8e-5)


def test_refill_rows_reach_the_comm_fit_with_their_wait():
    """profilerd's ``--sync`` table carries one ``op="refill"`` row with ``idle_s``: the
    store's row parser keeps the wait, and the fit prices the refill from it; a wait that
    is not a number makes the row malformed (None)."""
    import math

    from tessera.perfmodel.comm import REFILL_TAU0

    rows = [comm_row(profiler_pb2.Measurement(kind="comm", labels={"op": "refill", "link": "lo"},
                                              values={"bytes": 0, "world": 2, "seconds": 4e-4, "idle_s": 0.01}))]
    assert rows[0] is not None and rows[0]["idle_s"] == 0.01
    plain = [comm_row(profiler_pb2.Measurement(kind="comm", labels={"op": "all_reduce", "link": "lo"},
                                               values={"bytes": b, "world": 2, "seconds": 1e-4 + b * 1e-9}))
             for b in (4096, 1 << 20)]
    model = build_model({}, rows + plain, [], 1)
    assert model.comm["lo"].refill["r_max"] == pytest.approx(4e-4 / -math.expm1(-0.01 / REFILL_TAU0))
    assert comm_row(profiler_pb2.Measurement(kind="comm", labels={"op": "refill", "link": "lo"},
                                             values={"bytes": 0, "world": 2, "seconds": 4e-4,
                                                     "idle_s": float("nan")})) is None


def test_profile_points_answer_exactly_their_configuration_and_survive_the_snapshot():
    runs = {run_key(step()): {i: 0.02 for i in range(1, 9)}}
    model = PerfModel.from_dict(build_model(runs, [], [], version=4).to_dict())
    assert model.version == 4 and model.compute["cpu"].status == "insufficient_data"
    c = Candidate(device_type="cpu", layers=2, hidden=64, heads=4, vocab=256, seq_len=32, batch=8,
                  module=LABELS["module"])
    e = model.estimate(c)
    assert e.ok and e.seconds == pytest.approx(0.02) and e.rel_std == pytest.approx(0.03)  # zero spread: the prior
    assert e.confidence == pytest.approx(math.erf(0.1 / (math.sqrt(2) * 0.03)))
    for other in (Candidate(**{**c.__dict__, "batch": 16}), Candidate(**{**c.__dict__, "quota": 2.0}),
                  Candidate(**{**c.__dict__, "module": "other"}), Candidate(**{**c.__dict__, "colocated": 2}),
                  Candidate(**{**c.__dict__, "dp": 2, "batch": 16, "link": "lo"})):
        got = model.estimate(other)
        assert got.status == "insufficient_data" and math.isnan(got.seconds)


def test_data_parallel_plan_composes_the_per_rank_profile_and_the_allreduce():
    from tessera.perfmodel.comm import steps_and_volume
    from tessera.perfmodel.features import stage_params

    alpha, beta = 100e-6, 1 / 1e9
    rows = []
    for nbytes in (4 << 10, 256 << 10, 4 << 20):
        st, vol = steps_and_volume("all_reduce", 2, nbytes)
        rows.append({"link": "lo", "op": "all_reduce", "bytes": nbytes, "world": 2, "seconds": alpha * st + beta * vol})
    runs = {run_key(step()): {i: 0.02 for i in range(1, 9)}}  # the per-rank shape: 8 rows
    model = build_model(runs, rows, [], version=1)
    c = Candidate(device_type="cpu", layers=2, hidden=64, heads=4, vocab=256, seq_len=32, batch=16, dp=2, link="lo",
                  module=LABELS["module"])
    e = model.estimate(c)
    grad_bytes = 4 * stage_params(2, 64, 256, 32, 1, 1)
    expect = 0.02 + (2 * alpha + grad_bytes * beta) + (2 * alpha + 16 * beta)  # ring all-reduce over 2 ranks
    assert e.ok and e.seconds == pytest.approx(expect, rel=1e-6)
    assert e.breakdown["grad_allreduce"] > e.breakdown["loss_allreduce"] > 0
    assert model.estimate(Candidate(**{**c.__dict__, "link": "other"})).status == "insufficient_data"
    assert model.estimate(Candidate(**{**c.__dict__, "dp": 1, "pp": 2, "batch": 8})).status == "insufficient_data"


# --- malformed measurements are never model inputs, never a crash (review: total parsing)

@pytest.mark.parametrize("labels,t", [({"world_size": "inf"}, 0.01), ({"world_size": "1e400"}, 0.01),
                                      ({"threads": "x"}, 0.01), ({"threads": "nan"}, 0.01), ({"threads": "0"}, 0.01),
                                      ({"layers": "nan"}, 0.01), ({"batch": "1e300"}, 0.01), ({}, math.nan),
                                      ({}, math.inf), ({}, -1.0)])
def test_run_key_is_total_and_needs_finite_positive_numbers(labels, t):
    assert run_key(step(t=t, **labels)) is None


def test_comm_and_colocation_rows_are_total():
    from estimator.models import colocation_row

    def comm(**values):
        return profiler_pb2.Measurement(kind="comm", labels={"op": "all_reduce", "link": "l"},
                                        values={"world": 2, "seconds": 1e-3, "bytes": 10, **values})

    assert comm_row(comm())["world"] == 2
    for bad in ({"world": math.nan}, {"world": math.inf}, {"seconds": math.nan}, {"bytes": math.inf},
                {"bytes": math.nan}, {"compute_s": math.nan}, {"world": 1e300}):
        assert comm_row(comm(**bad)) is None, bad

    def colo(**values):
        return profiler_pb2.Measurement(kind="colocation", labels={"mode": "split"},
                                        values={"alone_s": 1.0, "together_s": 1.1, **values})

    assert colocation_row(colo())["colocated"] == 2
    for bad in ({"colocated": math.nan}, {"colocated": math.inf}, {"oversubscription": math.nan},
                {"alone_s": math.inf}, {"together_s": math.nan}):
        assert colocation_row(colo(**bad)) is None, bad


def test_malformed_names_the_field():
    from estimator.models import malformed
    assert malformed(step()) is None
    assert malformed(step(world_size="2")) is None  # not a model input, but not malformed
    assert malformed(step(world_size="inf")).startswith("labels.world_size:")
    assert malformed(step(threads="x")).startswith("labels.threads:")
    assert malformed(step(t=math.nan)).startswith("step_time_s:")
    m = profiler_pb2.Measurement(kind="comm", labels={"op": "all_reduce", "link": "l"},
                                 values={"world": math.nan, "seconds": 1e-3})
    assert malformed(m).startswith("values.world:")


def test_api_validate_refuses_malformed_measurement():
    from estimator.api import validate
    m = step(threads="x")
    m.source, m.seq = "p", 1
    assert validate(m, 3) == "measurements[3].labels.threads: must be a finite number, got 'x' (seq 1)"
    ok = step()
    ok.source, ok.seq = "p", 1
    assert validate(ok, 0) is None


async def test_bad_records_never_brick_the_store(tmp_path):
    from estimator.store import MeasurementStore
    s = MeasurementStore(tmp_path)
    bad = [step(world_size="inf"), step(threads="x"), step(t=math.nan),
           profiler_pb2.Measurement(kind="comm", labels={"op": "all_reduce", "link": "l"},
                                    values={"world": math.nan, "seconds": 1e-3, "bytes": 10})]
    for i, m in enumerate(bad):
        m.source, m.seq = "q", i + 1
        assert await s.append([m]) == (1, 0)  # stored (watermark), not a model input
    assert s.runs == {} and s.comm_rows == [] and s.model_revision == 0
    s.close()
    s2 = MeasurementStore(tmp_path)  # replays them
    assert s2.watermark("q") == 4 and s2.runs == {}
    s2.close()


async def test_record_that_cannot_be_indexed_is_not_persisted_and_replay_skips_it(tmp_path, monkeypatch):
    from estimator import store as store_mod
    from estimator.store import LOG_NAME, MeasurementStore, encode, read_log
    m = step()
    m.source, m.seq = "q", 1

    def boom(_m):
        raise ValueError("cannot index")

    monkeypatch.setattr(store_mod.models, "run_key", boom)
    s = MeasurementStore(tmp_path)
    with pytest.raises(ValueError, match="nothing of this batch was persisted"):
        await s.append([m])
    assert read_log(tmp_path / LOG_NAME)[0] == [] and s.watermark("q") == 0
    s.close()
    # A bad record already in the log (an older version wrote it): replay skips it, keeps the watermark.
    (tmp_path / LOG_NAME).write_bytes(encode(m))
    s2 = MeasurementStore(tmp_path)
    assert s2.watermark("q") == 1 and s2.runs == {}
    s2.close()


def test_build_model_survives_a_failing_device_fit(monkeypatch):
    import estimator.models as em
    good = {run_key(step(job=f"j{i}", batch=str(8 * (i + 1)))): {k: 0.01 for k in range(1, 7)} for i in range(2)}
    bad = {run_key(step(job="k", device_kind="gpu")): {k: 0.01 for k in range(1, 7)}}
    real = em.fit_compute

    def fit(dev, samples):
        if dev == "gpu":
            raise np.linalg.LinAlgError("SVD did not converge")
        return real(dev, samples)

    monkeypatch.setattr(em, "fit_compute", fit)
    m = build_model({**good, **bad}, [], [], 1)
    assert m.compute["gpu"].status == "insufficient_data" and "failed" in m.compute["gpu"].reason
    assert set(m.compute) == {"cpu", "gpu"} and len(m.profiles["cpu"]) == 2


async def test_a_model_version_is_durable_before_it_is_served(tmp_path, monkeypatch):
    """A refit whose model.json cannot be written (disk full) serves nothing new and stays
    stale (the next call retries) — and does not fail the call: the last durable model is
    served, with a warning; the version then issued is the next one, once, and a restarted
    keeper loads exactly it. (Until 2026-12-07 the OSError propagated out of current(), so
    every model RPC failed with UNKNOWN while the disk was full.)"""
    import os as _os

    import structlog

    from estimator.models import ModelKeeper
    from estimator.store import MeasurementStore

    store = MeasurementStore(tmp_path)
    await store.append([profiler_pb2.Measurement(source="s", seq=i, kind="step", job_id="j1", step=i,
                                                 step_time_s=0.01, labels=LABELS) for i in range(1, 8)])
    keeper = ModelKeeper(store, tmp_path, min_refit_interval_s=0)
    real = _os.replace

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_os, "replace", full_disk)
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):  # every call refits again, and still serves the durable model
            served = await keeper.current()
            assert served is keeper.model and served.version == 0
    assert keeper.stale and not (tmp_path / "model.json").exists()
    warned = [e for e in logs if e["event"].startswith("model not persisted")]
    assert len(warned) == 2 and all(e["log_level"] == "warning" and "No space" in e["error"] for e in warned)
    monkeypatch.setattr(_os, "replace", real)
    m = await keeper.current()
    assert m.version == 1 and not keeper.stale
    again = ModelKeeper(store, tmp_path, min_refit_interval_s=0)
    assert again.model.version == 1 and again.model.to_dict() == m.to_dict()
    store.close()


async def test_a_model_fitted_under_other_feature_counts_is_refitted_after_a_restart(tmp_path):
    """A persisted snapshot whose compute fits priced another revision of the feature counts
    (an upgrade changed them) is served only until the refit from the measurement log,
    which its load forces; the refit is a new version under the current counts. A
    snapshot that predates the field counts as revision 1."""
    import json

    from estimator.models import ModelKeeper
    from estimator.store import MeasurementStore
    from tessera.perfmodel.features import FEATURES_REV

    store = MeasurementStore(tmp_path)
    await store.append([profiler_pb2.Measurement(source="s", seq=i, kind="step", job_id="j1", step=i,
                                                 step_time_s=0.01, labels=LABELS) for i in range(1, 8)])
    keeper = ModelKeeper(store, tmp_path, min_refit_interval_s=0)
    m = await keeper.current()
    assert m.version == 1 and m.compute["cpu"].features == FEATURES_REV
    assert ModelKeeper(store, tmp_path, min_refit_interval_s=0).stale is False
    doc = json.loads((tmp_path / "model.json").read_text())
    del doc["snapshot"]["compute"]["cpu"]["features"]
    (tmp_path / "model.json").write_text(json.dumps(doc))
    again = ModelKeeper(store, tmp_path, min_refit_interval_s=0)
    assert again.model.version == 1 and again.model.compute["cpu"].features == 1 and again.stale
    m2 = await again.current()
    assert m2.version == 2 and m2.compute["cpu"].features == FEATURES_REV and not again.stale
    store.close()


async def test_a_model_fitted_under_other_fitting_rules_is_refitted_after_a_restart(tmp_path):
    """model.json records the fitting rules' revision (``FIT_REV``) it was fitted under;
    one fitted under others (an upgrade changed what the comm or rank fits make of the
    same measurements), or persisted before the field (revision 1), is served only until
    the refit from the log that its load forces; a current one is not refitted."""
    import json

    from estimator.models import ModelKeeper
    from estimator.store import MeasurementStore
    from tessera.perfmodel import FIT_REV

    store = MeasurementStore(tmp_path)
    await store.append([profiler_pb2.Measurement(source="s", seq=i, kind="step", job_id="j1", step=i,
                                                 step_time_s=0.01, labels=LABELS) for i in range(1, 8)])
    keeper = ModelKeeper(store, tmp_path, min_refit_interval_s=0)
    m = await keeper.current()
    doc = json.loads((tmp_path / "model.json").read_text())
    assert doc["fit_rev"] == FIT_REV >= 2 and ModelKeeper(store, tmp_path, min_refit_interval_s=0).stale is False
    for old in (None, FIT_REV - 1):
        if old is None:
            doc.pop("fit_rev")
        else:
            doc["fit_rev"] = old
        (tmp_path / "model.json").write_text(json.dumps(doc))
        again = ModelKeeper(store, tmp_path, min_refit_interval_s=0)
        assert again.stale and again.model.version == m.version  # served meanwhile
        assert (await again.current()).version == m.version  # the same inputs fit the same snapshot
        assert not again.stale and json.loads((tmp_path / "model.json").read_text())["fit_rev"] == FIT_REV
    # A fit_rev that is no integer is an unreadable file: moved aside and refitted, not a crash.
    (tmp_path / "model.json").write_text(json.dumps({**doc, "fit_rev": "two"}))
    bad = ModelKeeper(store, tmp_path, min_refit_interval_s=0)
    assert bad.stale and list(tmp_path.glob("model.json.corrupt-*"))
    assert (await bad.current()).version > m.version  # versions resume above the file's
    store.close()


def test_malformed_is_the_shared_check_profilerd_applies_too():
    import estimator.api
    import estimator.models
    import tessera.measurement
    assert estimator.models.malformed is tessera.measurement.malformed is estimator.api.malformed
    assert estimator.models.RUN_INTS == tessera.measurement.RUN_INTS
    m = profiler_pb2.Measurement(source="s", seq=4, kind="step", step_time_s=math.inf)
    assert estimator.api.validate(m, 2) == "measurements[2].step_time_s: must be a finite number in [0, 1e+06] seconds, got inf (seq 4)"


# --- one extreme but finite row never freezes the model (review: a row at 5e-324 s)

def _link_rows(link: str) -> list[dict]:
    from tessera.perfmodel.comm import steps_and_volume

    rows = []
    for op in ("all_reduce", "send_recv"):
        for nbytes in (4 << 10, 256 << 10, 4 << 20):
            st, vol = steps_and_volume(op, 2, nbytes)
            rows.append({"link": link, "op": op, "bytes": nbytes, "world": 2, "seconds": float(50e-6 * st + vol / 2e9)})
    return rows


EXTREME_COLO = [{"device_kind": "cpu", "mode": "shared", "colocated": 2, "oversubscription": 2.0, "alone_s": 1.0,
                 "together_s": 2.3},
                {"device_kind": "cpu", "mode": "split", "colocated": 2, "oversubscription": 1.0, "alone_s": 5e-324,
                 "together_s": 0.03}]  # together / alone: inf
EXTREME_COMM = (_link_rows("lo") + [{"link": "lo", "op": "refill", "bytes": 0, "world": 2, "seconds": 4e-4,
                                     "idle_s": 1e-320}]  # seconds / (1 - exp(-idle / tau)): inf
                + _link_rows("hi") + [{"link": "hi", "op": "all_reduce", "bytes": 1 << 20, "world": 2,
                                       "seconds": 5e-324}])  # the all-reduce fit raises LinAlgError


def test_one_extreme_row_leaves_out_only_its_own_fit_with_a_warning():
    import json

    import structlog

    runs = {run_key(step()): {i: 0.02 for i in range(1, 9)}}
    with structlog.testing.capture_logs() as logs:
        m = build_model(runs, EXTREME_COMM, EXTREME_COLO, 1)
    json.dumps(m.to_dict(), allow_nan=False)  # publishable
    assert m.interference == {"cpu": {"shared": pytest.approx(0.15)}}
    assert m.comm["lo"].refill == {} and set(m.comm["lo"].ops) == {"all_reduce", "send_recv"}
    assert set(m.comm["hi"].ops) == {"send_recv"}  # its all-reduce only; before: the whole link was dropped
    clean = build_model(runs, _link_rows("lo") + _link_rows("hi"), EXTREME_COLO[:1], 1)
    assert m.comm["lo"].to_dict() == clean.comm["lo"].to_dict()  # the parts kept are the same numbers
    assert m.comm["hi"].ops["send_recv"] == clean.comm["hi"].ops["send_recv"]
    warned = {(e["event"], e.get("link"), e.get("op"), e.get("mode")) for e in logs if e["log_level"] == "warning"}
    assert warned == {("interference fit is not finite; left out", None, None, "split"),
                      ("communication fit is not finite; left out", "lo", "refill", None),
                      ("communication fit failed; left out", "hi", "all_reduce", None)}


def test_a_compute_fit_that_is_not_finite_is_insufficient_data_not_a_frozen_model(monkeypatch):
    import json

    import estimator.models as em
    from tessera.perfmodel import ComputeFit

    def fit(dev, samples):
        return ComputeFit(device_type=dev, coef={"c_flops": math.inf}, status="ok", n=len(samples))

    monkeypatch.setattr(em, "fit_compute", fit)
    m = build_model({run_key(step()): {i: 0.02 for i in range(1, 9)}}, [], [], 1)
    assert m.compute["cpu"].status == "insufficient_data" and "not finite" in m.compute["cpu"].reason
    json.dumps(m.to_dict(), allow_nan=False)
    assert len(m.profiles["cpu"]) == 1  # its profile points still answer


async def test_an_extreme_row_does_not_stop_every_refit(tmp_path):
    """Before: _canonical raised on the fitted inf and every refit was refused ("keeping the
    current model") for as long as the row stayed in the log."""
    from estimator.models import ModelKeeper

    class Store:
        model_revision, run_fb, count = 1, {}, 3
        runs = {run_key(step()): {i: 0.02 for i in range(1, 9)}}
        comm_rows, colocation_rows, rank_rows = EXTREME_COMM, EXTREME_COLO, []

    keeper = ModelKeeper(Store(), tmp_path, min_refit_interval_s=0)
    m = await keeper.current()
    assert m.version == 1 and not keeper.stale and m.interference["cpu"] == {"shared": pytest.approx(0.15)}


@pytest.mark.parametrize("kind,values,field", [
    ("comm", {"seconds": 5e-324}, "values.seconds"),
    ("comm", {"seconds": 1e-4, "idle_s": 1e-320}, "values.idle_s"),
    ("comm", {"seconds": 1e-4, "compute_s": 1e-12}, "values.compute_s"),
    ("colocation", {"alone_s": 5e-324}, "values.alone_s"),
    ("colocation", {"together_s": 1e-10}, "values.together_s"),
])
def test_a_time_below_a_nanosecond_is_malformed_and_no_row(kind, values, field):
    from estimator.models import colocation_row
    from tessera.measurement import MIN_TIME_S, malformed

    base = ({"bytes": 4096, "world": 2, "seconds": 1e-4} if kind == "comm"
            else {"colocated": 2, "oversubscription": 1.0, "alone_s": 0.02, "together_s": 0.03})
    labels = {"op": "all_reduce", "link": "l"} if kind == "comm" else {"mode": "split", "device_kind": "cpu"}
    ok = profiler_pb2.Measurement(kind=kind, labels=labels, values=base)
    bad = profiler_pb2.Measurement(kind=kind, labels=labels, values={**base, **values})
    row = comm_row if kind == "comm" else colocation_row
    assert malformed(ok) is None and row(ok) is not None
    assert malformed(bad).startswith(f"{field}: must be 0 or at least {MIN_TIME_S:g} seconds") and row(bad) is None
    # 0 is no measurement rather than an impossible one: stored, no model input (as before)
    zero = profiler_pb2.Measurement(kind=kind, labels=labels, values={**base, **{k: 0.0 for k in values}})
    assert malformed(zero) is None


def test_colocation_pairs_naming_one_module_shape_make_it_the_interference_reference():
    from estimator.models import colocation_row

    shape = {"layers": "2", "hidden": "64", "heads": "4", "vocab": "256", "rows": "8", "seq": "64"}

    def colo(mode, together, **labels):
        return colocation_row(profiler_pb2.Measurement(
            kind="colocation", labels={"mode": mode, "device_kind": "cpu", **labels},
            values={"colocated": 2, "oversubscription": 2.0 if mode == "shared" else 1.0, "alone_s": 0.01,
                    "together_s": together}))

    split, shared = colo("split", 0.011, **shape), colo("shared", 0.023, **shape)
    assert split["ref"] == {k: int(v) for k, v in shape.items()}
    m = build_model({}, [], [split, shared], version=1)
    assert m.interference["cpu"] == pytest.approx({"split": 0.1, "shared": 0.15})
    assert m.interference_ref["cpu"] == {k: float(v) for k, v in shape.items()}
    assert PerfModel.from_dict(m.to_dict()).interference_ref == m.interference_ref
    # A row naming no shape (or a partial or nonsensical one), or two shapes: g as fitted.
    for other in (colo("split", 0.011), colo("split", 0.011, **{**shape, "rows": "0"}),
                  colo("split", 0.011, **{**shape, "hidden": "128"})):
        m = build_model({}, [], [other, shared], version=1)
        assert "split" in m.interference["cpu"] and m.interference_ref == {}, other


def test_a_step_measured_beside_other_jobs_is_no_profile_of_the_module_alone():
    from tessera.measurement import malformed

    assert run_key(step(colocated="1")) == run_key(step())   # alone (an older agent says nothing: alone)
    assert run_key(step(colocated="2")) is None               # another job ran on its partition
    assert "labels.colocated" in malformed(step(colocated="two"))
    # A run that shared its partition for a while: only its steps alone make the profile.
    steps = [step(i=i, t=0.01 if i < 8 else 0.03, colocated="1" if i < 8 else "2") for i in range(1, 14)]
    runs: dict = {}
    for m in steps:
        k = run_key(m)
        if k is not None:
            runs.setdefault(k, {})[m.step] = m.step_time_s
    (only,) = profiles(runs)
    assert only.median_s == pytest.approx(0.01) and only.steps == 5  # steps 3-7: warm-up 1-2 out


# --- rank profiles (kind="ranks"): the rank modes' interference, fitted by the estimator

RANK_LABELS = {"mode": "ranks", "device_kind": "cpu", "link": "lo", "layers": "2", "hidden": "64", "heads": "4",
               "vocab": "256", "seq_len": "64", "batch": "8", "seq": "64", "dp": "1", "tp": "1", "pp": "2",
               "micro_batches": "1"}


def rank_meas(seconds=0.02, quota=1.0, **labels):
    return profiler_pb2.Measurement(kind="ranks", labels={**RANK_LABELS, **labels},
                                    values={"seconds": seconds, "quota": quota})


def test_rank_rows_are_total_and_name_a_shared_device_multi_rank_plan():
    from estimator.models import rank_row
    from tessera.measurement import malformed

    row = rank_row(rank_meas())
    assert row["mode"] == "ranks" and row["link"] == "lo" and row["seconds"] == 0.02
    c = Candidate(**row["candidate"])  # the fields fit_rank_interference takes
    assert (c.pp, c.world, c.colocated, c.quota, c.batch, c.seq, c.seq_len) == (2, 2, 2, 1.0, 8, 64, 64)
    assert rank_row(rank_meas(mode="pipeline"))["mode"] == "pipeline"
    for bad in (rank_meas(mode="split"), rank_meas(pp="1"), rank_meas(layers="x"), rank_meas(hidden="0"),
                rank_meas(batch=""), rank_meas(seconds=0.0), rank_meas(seconds=1e-12), rank_meas(quota=0.0),
                rank_meas(dp="1e300")):
        assert rank_row(bad) is None, bad
    assert malformed(rank_meas(seconds=math.nan)).startswith("values.seconds: must be a finite number")
    assert malformed(rank_meas(seconds=1e-12)).startswith("values.seconds: must be 0 or at least")
    assert malformed(rank_meas(quota=math.inf)).startswith("values.quota: must be a finite number")


def _curve_runs() -> dict:
    """Twelve single-device gpt profile points of two model sizes (times from a smooth
    formula: enough for a fitted compute curve)."""
    runs = {}
    for layers, hidden in ((2, 64), (4, 128)):
        for batch, seq_len, mb, threads in ((4, 32, 1, 1), (16, 64, 1, 1), (32, 32, 1, 1), (8, 64, 2, 1),
                                            (8, 64, 1, 1), (8, 64, 1, 2)):
            t = (1e-3 * layers + 2e-9 * batch * seq_len * layers * hidden * hidden / 64) * (0.6 if threads == 2 else 1)
            lb = {"layers": str(layers), "hidden": str(hidden), "batch": str(batch), "seq_len": str(seq_len),
                  "micro_batches": str(mb), "threads": str(threads), "module": f"gpt:l{layers}-h{hidden}"}
            runs[run_key(step(**lb))] = {i: t * (1 + mb / 20) for i in range(1, 9)}
    return runs


def test_a_rank_profile_gives_the_rank_mode_against_the_models_own_terms():
    """build_model fits a rank row's g with the model it has just fitted (compute curve,
    the link's comm fit): recovered exactly from a time that model made with a known g,
    it then prices the plans whose ranks share the device; without the curve or the
    link's comm fit the row gives nothing (kept for a later refit), and the colocation
    pairs' modes stay as fitted."""
    from estimator.models import rank_row

    runs, comm = _curve_runs(), _link_rows("lo")
    split = {"device_kind": "cpu", "mode": "split", "colocated": 2, "oversubscription": 1.0, "alone_s": 0.01,
             "together_s": 0.0105}
    base = build_model(runs, comm, [split], 1)
    assert base.compute["cpu"].status == "ok" and base.interference["cpu"] == pytest.approx({"split": 0.05})
    c = Candidate(**rank_row(rank_meas())["candidate"])
    truth = PerfModel.from_dict({**base.to_dict(), "interference": {"cpu": {"split": 0.05, "pipeline": 0.2}}})
    t = truth.estimate(c).seconds
    assert t > base.estimate(c).seconds  # priced with the split pair's g before
    m = build_model(runs, comm, [split], 1, rank_rows=[rank_row(rank_meas(seconds=t))])
    # profilerd's row of its 2-stage pipeline (labelled "ranks") fits the pipeline mode:
    # it prices pipelines; a dp plan keeps the split pair's g.
    assert m.interference["cpu"] == pytest.approx({"split": 0.05, "pipeline": 0.2})
    assert m.estimate(c).seconds == pytest.approx(t)
    dp = Candidate(**{**c.__dict__, "pp": 1, "dp": 2, "batch": 16})
    assert m.estimate(dp).seconds == pytest.approx(base.estimate(dp).seconds)
    # No comm fit of the row's link, or no curve yet: nothing fitted, nothing raised.
    other = rank_row(rank_meas(seconds=t, link="elsewhere"))
    assert "pipeline" not in build_model(runs, comm, [split], 1, rank_rows=[other]).interference["cpu"]
    few = dict(list(runs.items())[:3])
    assert build_model(few, comm, [], 1, rank_rows=[rank_row(rank_meas(seconds=t))]).interference == {}
