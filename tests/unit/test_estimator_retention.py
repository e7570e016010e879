"""The estimator store's bounded retention and log compaction: windows cap memory, the
run window keeps warm-up and latest steps, a compacted log replays to the same state,
crashes around a compaction leave a readable log, config errors name the field."""

from __future__ import annotations

import json
import os

import pytest

from estimator import store as store_mod
from estimator.config import EstimatorConfig
from estimator.main import open_store
from estimator.models import WARMUP_STEPS, build_model, profiles, run_key
from estimator.store import LOG_NAME, TMP_NAME, MeasurementStore, Retention, read_log, slots, survivors
from tessera import config
from tessera.api.v1 import profiler_pb2
from tessera.errors import SpecError

LABELS = {"module": "gpt:l2-h64-a4-s32-v256", "workload_type": "gpt", "layers": "2", "hidden": "64", "heads": "4",
          "vocab": "256", "seq_len": "32", "batch": "8", "dp": "1", "tp": "1", "pp": "1", "micro_batches": "1",
          "threads": "1", "world_size": "1", "device_kind": "cpu", "rank": "0"}


def step(source, seq, job="j1", t=0.1, model="gpt:x", i=0, **labels):
    """A step measurement, built like tests/unit/test_estimator_store.py; with labels it is a
    single-device run's step as tests/unit/test_estimator_models.py builds them."""
    return profiler_pb2.Measurement(source=source, seq=seq, kind="step", job_id=job, model_key=model, step=i,
                                    step_time_s=t, phases={"forward": t / 2}, time=float(seq),
                                    labels={**LABELS, **labels} if labels else {})


def comm(source, seq, nbytes=4096, seconds=1e-4, op="all_reduce", link="lo"):
    return profiler_pb2.Measurement(source=source, seq=seq, kind="comm", labels={"op": op, "link": link},
                                    values={"bytes": nbytes, "world": 2, "seconds": seconds})


def colo(source, seq, mode="split", together=0.03):
    return profiler_pb2.Measurement(source=source, seq=seq, kind="colocation", labels={"mode": mode, "device_kind": "cpu"},
                                    values={"colocated": 2, "oversubscription": 1.0, "alone_s": 0.02,
                                            "together_s": together})


def device(source, seq):
    return profiler_pb2.Measurement(source=source, seq=seq, kind="device", values={"cpu_util": 0.5})


def model_json(s: MeasurementStore) -> str:
    d = build_model({k: dict(v) for k, v in s.runs.items()}, s.comm_rows, s.colocation_rows, 1).to_dict()
    d.pop("version")
    return json.dumps(d, sort_keys=True, allow_nan=True)


def state(s: MeasurementStore) -> dict:
    """Everything a restart must rebuild: watermarks, retained samples, model inputs, counters."""
    return {"watermarks": dict(s.watermarks),
            "steps": {k: s.steps(*k) for k in [("j1", ""), ("j2", ""), ("j3", ""), ("", "gpt:x"), ("", "gpt:y"),
                                               ("j1", "gpt:x"), ("j2", "gpt:y")]},
            "runs": {k: dict(v) for k, v in s.runs.items()}, "comm": s.comm_rows, "colo": s.colocation_rows,
            "model": model_json(s), "revision": s.model_revision, "count": s.count, "retained": s.retained}


# --- the pure rule ---------------------------------------------------------------------------

def test_survivors_keep_the_last_n_of_each_key_and_each_sources_last_record():
    r = Retention(step_window=2, run_steps=3, row_window=1)
    recs = [[(("source", "a"), None), (("job", "x"), i)] for i in range(5)]  # a's records 0..4 in job x
    recs.append([(("source", "b"), None), (("job", "y"), 5)])              # 5: b's only record
    recs.append([(("source", "a"), None), (("comm", ("lo", "ar", 8.0, 2)), 6)])
    assert survivors(recs, r) == [3, 4, 5, 6]  # x keeps 3, 4; 5 is b's watermark; 6 a's last and the comm row
    assert survivors([], r) == []


def test_survivors_of_a_run_are_its_warmup_and_latest_steps_last_report_wins():
    r = Retention(run_steps=3)
    key = ("run-key",)
    recs = [[(("run", key), (n, 1.0))] for n in range(1, 11)]  # steps 1..10, indices 0..9
    assert survivors(recs, r) == [0, 1, 7, 8, 9]               # steps 1, 2 (warm-up) and 8, 9, 10
    recs.append([(("run", key), (9, 2.0))])                    # step 9 reported again: the new record holds it
    recs.append([(("run", key), (5, 3.0))])                    # an old step number: nothing to keep
    assert survivors(recs, r) == [0, 1, 7, 9, 10]


def test_retention_limits_must_be_positive():
    with pytest.raises(ValueError, match="row_window"):
        Retention(row_window=0)
    with pytest.raises(ValueError, match="compact_bytes"):
        MeasurementStore("/nonexistent-never-created", compact_bytes=-1)


# --- in-memory windows -----------------------------------------------------------------------

async def test_step_window_caps_memory_to_the_latest(tmp_path):
    s = MeasurementStore(tmp_path, Retention(step_window=100), compact_bytes=0)
    for lo in range(0, 10_000, 1000):
        await s.append([step("a", n + 1, t=float(n + 1)) for n in range(lo, lo + 1000)])
    for got in (s.steps(job_id="j1"), s.steps(model_key="gpt:x"), s.steps("j1", "gpt:x")):
        assert [x.step_time_s for x in got] == [float(n) for n in range(9901, 10_001)]
    assert s.count == 10_000 and s.retained == 100 and s.watermark("a") == 10_000
    assert s.model_revision == 0  # no run labels: these steps are no model input
    s.close()


async def test_run_steps_keeps_warmup_and_latest_and_profile_follows_them(tmp_path):
    s = MeasurementStore(tmp_path, Retention(step_window=1, run_steps=5), compact_bytes=0)
    times = [1.0, 0.5] + [0.01] * 40 + [0.02, 0.021, 0.019, 0.022, 0.02]  # warm-up, then the job slows down
    await s.append([step("a", n, t=t, i=n, world_size="1") for n, t in enumerate(times, 1)])
    (key,) = s.runs
    assert key == run_key(step("a", 1, i=1, world_size="1"))
    assert sorted(s.runs[key]) == list(range(1, WARMUP_STEPS + 1)) + [43, 44, 45, 46, 47]
    (p,) = profiles(s.runs)
    assert p.steps == 5 and p.median_s == pytest.approx(0.02)
    assert s.retained == 7  # the source's latest record is among them
    rev = s.model_revision
    await s.append([step("a", 100, t=0.022, i=46, world_size="1")])  # step 46 resent, same seconds
    await s.append([step("a", 101, t=0.5, i=10, world_size="1")])    # an old step number
    assert s.model_revision == rev and sorted(s.runs[key]) == [1, 2, 43, 44, 45, 46, 47]
    await s.append([step("a", 102, t=0.03, i=48, world_size="1")])
    assert s.model_revision == rev + 1 and sorted(s.runs[key]) == [1, 2, 44, 45, 46, 47, 48]
    assert profiles(s.runs)[0].median_s == pytest.approx(0.021)
    s.close()


async def test_row_windows_per_key(tmp_path):
    s = MeasurementStore(tmp_path, Retention(row_window=3), compact_bytes=0)
    await s.append([comm("a", n, nbytes=4096 if n % 2 else 8192, seconds=n * 1e-6) for n in range(1, 21)])
    await s.append([colo("a", 20 + n, mode="split" if n % 2 else "shared", together=0.03 + n / 1000)
                    for n in range(1, 11)])
    # the last 3 of each size, in arrival order
    assert [(r["bytes"], round(r["seconds"] * 1e6)) for r in s.comm_rows] == [
        (4096.0, 15), (8192.0, 16), (4096.0, 17), (8192.0, 18), (4096.0, 19), (8192.0, 20)]
    assert [r["mode"] for r in s.colocation_rows] == ["split", "shared", "split", "shared", "split", "shared"]
    assert [round(r["together_s"] * 1000) for r in s.colocation_rows] == [35, 36, 37, 38, 39, 40]
    s.close()


async def test_rank_rows_are_model_inputs_kept_per_configuration_across_a_restart(tmp_path):
    """kind="ranks" rows (profilerd.colobench's 2-stage pipeline): the last row_window of
    each configuration are kept, each moves the model's input revision, and a reopened
    store (log replay, then a compaction's rewrite) has the same rows; a row that is no
    rank profile (a world of 1) is stored but no model input."""
    labels = {"mode": "ranks", "device_kind": "cpu", "link": "lo", "layers": "2", "hidden": "64", "heads": "4",
              "vocab": "256", "seq_len": "64", "batch": "8", "seq": "64", "dp": "1", "tp": "1", "pp": "2",
              "micro_batches": "1"}

    def ranks(seq, seconds, **lb):
        return profiler_pb2.Measurement(source="a", seq=seq, kind="ranks", labels={**labels, **lb},
                                        values={"seconds": seconds, "quota": 1.0})

    s = MeasurementStore(tmp_path, Retention(row_window=2), compact_bytes=0)
    await s.append([ranks(n, 0.02 + n / 1000) for n in range(1, 5)] + [ranks(5, 0.05, batch="16")])
    assert [round(r["seconds"] * 1000) for r in s.rank_rows] == [23, 24, 50]
    assert s.rank_rows[-1]["candidate"]["batch"] == 16
    rev = s.model_revision
    await s.append([ranks(6, 0.03, pp="1")])  # world 1: no rank profile
    assert s.model_revision == rev and len(s.rank_rows) == 3
    await s.append([ranks(7, 0.031)])
    assert s.model_revision == rev + 1
    before = s.rank_rows
    s.close()
    r = MeasurementStore(tmp_path, Retention(row_window=2), compact_bytes=0)
    assert r.rank_rows == before
    r.close()
    c = MeasurementStore(tmp_path, Retention(row_window=2), compact_bytes=1)  # compacts on its next append
    await c.append([comm("a", 8)])
    assert c.rank_rows == before and c.compactions >= 1
    c.close()
    again = MeasurementStore(tmp_path, Retention(row_window=2), compact_bytes=0)
    assert again.rank_rows == before
    again.close()


async def test_a_steps_per_module_breakdown_is_no_step_of_the_job(tmp_path):
    """A multimodal step reaches the estimator as the whole step (module "multimodal")
    then one measurement per module (encoder, llm: the step's wall time repeated, the
    module's phases). Only the whole step is a step: GetProfile counts one sample a step
    with the step's phases, and the run's forward + backward is the step's. Before, every
    step was three samples and its profile's phases were the last module's."""
    from estimator.models import profiles
    from estimator.profiles import summarize

    labels = dict(module="multimodal:l2-h64-a4-s64-v128:wabc", workload_type="multimodal")
    s = MeasurementStore(tmp_path, compact_bytes=0)
    recs, seq = [], 0
    for i in range(1, 9):
        for mod, ph in (("multimodal", {"forward": 0.04, "backward": 0.05}),
                        ("encoder", {"forward": 0.01, "backward": 0.02, "idle": 0.0}),
                        ("llm", {"forward": 0.03, "backward": 0.03, "idle": 0.0})):
            seq += 1
            m = step("a", seq, t=0.1, i=i, **labels)
            m.module = mod
            m.phases.clear()
            m.phases.update(ph)
            recs.append(m)
    await s.append(recs)
    got = summarize(s.steps(job_id="j1"))
    assert got.samples == 8 and got.mean_phases == pytest.approx({"forward": 0.04, "backward": 0.05})
    (p,) = profiles(s.runs, s.run_fb)
    assert p.mb_s == pytest.approx(0.09)
    assert s.count == 24 and s.watermark("a") == 24  # received and acknowledged, all of them
    s.close()


# --- compaction --------------------------------------------------------------------------------

def workload() -> list[list[profiler_pb2.Measurement]]:
    """Batches from four sources: two single-device runs that change speed, a multi-rank
    job, comm and colocation rows, and a source that only sends device samples."""
    seq = {"p1": 0, "p2": 0, "p3": 0, "dev": 0}

    def nxt(src):
        seq[src] += 1
        return seq[src]

    batches = []
    for b in range(60):
        batch = []
        for k in range(5):
            n = b * 5 + k + 1
            batch.append(step("p1", nxt("p1"), job="j1", model="gpt:x", t=0.01 if n < 200 else 0.015 + n * 1e-6,
                              i=n, world_size="1"))
            batch.append(step("p1", nxt("p1"), job="j3", model="gpt:x", t=0.02 + (n % 7) * 1e-4, i=n,
                              world_size="1", batch="16"))
            batch.append(step("p2", nxt("p2"), job="j2", model="gpt:y", t=0.05, i=n, world_size="2"))
            batch.append(comm("p2", nxt("p2"), nbytes=(4096, 1 << 16, 1 << 20)[n % 3], seconds=1e-4 + n * 1e-7))
        batch.append(colo("p3", nxt("p3"), mode=("split", "shared")[b % 2], together=0.03 + b * 1e-4))
        if b < 40:  # dev's last record is long evicted from everything but its source window
            batch.append(device("dev", nxt("dev")))
        batches.append(batch)
    return batches


RET = Retention(step_window=50, run_steps=8, row_window=10)


async def test_compaction_shrinks_the_log_and_a_restart_rebuilds_the_same_state(tmp_path):
    plain = MeasurementStore(tmp_path / "plain", RET, compact_bytes=0)
    s = MeasurementStore(tmp_path / "c", RET, compact_bytes=16 << 10)
    written = 0
    for batch in workload():
        await plain.append(batch)
        await s.append(batch)
        # each batch is logged after its receipt marker
        written += sum(len(store_mod.encode(m)) for m in batch) + len(store_mod.encode(store_mod.receipt_marker(1e9)))
    assert s.compactions >= 1 and plain.compactions == 0
    size = (tmp_path / "c" / LOG_NAME).stat().st_size
    assert size < written / 3 and (tmp_path / "plain" / LOG_NAME).stat().st_size == written
    before = state(s)
    assert before == state(plain)  # compacting changes nothing in memory
    assert before["watermarks"]["dev"] == 40 and before["count"] == sum(len(b) for b in workload())
    assert json.loads(before["model"])["profiles"]  # the runs made profile points
    s.close()
    plain.close()

    r = MeasurementStore(tmp_path / "c", RET, compact_bytes=16 << 10)
    assert state(r) == before
    assert await r.append([step("p1", 3), device("dev", 40), device("dev", 12)]) == (0, 3)  # old seqs: duplicates
    assert await r.append([device("dev", 41)]) == (1, 0)
    r.close()


async def test_compacting_at_once_then_appending_replays_identically(tmp_path):
    # compact_bytes=1: compacts whenever half the log is garbage; the
    # checkpoint record keeps count and model_revision moving as without compaction.
    s = MeasurementStore(tmp_path / "c", RET, compact_bytes=1)
    plain = MeasurementStore(tmp_path / "p", RET, compact_bytes=0)
    for batch in workload()[:40]:
        await s.append(batch)
        await plain.append(batch)
    assert s.compactions >= 2 and state(s) == state(plain)
    s.close()
    r = MeasurementStore(tmp_path / "c", RET, compact_bytes=0)
    for batch in workload()[40:]:
        await r.append(batch)
        await plain.append(batch)
    assert state(r) == state(plain)
    r.close()
    plain.close()
    r2 = MeasurementStore(tmp_path / "c", RET, compact_bytes=0)
    assert state(r2) == state(r)
    r2.close()


async def test_torn_tail_after_compaction_is_truncated(tmp_path):
    s = MeasurementStore(tmp_path, RET, compact_bytes=4096)
    for batch in workload()[:30]:
        await s.append(batch)
    assert s.compactions >= 1
    before = state(s)
    s.close()
    path = tmp_path / LOG_NAME
    good = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")  # a crash mid-write
    r = MeasurementStore(tmp_path, RET, compact_bytes=0)
    assert path.stat().st_size == good and state(r) == before
    assert await r.append([device("dev", 1000)]) == (1, 0)
    r.close()
    records, end = read_log(path)
    assert end == path.stat().st_size and records[-1].seq == 1000


async def test_interrupted_compaction_leaves_the_old_log(tmp_path, monkeypatch):
    s = MeasurementStore(tmp_path, RET, compact_bytes=0)
    for batch in workload()[:30]:
        await s.append(batch)
    before = state(s)
    s.close()
    stray = tmp_path / TMP_NAME
    stray.write_bytes(b"half of a compacted log")  # a crash after writing the temp file, before the replace
    r = MeasurementStore(tmp_path, RET, compact_bytes=0)
    assert not stray.exists() and state(r) == before
    r.close()

    # A compaction that fails at the replace: logged, the batch stays durable, the old log serves on.
    r = MeasurementStore(tmp_path, RET, compact_bytes=1)

    def broken(*a, **k):
        raise OSError("disk went away")

    monkeypatch.setattr(store_mod.os, "replace", broken)
    assert await r.append([device("dev", 1000)]) == (1, 0)
    assert r.compactions == 0 and not stray.exists()
    monkeypatch.undo()
    assert await r.append([device("dev", 1001)]) == (1, 0)  # now it compacts
    assert r.compactions == 1
    after = state(r)
    r.close()
    r2 = MeasurementStore(tmp_path, RET, compact_bytes=0)
    assert state(r2) == after and r2.watermark("dev") == 1001
    r2.close()


# --- configuration -----------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("step_window", 0), ("run_steps", 2), ("row_window", 0),
                                         ("compact_bytes", -1)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(SpecError) as e:
        EstimatorConfig(**{field: value})
    assert e.value.field == field


def test_config_precedence_and_wiring(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("TESSERA_ESTIMATOR_")]:
        monkeypatch.delenv(k)
    f = tmp_path / "est.yaml"
    f.write_text(f"state_dir: {tmp_path / 'st'}\nstep_window: 10\nrun_steps: 9\nrow_window: 8\ncompact_bytes: 0\n")
    monkeypatch.setenv("TESSERA_ESTIMATOR_STEP_WINDOW", "20")
    cfg = config.load(EstimatorConfig, ["--config", str(f), "--row-window", "30"], "TESSERA_ESTIMATOR_")
    assert (cfg.step_window, cfg.run_steps, cfg.row_window, cfg.compact_bytes) == (20, 9, 30, 0)
    monkeypatch.setenv("TESSERA_ESTIMATOR_RUN_STEPS", "0")
    with pytest.raises(SpecError) as e:
        config.load(EstimatorConfig, ["--config", str(f)], "TESSERA_ESTIMATOR_")
    assert e.value.field == "run_steps"
    d = EstimatorConfig()
    assert (d.step_window, d.run_steps, d.row_window, d.compact_bytes) == (4096, 64, 256, 64 << 20)
    s = open_store(cfg)
    assert s.retention == Retention(step_window=20, run_steps=9, row_window=30) and s.compact_bytes == 0
    s.close()


def test_slots_of_a_record_name_its_windows():
    names = [k[0] for k, _ in slots(step("a", 1, i=3, world_size="1"))]
    assert names == ["source", "job", "model", "job_model", "run"]
    assert [k[0] for k, _ in slots(device("a", 1))] == ["source"]
