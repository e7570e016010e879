"""Durable measurement store: an append-only log, fsynced before a batch is acknowledged.

File ``<state_dir>/measurements.log``: records of ``u32 length | u32 crc32 | Measurement``
(little endian). On open the log is replayed to rebuild the per-source watermarks and the
in-memory step index; a torn or corrupt tail (a crash mid-write) is truncated away, which
loses only measurements that were never acknowledged.
"""

from __future__ import annotations

import asyncio
import os
import struct
import zlib
from collections.abc import Iterable
from pathlib import Path

from tessera import log
from tessera.api.v1 import profiler_pb2

from . import models
from .profiles import StepSample

_HEADER = struct.Struct("<II")
LOG_NAME = "measurements.log"


def encode(m: profiler_pb2.Measurement) -> bytes:
    payload = m.SerializeToString(deterministic=True)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_log(path: Path) -> tuple[list[profiler_pb2.Measurement], int]:
    """Every intact record of the log and the byte offset where the intact prefix ends."""
    out: list[profiler_pb2.Measurement] = []
    data = path.read_bytes() if path.exists() else b""
    off = 0
    while off + _HEADER.size <= len(data):
        n, crc = _HEADER.unpack_from(data, off)
        payload = data[off + _HEADER.size: off + _HEADER.size + n]
        if len(payload) < n or zlib.crc32(payload) != crc:
            break
        m = profiler_pb2.Measurement()
        try:
            m.ParseFromString(payload)
        except Exception:  # a corrupt record that happens to match its crc: stop here
            break
        out.append(m)
        off += _HEADER.size + n
    return out, off


class MeasurementStore:
    """Measurements by (source, seq), deduplicated by each source's watermark (the
    highest persisted seq; a profilerd numbers in order, so anything at or below it has
    been seen). ``append`` is safe to call from concurrent RPCs."""

    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / LOG_NAME
        self.log = log.get(component="estimator.store")
        self.watermarks: dict[str, int] = {}
        self.by_job: dict[str, list[StepSample]] = {}
        self.by_model: dict[str, list[StepSample]] = {}
        self.by_job_model: dict[tuple[str, str], list[StepSample]] = {}
        self.count = 0
        self.duplicates = 0
        # Inputs of the performance model (estimator/models.py): single-device runs
        # (run key -> {step: seconds}), communication rows, colocation pairs; the
        # revision moves only when one of them changed (device samples do not refit).
        self.runs: dict[tuple, dict[int, float]] = {}
        self.comm_rows: list[dict] = []
        self.colocation_rows: list[dict] = []
        self.model_revision = 0
        self._lock = asyncio.Lock()
        records, good = read_log(self.path)
        size = self.path.stat().st_size if self.path.exists() else 0
        if good < size:
            self.log.warning("truncating torn tail of the measurement log", path=str(self.path), kept_bytes=good, dropped_bytes=size - good)
            with open(self.path, "r+b") as f:
                f.truncate(good)
                f.flush()
                os.fsync(f.fileno())
        for m in records:
            self._index(m)
        self._file = open(self.path, "ab")
        self.log.info("measurement store opened", path=str(self.path), measurements=self.count, sources=len(self.watermarks))

    def _index(self, m: profiler_pb2.Measurement) -> None:
        self.watermarks[m.source] = max(self.watermarks.get(m.source, 0), m.seq)
        self.count += 1
        if m.kind == "step":
            s = StepSample(m.step_time_s, dict(m.phases), m.time)
            if m.job_id:
                self.by_job.setdefault(m.job_id, []).append(s)
            if m.model_key:
                self.by_model.setdefault(m.model_key, []).append(s)
            if m.job_id and m.model_key:
                self.by_job_model.setdefault((m.job_id, m.model_key), []).append(s)
            key = models.run_key(m)
            if key is not None:
                self.runs.setdefault(key, {})[m.step] = m.step_time_s
                self.model_revision += 1
        elif m.kind == "comm":
            row = models.comm_row(m)
            if row is not None:
                self.comm_rows.append(row)
                self.model_revision += 1
        elif m.kind == "colocation":
            row = models.colocation_row(m)
            if row is not None:
                self.colocation_rows.append(row)
                self.model_revision += 1

    def _write(self, blob: bytes) -> None:
        self._file.write(blob)
        self._file.flush()
        os.fsync(self._file.fileno())

    async def append(self, measurements: Iterable[profiler_pb2.Measurement]) -> tuple[int, int]:
        """Persist (write + fsync) the measurements not yet seen, then index them.
        Returns (accepted, duplicates). When it returns, the accepted ones are durable."""
        async with self._lock:
            seen = dict(self.watermarks)
            new: list[profiler_pb2.Measurement] = []
            dups = 0
            for m in measurements:
                if m.seq <= seen.get(m.source, 0):
                    dups += 1
                    continue
                seen[m.source] = m.seq
                new.append(m)
            if new:
                await asyncio.to_thread(self._write, b"".join(encode(m) for m in new))
                for m in new:
                    self._index(m)
            self.duplicates += dups
            return len(new), dups

    def watermark(self, source: str) -> int:
        """Highest persisted seq of ``source`` (0: nothing from it)."""
        return self.watermarks.get(source, 0)

    def steps(self, job_id: str = "", model_key: str = "") -> list[StepSample]:
        """Step samples of a job, a model key, or both (intersection)."""
        if job_id and model_key:
            return self.by_job_model.get((job_id, model_key), [])
        if job_id:
            return self.by_job.get(job_id, [])
        return self.by_model.get(model_key, [])

    def close(self) -> None:
        self._file.close()
