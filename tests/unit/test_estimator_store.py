"""The estimator's durable measurement store: dedup by watermark, reload, torn tail."""

from __future__ import annotations

from estimator.store import LOG_NAME, MeasurementStore, is_meta, read_log
from tessera.api.v1 import profiler_pb2


def step(source, seq, job="j1", t=0.1, model="gpt:x"):
    return profiler_pb2.Measurement(source=source, seq=seq, kind="step", job_id=job, model_key=model,
                                    step_time_s=t, phases={"forward": t / 2})


async def test_dedup_and_watermarks(tmp_path):
    s = MeasurementStore(tmp_path)
    assert await s.append([step("a", 1), step("a", 2), step("b", 1)]) == (3, 0)
    assert await s.append([step("a", 2), step("a", 3), step("a", 3)]) == (1, 2)  # in-batch repeat too
    assert (s.watermark("a"), s.watermark("b"), s.watermark("c")) == (3, 1, 0)
    assert await s.append([step("a", 7)]) == (1, 0)  # a gap (dropped upstream) is accepted
    assert await s.append([step("a", 5)]) == (0, 1)  # but nothing below the watermark
    assert len(s.steps(job_id="j1")) == 5 and len(s.steps(model_key="gpt:x")) == 5
    assert s.steps(job_id="j1", model_key="other") == []
    s.close()


async def test_reload_after_restart(tmp_path):
    s = MeasurementStore(tmp_path)
    await s.append([step("a", i) for i in range(1, 6)])
    await s.append([profiler_pb2.Measurement(source="a", seq=6, kind="device", values={"cpu_util": 0.5})])
    s.close()
    s2 = MeasurementStore(tmp_path)
    assert s2.watermark("a") == 6 and s2.count == 6 and len(s2.steps(job_id="j1")) == 5
    assert await s2.append([step("a", 6), step("a", 7)]) == (1, 1)
    s2.close()


async def test_torn_tail_is_truncated(tmp_path):
    s = MeasurementStore(tmp_path)
    await s.append([step("a", 1), step("a", 2)])
    s.close()
    path = tmp_path / LOG_NAME
    good = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02")  # a header and a few bytes: a crash mid-write
    s2 = MeasurementStore(tmp_path)
    assert s2.watermark("a") == 2 and path.stat().st_size == good
    await s2.append([step("a", 3)])
    s2.close()
    records, end = read_log(path)
    assert [r.seq for r in records if not is_meta(r)] == [1, 2, 3] and end == path.stat().st_size


def _unindexable_job(monkeypatch, job: str) -> None:
    """Make ``estimator.store.slots`` fail for the steps of ``job`` (what a bug in the
    indexing code, or a record this version cannot index, does)."""
    import estimator.store as store_mod

    real = store_mod.slots

    def slots(m):
        if m.job_id == job:
            raise KeyError("no window for this record")
        return real(m)

    monkeypatch.setattr(store_mod, "slots", slots)


async def test_unindexable_refusal_names_the_seq_last_and_persists_nothing(tmp_path, monkeypatch):
    import pytest

    _unindexable_job(monkeypatch, "poison")
    s = MeasurementStore(tmp_path)
    with pytest.raises(ValueError) as e:
        await s.append([step("a", 1), step("a", 2, job="poison"), step("a", 3)])
    msg = str(e.value)
    assert msg.endswith("(seq 2)")  # what profilerd.stream reads to drop exactly this one
    assert "'step'" in msg and "'a'" in msg and "cannot be indexed" in msg and "KeyError" in msg
    assert s.watermark("a") == 0 and s.count == 0  # nothing of the batch
    s.close()
