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


async def test_corrupt_record_mid_log_is_skipped_not_truncated(tmp_path):
    """One flipped byte inside an early record: every intact record after it is kept (no
    truncation), the original is copied aside, and later appends continue normally."""
    s = MeasurementStore(tmp_path)
    for b in range(5):
        await s.append([step("a", b * 10 + i, job=f"j{b}") for i in range(1, 11)])
    s.close()
    path = tmp_path / LOG_NAME
    data = bytearray(path.read_bytes())
    original = bytes(data)
    data[200] ^= 0xFF
    path.write_bytes(bytes(data))
    s2 = MeasurementStore(tmp_path)
    assert s2.count == 49 and s2.watermark("a") == 50
    assert [len(s2.steps(job_id=f"j{b}")) for b in range(1, 5)] == [10, 10, 10, 10]
    aside = list(tmp_path.glob(LOG_NAME + ".corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == bytes(data) and len(original) == len(data)
    await s2.append([step("a", 51)])
    s2.close()
    records, end = read_log(path)
    assert end == path.stat().st_size
    seqs = [r.seq for r in records if not is_meta(r)]
    assert len(seqs) == 50 and seqs[-1] == 51
    s3 = MeasurementStore(tmp_path)  # the rewritten log is clean: nothing more set aside
    assert s3.count == 50 and len(list(tmp_path.glob(LOG_NAME + ".corrupt-*"))) == 1
    s3.close()


async def test_corrupt_length_field_resynchronises(tmp_path):
    """A flipped byte in a record's length field: the scan finds the next intact header."""
    s = MeasurementStore(tmp_path)
    await s.append([step("a", i) for i in range(1, 6)])
    await s.append([step("a", i) for i in range(6, 11)])
    s.close()
    path = tmp_path / LOG_NAME
    records, _ = read_log(path)
    data = bytearray(path.read_bytes())
    data[2] ^= 0x10  # the first record's length (a receipt marker)
    path.write_bytes(bytes(data))
    s2 = MeasurementStore(tmp_path)
    assert s2.count == 10 and s2.watermark("a") == 10
    s2.close()
