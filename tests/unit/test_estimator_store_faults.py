"""The measurement store under faults: an append cancelled while its write or compaction
runs in a thread, a failed or partial write/fsync, a log that cannot be truncated back.
Real files in tmp_path; the faults are injected at the file / os boundary."""

from __future__ import annotations

import asyncio
import errno
import os
import threading

import pytest

import estimator.store as store_mod
from estimator.store import LOG_NAME, MeasurementStore, Retention, StoreFailed, is_meta, read_log
from tessera.api.v1 import profiler_pb2


def step(source, seq, job="j1", t=0.1, model="gpt:x"):
    return profiler_pb2.Measurement(source=source, seq=seq, kind="step", job_id=job, model_key=model,
                                    step_time_s=t, phases={"forward": t / 2})


async def _wait_thread_event(ev: threading.Event, timeout: float = 5.0) -> None:
    assert await asyncio.to_thread(ev.wait, timeout), "the worker thread never got there"


async def test_cancel_mid_write_keeps_lock_and_indexes_what_was_written(tmp_path):
    s = MeasurementStore(tmp_path)
    started, go, done = threading.Event(), threading.Event(), threading.Event()
    real_write = s._write
    calls = []

    def slow_write(blob):
        calls.append(len(blob))
        if len(calls) == 1:  # only the first write is slow
            started.set()
            go.wait(5)
            try:
                return real_write(blob)
            finally:
                done.set()
        return real_write(blob)

    s._write = slow_write
    batch = [step("a", i) for i in (1, 2, 3)]
    a = asyncio.create_task(s.append(batch))
    await _wait_thread_event(started)
    a.cancel()  # the client's deadline: the handler is cancelled while the thread writes
    await asyncio.sleep(0)
    # The client never got an ack, so it resends the same batch.
    b = asyncio.create_task(s.append([step("a", i) for i in (1, 2, 3)]))
    await asyncio.sleep(0.1)
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await a
    assert await b == (0, 3)  # the cancelled write is durable and indexed: all duplicates
    await _wait_thread_event(done)
    assert s.watermark("a") == 3
    s.close()
    records, _ = read_log(tmp_path / LOG_NAME)
    assert [r.seq for r in records if not is_meta(r)] == [1, 2, 3]
    s2 = MeasurementStore(tmp_path)
    assert s2.watermark("a") == 3 and s2.count == 3 and len(s2.steps(job_id="j1")) == 3
    s2.close()


async def test_cancel_mid_compaction_loses_nothing(tmp_path, monkeypatch):
    # Keep one step per window: most of the log is garbage, so compaction is due at once.
    s = MeasurementStore(tmp_path, Retention(step_window=1), compact_bytes=1)
    started, go, done = threading.Event(), threading.Event(), threading.Event()
    real_replace = os.replace
    replaces = []

    def slow_replace(src, dst):
        replaces.append(src)
        if len(replaces) == 1:  # the compaction's temp file written, not yet swapped in
            started.set()
            go.wait(5)
            try:
                return real_replace(src, dst)
            finally:
                done.set()
        return real_replace(src, dst)

    monkeypatch.setattr(store_mod.os, "replace", slow_replace)
    a = asyncio.create_task(s.append([step("a", i) for i in (1, 2, 3, 4)]))
    await _wait_thread_event(started)
    a.cancel()
    await asyncio.sleep(0)
    s.compact_bytes = 0  # the next append must not compact (only the interleaving matters)
    b = asyncio.create_task(s.append([step("b", 1, job="j2")]))
    await asyncio.sleep(0.1)
    go.set()
    with pytest.raises(asyncio.CancelledError):
        await a
    assert await b == (1, 0)  # acknowledged: must survive a restart
    await _wait_thread_event(done)
    for _ in range(200):  # (without the lock held, the thread may still be finishing)
        if s.compactions:
            break
        await asyncio.sleep(0.01)
    assert s.compactions == 1
    s.close()
    s2 = MeasurementStore(tmp_path, Retention(step_window=1))
    assert (s2.watermark("a"), s2.watermark("b")) == (4, 1)
    assert s2.count == 5
    s2.close()


async def test_replay_skips_records_at_or_below_the_watermark(tmp_path):
    s = MeasurementStore(tmp_path)
    await s.append([step("a", 1), step("a", 2)])
    s.close()
    # A batch written but never indexed (e.g. by an older version), then resent.
    path = tmp_path / LOG_NAME
    with open(path, "ab") as f:
        f.write(store_mod.encode(step("a", 2)) + store_mod.encode(step("a", 3)) + store_mod.encode(step("a", 3)))
    s2 = MeasurementStore(tmp_path)
    assert s2.watermark("a") == 3 and s2.count == 3 and len(s2.steps(job_id="j1")) == 3
    assert s2.replay_duplicates == 2
    s2.close()


class _PartialWriteOnce:
    """The store's log file, whose next write puts half of its bytes on disk and then
    fails like a full disk."""

    def __init__(self, f):
        self._f = f
        self.armed = True

    def write(self, data):
        if self.armed:
            self.armed = False
            data = bytes(data)
            os.write(self._f.fileno(), data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


async def test_partial_write_is_truncated_away(tmp_path):
    s = MeasurementStore(tmp_path)
    assert await s.append([step("a", 1)]) == (1, 0)
    good = (tmp_path / LOG_NAME).stat().st_size
    s._file = _PartialWriteOnce(s._file)
    with pytest.raises(OSError, match="No space"):
        await s.append([step("a", 2)])
    assert (tmp_path / LOG_NAME).stat().st_size == good
    assert s.watermark("a") == 1
    assert await s.append([step("a", 2), step("a", 3)]) == (2, 0)  # acknowledged
    s.close()
    s2 = MeasurementStore(tmp_path)
    assert s2.watermark("a") == 3 and s2.count == 3
    records, end = read_log(tmp_path / LOG_NAME)
    assert [r.seq for r in records if not is_meta(r)] == [1, 2, 3] and end == (tmp_path / LOG_NAME).stat().st_size
    s2.close()


async def test_failed_fsync_is_truncated_away(tmp_path, monkeypatch):
    s = MeasurementStore(tmp_path)
    assert await s.append([step("a", 1)]) == (1, 0)
    good = (tmp_path / LOG_NAME).stat().st_size
    real_fsync = os.fsync
    fails = [1]

    def fsync(fd):
        if fails:
            fails.pop()
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(store_mod.os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output"):
        await s.append([step("a", 2)])
    assert (tmp_path / LOG_NAME).stat().st_size == good  # not acknowledged: not in the log
    assert await s.append([step("a", 2), step("a", 3)]) == (2, 0)
    s.close()
    records, _ = read_log(tmp_path / LOG_NAME)
    assert [r.seq for r in records if not is_meta(r)] == [1, 2, 3]
    s2 = MeasurementStore(tmp_path)
    assert s2.watermark("a") == 3 and s2.count == 3
    s2.close()


async def test_failed_truncate_refuses_further_appends(tmp_path, monkeypatch):
    s = MeasurementStore(tmp_path)
    assert await s.append([step("a", 1)]) == (1, 0)
    s._file = _PartialWriteOnce(s._file)

    def ftruncate(fd, size):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(store_mod.os, "ftruncate", ftruncate)
    with pytest.raises(StoreFailed, match="refuses|truncating back"):
        await s.append([step("a", 2)])
    monkeypatch.undo()
    with pytest.raises(StoreFailed, match="refuses appends"):
        await s.append([step("a", 2)])
    assert s.watermark("a") == 1
    s.close()
    s2 = MeasurementStore(tmp_path)  # reopening truncates the torn tail
    assert s2.watermark("a") == 1
    assert await s2.append([step("a", 2)]) == (1, 0)
    s2.close()


async def test_log_not_reopened_after_compaction_refuses_appends_and_loses_nothing(tmp_path):
    """The compaction's os.replace succeeded but the new log cannot be opened: the store
    refuses appends (StoreFailed, an OSError: UNAVAILABLE at the API) rather than raise
    ValueError on a closed handle forever (which the API answered INVALID_ARGUMENT); what
    was acknowledged is in the new log, and a reopen resumes."""
    s = MeasurementStore(tmp_path, Retention(step_window=1), compact_bytes=1)

    def emfile():
        raise OSError(errno.EMFILE, "Too many open files")

    s._open_append = emfile
    assert await s.append([step("a", i) for i in (1, 2, 3, 4)]) == (4, 0)  # durable before the compaction
    assert s.compactions == 1 and s._size == (tmp_path / LOG_NAME).stat().st_size
    for _ in range(2):
        with pytest.raises(StoreFailed, match="reopening it failed"):
            await s.append([step("a", 5)])
    assert s.watermark("a") == 4
    s.close()
    s2 = MeasurementStore(tmp_path, Retention(step_window=1))
    assert (s2.watermark("a"), s2.count) == (4, 4)
    assert await s2.append([step("a", 5)]) == (1, 0)
    s2.close()


async def test_failed_directory_fsync_after_compaction_keeps_the_size_true(tmp_path, monkeypatch):
    """fsync of the directory fails after the compaction's replace: the store's size is the
    new log's already, so a later failed write cuts back to it — not to the old, larger
    size (which padded the log with zeros). The next write fsyncs the directory first; if
    that fails too, nothing is written."""
    s = MeasurementStore(tmp_path, Retention(step_window=1), compact_bytes=1)
    real = store_mod.fsync_dir
    fails = [1, 1]  # the compaction's, then the next write's

    def fsync_dir(d):
        if fails:
            fails.pop()
            raise OSError(errno.EIO, "Input/output error")
        return real(d)

    monkeypatch.setattr(store_mod, "fsync_dir", fsync_dir)
    assert await s.append([step("a", i) for i in (1, 2, 3, 4)]) == (4, 0)
    path = tmp_path / LOG_NAME
    size = path.stat().st_size
    assert s.compactions == 1 and s._size == size
    s.compact_bytes = 0
    with pytest.raises(OSError, match="Input/output"):  # the directory first: nothing written
        await s.append([step("a", 5)])
    assert path.stat().st_size == size and s.watermark("a") == 4
    s._file = _PartialWriteOnce(s._file)
    with pytest.raises(OSError, match="No space"):
        await s.append([step("a", 5)])
    assert path.stat().st_size == size  # cut back to the compacted log, no zero padding
    assert await s.append([step("a", 5), step("a", 6)]) == (2, 0)
    s.close()
    records, end = read_log(path)
    assert [r.seq for r in records if not is_meta(r)] == [4, 5, 6] and end == path.stat().st_size
    s2 = MeasurementStore(tmp_path, Retention(step_window=1))
    assert (s2.watermark("a"), s2.count) == (6, 6)
    s2.close()
