"""Durable measurement store: an append-only log, fsynced before a batch is acknowledged,
with bounded retention and crash-safe compaction.

File ``<state_dir>/measurements.log``: records of ``u32 length | u32 crc32 | Measurement``
(little endian). On open the log is replayed to rebuild the per-source watermarks and the
in-memory windows; a torn or corrupt tail (a crash mid-write: nothing intact after it) is
truncated away, which loses only measurements that were never acknowledged. A corrupt
record with intact records after it is skipped instead (``scan_log`` resynchronises on
the next intact header + crc): the original file is copied to ``<log>.corrupt-<time>``,
the log rewritten to its intact records, and an error logged; nothing intact is lost.

Retention (``Retention``, the rule itself in ``Windows``): memory keeps the most recent
``step_window`` step samples per job, per model key and per (job, model key); per
single-device run the warm-up steps plus the ``run_steps`` latest measured steps; the
most recent ``row_window`` comm rows per (link, op, bytes, world), colocation rows per
(device kind, mode, colocated) and rank rows per configuration (``models.rank_key``); and
each source's latest record (its watermark). A step measurement of one module of a step
(``tessera.measurement.BREAKDOWN_MODULES``: a multimodal step's encoder and LLM, reported
after the whole step) is in no step window: it is no step.

Compaction: once the log exceeds ``compact_bytes`` it is rewritten to exactly the records
the windows hold (in log order) followed by one checkpoint record (``META_KIND``, empty
source) carrying ``count``, ``model_revision`` and every source's watermark; written to ``TMP_NAME``, fsynced,
``os.replace``d over the log, directory fsynced. A crash leaves the old or the new log;
a stray temp file is removed on open. Replaying any subsequence of the log that contains
every retained record in order yields the same windows, because every window keeps the
last N of its key (runs: the lowest and highest step numbers, each at its last value).
Device samples and kinds this version does not index are dropped by compaction.

Key expiry (``key_ttl_s``, 0 disables): the windows bound memory per key, expiry bounds
the number of keys. A *key* is one window's key; the job-scoped ones and the sources
expire, the ones the controller plans with do not (``expired_keys`` is the rule):
- "job", "job_model" and "source" keys expire once their latest retained record was
  received more than ``key_ttl_s`` ago; a source's watermark (one integer) stays, so a
  profilerd silent that long that resends a persisted batch still has it taken for a
  duplicate (the checkpoint of a compaction carries every watermark);
- a "run" key (one job's single-device run: a profile point) expires on that age only
  when it is no profile point or when a more recent run of the same configuration (the
  run key less its job) is one: the latest profile point of every configuration stays,
  however old, so ListProfiles and the fitted model never lose a configuration;
- "model" (model key), "comm", "colocation" and "ranks" keys never expire: they are configurations,
  not jobs, and their last-N windows already bound them.
Ages use the estimator's receipt time, not the profilerd's ``Measurement.time``: each
appended batch is preceded by a receipt marker (``RX_KIND``, empty source, ``values.at``),
and compaction writes a marker before each retained record whose receipt time differs from
the previous one's. The receipt clock is the wall clock read once at open plus the time
elapsed since on a clock that never steps (``monotonic``): a wall-clock step after the open
(NTP, a VM resume, one bad reading) neither dates records nor ages keys. Each sweep compares
the wall clock with it; while they disagree by more than ``max_clock_skew_s`` the sweep is
refused (a warning), so a bad reading at the open cannot expire fresh keys either. A
disagreement that holds, within that bound, for ``clock_settle_s`` is a real step: the
receipt clock follows it, recorded by a rebase record (``REBASE_KIND``, ``values.by`` the
step, ``values.at`` the new time) that moves every receipt time so far by ``max(by, 0)`` and
clamps it to at most ``at`` (live and on replay), so no key gets older by the step. On open,
receipt times later than the open's reading (an earlier clock ahead, or this one behind) are
left as they are and the receipt clock starts at the latest of them: no key ages at an open,
and expiry waits for the wall clock to agree or for a lasting step to be followed. An expiry is made
durable before it takes effect in memory: a tombstone record (``EXPIRED_KIND``, empty
source, ``labels.keys`` the JSON list of [window, key]) is appended and fsynced, and
replay applies it at its place in the log, so an expired key never comes back on a
restart (whatever the clock or ``key_ttl_s`` then) while one that reported again after
its expiry keeps only its new records. Compaction keeps a tombstone (pruned to those of
its keys) while an earlier retained record still names one of its keys, since replay
would otherwise put that record back into the expired window. Expiry of a run moves
``model_revision`` (the model refits without it). Keys are swept on an append at most
every ``sweep_interval_s`` (``min(key_ttl_s / 10, 60)``) and by ``sweep()``; each sweep
that expires something logs "keys expired" with counts per window, and ``expired`` counts
them since open.

Failure handling: a write or fsync that fails truncates the log back to its last good
size before the error reaches the caller, so no garbage sits before later batches; if
even that truncate fails the store refuses every further append (``StoreFailed``), as it
does when a compaction replaced the log and the new file cannot be opened. A compaction
whose directory fsync failed has the next write fsync the directory first. A batch with
a measurement that cannot be indexed is refused whole (``Unindexable``), nothing written. A
caller cancelled (e.g. an RPC deadline) while its write or compaction runs in a thread
keeps the lock until the thread is done, and a finished write is indexed before the
cancellation propagates. Replay skips a record whose seq is at or below its source's
watermark so far, so the log never yields a measurement twice.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import os
import struct
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera import log
from tessera.fsutil import fsync_dir
from tessera.api.v1 import profiler_pb2
from tessera.measurement import BREAKDOWN_MODULES

from . import models
from .profiles import StepSample

_HEADER = struct.Struct("<II")
LOG_NAME = "measurements.log"
TMP_NAME = LOG_NAME + ".compact.tmp"
META_KIND = "estimator.checkpoint"
RX_KIND = "estimator.received"    # receipt time of the records after it (``values.at``)
EXPIRED_KIND = "estimator.expired"  # keys expired here (``labels.keys``, ``values.at``)
REBASE_KIND = "estimator.rebased"   # the receipt clock followed a wall-clock step (``values.by``, ``values.at``)
META_KINDS = frozenset({META_KIND, RX_KIND, EXPIRED_KIND, REBASE_KIND})
MAX_CLOCK_SKEW_S = 60.0   # wall clock vs receipt clock disagreement that counts as a step
CLOCK_SETTLE_S = 600.0    # how long a step must hold before the receipt clock follows it


def elapsed_clock() -> float:
    """Seconds on a clock that never steps and counts time suspended (CLOCK_BOOTTIME
    where there is one, else ``time.monotonic``): what receipt times advance by."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


if not hasattr(time, "CLOCK_BOOTTIME"):  # not Linux
    elapsed_clock = time.monotonic  # noqa: F811
DEFAULT_COMPACT_BYTES = 64 << 20
DEFAULT_KEY_TTL_S = 7 * 86400.0
# Windows whose change moves ``model_revision`` (the performance model's inputs).
MODEL_INPUTS = frozenset({"run", "comm", "colocation", "ranks"})

# A record's place in one window: ((window name, key), value held there). The "run"
# window's value is (step, seconds); the others keep the last N values of their key.
Slot = tuple[tuple[str, Hashable], object]


def encode(m: profiler_pb2.Measurement) -> bytes:
    payload = m.SerializeToString(deterministic=True)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def is_meta(m: profiler_pb2.Measurement) -> bool:
    """A record the store writes for itself (checkpoint, receipt marker, tombstone), not
    a measurement: no source (the API refuses measurements without one)."""
    return not m.source and m.kind in META_KINDS


def _record_at(data: bytes, off: int) -> profiler_pb2.Measurement | None:
    """The record that starts at ``off`` if one is intact there (a non-empty payload that
    fits, matches its crc and parses; the store never writes an empty record), else None."""
    if off + _HEADER.size > len(data):
        return None
    n, crc = _HEADER.unpack_from(data, off)
    end = off + _HEADER.size + n
    if n == 0 or end > len(data):
        return None
    payload = data[off + _HEADER.size: end]
    if zlib.crc32(payload) != crc:
        return None
    m = profiler_pb2.Measurement()
    try:
        m.ParseFromString(payload)
    except Exception:  # a corrupt record that happens to match its crc
        return None
    return m


@dataclass
class LogScan:
    """What ``scan_log`` found: every intact record (``records``) with its bytes
    (``spans``: (start, end) offsets), the corrupt regions skipped because intact records
    follow them (``skipped``: (start, end) offsets), and ``end``, the offset just past the
    last intact record (what follows it is a torn tail: nothing intact after it)."""

    records: list[profiler_pb2.Measurement]
    spans: list[tuple[int, int]]
    skipped: list[tuple[int, int]]
    end: int


def scan_log(data: bytes) -> LogScan:
    """Scan a log's bytes. At a record that is not intact, resynchronise: the next offset
    where an intact record starts (first the offset its own length field names, then byte
    by byte) ends a corrupt region, and scanning goes on from there; when no intact record
    follows, the rest is a torn tail (``end``)."""
    out = LogScan([], [], [], 0)
    off = 0
    while off < len(data):
        m = _record_at(data, off)
        if m is None:
            nxt = None
            if off + _HEADER.size <= len(data):  # the length field may be intact (a flipped payload byte)
                guess = off + _HEADER.size + _HEADER.unpack_from(data, off)[0]
                if guess < len(data) and _record_at(data, guess) is not None:
                    nxt = guess
            if nxt is None:
                nxt = next((j for j in range(off + 1, len(data) - _HEADER.size + 1)
                            if _record_at(data, j) is not None), None)
            if nxt is None:
                break  # nothing intact follows: a torn tail
            out.skipped.append((off, nxt))
            off = nxt
            continue
        end = off + _HEADER.size + _HEADER.unpack_from(data, off)[0]
        out.records.append(m)
        out.spans.append((off, end))
        off = out.end = end
    return out


def read_log(path: Path) -> tuple[list[profiler_pb2.Measurement], int]:
    """Every intact record of the log and the byte offset just past the last of them
    (corrupt regions followed by intact records are skipped, see ``scan_log``)."""
    scan = scan_log(path.read_bytes() if path.exists() else b"")
    return scan.records, scan.end


@dataclass(frozen=True)
class Retention:
    """How much the store keeps per key (see the module docstring); each limit >= 1."""

    step_window: int = 4096
    run_steps: int = 64
    row_window: int = 256

    def __post_init__(self) -> None:
        for k in ("step_window", "run_steps", "row_window"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k}: must be >= 1, got {getattr(self, k)}")

    def limit(self, window: str) -> int:
        """How many records a last-N window of this name keeps per key."""
        if window in ("job", "model", "job_model"):
            return self.step_window
        if window in ("comm", "colocation", "ranks"):
            return self.row_window
        if window == "source":
            return 1  # a source's records arrive in seq order: the last is its watermark
        raise ValueError(f"unknown window {window!r}")


def slots(m: profiler_pb2.Measurement) -> list[Slot]:
    """The windows a measurement takes part in and what it holds in each (pure). Every
    record is in its source's window, so the watermark record survives compaction."""
    out: list[Slot] = [(("source", m.source), None)]
    if m.kind == "step" and m.module in BREAKDOWN_MODULES:
        # One module's share of a step already reported whole (a multimodal step's encoder
        # and LLM, the step's wall time repeated): counted as steps, a job's GetProfile had
        # three samples a step and mean phases mixing the modules' with the step's, and
        # its run's forward + backward was the last module's.
        return out
    if m.kind == "step":
        s = StepSample(m.step_time_s, dict(m.phases), m.time)
        if m.job_id:
            out.append((("job", m.job_id), s))
        if m.model_key:
            out.append((("model", m.model_key), s))
        if m.job_id and m.model_key:
            out.append((("job_model", (m.job_id, m.model_key)), s))
        key = models.run_key(m)
        if key is not None:
            out.append((("run", key), (m.step, m.step_time_s, models.fb_seconds(m.phases))))
    elif m.kind == "comm":
        row = models.comm_row(m)
        if row is not None:
            out.append((("comm", (row["link"], row["op"], row["bytes"], row["world"])), row))
    elif m.kind == "colocation":
        row = models.colocation_row(m)
        if row is not None:
            out.append((("colocation", (row["device_kind"], row["mode"], row["colocated"])), row))
    elif m.kind == "ranks":
        row = models.rank_row(m)
        if row is not None:
            out.append((("ranks", models.rank_key(row)), row))
    return out


class Windows:
    """The retention rule (pure: no I/O, no clock), fed records in log order by index.

    Last-N windows (``Retention.limit``) keep the most recent N records of each key.
    A "run" window keeps, per step number, the last record that reported it, for the
    ``models.WARMUP_STEPS`` lowest step numbers and the ``run_steps`` highest ones (an
    executor numbers steps in order, so these are its warm-up and its latest steps).
    A record is retained while at least one window holds it (``refs``)."""

    def __init__(self, retention: Retention, warmup: int = models.WARMUP_STEPS) -> None:
        self.retention = retention
        self.warmup = warmup
        self.last: dict[str, dict[Hashable, deque[tuple[int, object]]]] = {}
        self.runs: dict[tuple, dict[int, float]] = {}       # run key -> step -> seconds
        self.run_fb: dict[tuple, dict[int, float]] = {}     # run key -> step -> forward + backward s (0: not reported)
        self.run_records: dict[tuple, dict[int, int]] = {}  # run key -> step -> record index
        self.refs: dict[int, int] = {}

    def _ref(self, i: int) -> None:
        self.refs[i] = self.refs.get(i, 0) + 1

    def _unref(self, i: int, dropped: list[int]) -> None:
        n = self.refs[i] - 1
        if n:
            self.refs[i] = n
        else:
            del self.refs[i]
            dropped.append(i)

    def add(self, i: int, record_slots: Iterable[Slot]) -> tuple[set[str], list[int]]:
        """Record ``i`` (greater than every earlier one) enters its windows. Returns the
        names of the windows whose content changed and the records no window holds any
        more (``i`` itself when it is kept nowhere)."""
        changed: set[str] = set()
        dropped: list[int] = []
        self._ref(i)  # held while it enters, so evicting and re-adding cannot drop it early
        for (name, key), value in record_slots:
            if name == "run":
                if self._add_run(i, key, value, dropped):
                    changed.add(name)
                continue
            by_key = self.last.setdefault(name, {})
            d = by_key.get(key)
            if d is None:
                d = by_key[key] = deque(maxlen=self.retention.limit(name))
            self._ref(i)
            if len(d) == d.maxlen:
                self._unref(d[0][0], dropped)
            d.append((i, value))
            changed.add(name)
        self._unref(i, dropped)
        return changed, dropped

    def _add_run(self, i: int, key: tuple, value: tuple, dropped: list[int]) -> bool:
        step, seconds = value[0], value[1]
        fb = value[2] if len(value) > 2 else 0.0
        recs = self.run_records.setdefault(key, {})
        vals = self.runs.setdefault(key, {})
        fbs = self.run_fb.setdefault(key, {})
        self._ref(i)
        if step in recs:  # reported again (e.g. a resent or replayed step): the last one counts
            old, before, before_fb = recs[step], vals[step], fbs.get(step, 0.0)
            recs[step], vals[step], fbs[step] = i, seconds, fb
            self._unref(old, dropped)
            return before != seconds or before_fb != fb
        recs[step], vals[step], fbs[step] = i, seconds, fb
        if len(recs) <= self.warmup + self.retention.run_steps:
            return True
        victim = sorted(recs)[self.warmup]  # the oldest measured step
        self._unref(recs.pop(victim), dropped)
        del vals[victim]
        fbs.pop(victim, None)
        return victim != step

    def remove(self, name: str, key: Hashable) -> tuple[bool, list[int]]:
        """Drop one key of a window (expiry). Returns whether it was there and the
        records no window holds any more."""
        dropped: list[int] = []
        if name == "run":
            recs = self.run_records.pop(key, None)
            self.runs.pop(key, None)
            self.run_fb.pop(key, None)
            held = list(recs.values()) if recs is not None else None
        else:
            d = self.last.get(name, {}).pop(key, None)
            held = [i for i, _ in d] if d is not None else None
        for i in held or ():
            self._unref(i, dropped)
        return held is not None, dropped

    def window(self, name: str, key: Hashable) -> deque[tuple[int, object]]:
        """(record, value) pairs of one last-N window, oldest first (empty if unknown)."""
        return self.last.get(name, {}).get(key, deque())

    def rows(self, name: str) -> list:
        """The values of every key's window of ``name``, in record order."""
        return [v for _, v in heapq.merge(*self.last.get(name, {}).values(), key=lambda e: e[0])]


def expired_keys(w: Windows, received: Mapping[int, float], now: float, ttl: float) -> list[tuple[str, Hashable]]:
    """The (window, key) pairs expired at ``now`` (pure; the rule of the module docstring).
    ``received[i]``: receipt time of retained record ``i``; a key's age is ``now`` less the
    receipt time of its latest retained record; it expires when that is more than ``ttl``
    (``ttl`` <= 0: nothing expires). A run expires only when it makes no profile point
    (``models.is_profile``) or a run of the same configuration that makes one has a later
    record; so the latest profile point of each configuration is never expired."""
    if ttl <= 0:
        return []
    horizon = now - ttl
    out: list[tuple[str, Hashable]] = []
    for name in ("source", "job", "job_model"):
        for key, d in w.last.get(name, {}).items():
            if d and received[d[-1][0]] < horizon:
                out.append((name, key))
    latest: dict[tuple, tuple[int, tuple]] = {}  # configuration -> (last record, run) of its latest profile point
    last: dict[tuple, int] = {}
    for key, recs in w.run_records.items():
        if not recs:
            continue
        last[key] = max(recs.values())
        if models.is_profile(w.runs[key]):
            cfg = key[1:]
            if cfg not in latest or latest[cfg] < (last[key], key):
                latest[cfg] = (last[key], key)
    for key, i in last.items():
        pinned = latest.get(key[1:])
        if received[i] < horizon and (pinned is None or pinned[1] != key):
            out.append(("run", key))
    return out


def _key_to_json(name: str, key: Hashable) -> list:
    return [name, list(key) if isinstance(key, tuple) else key]


def _key_from_json(entry: list) -> tuple[str, Hashable]:
    name, key = entry
    return name, tuple(key) if isinstance(key, list) else key


def receipt_marker(at: float) -> profiler_pb2.Measurement:
    """The record that stamps the receipt time of the records after it."""
    return profiler_pb2.Measurement(kind=RX_KIND, values={"at": at})


def tombstone(keys: Iterable[tuple[str, Hashable]], at: float) -> profiler_pb2.Measurement:
    """The record that expires ``keys`` at its place in the log."""
    return profiler_pb2.Measurement(kind=EXPIRED_KIND, values={"at": at},
                                    labels={"keys": json.dumps([_key_to_json(n, k) for n, k in keys])})


def checkpoint(count: int, model_revision: int, watermarks: Mapping[str, int]) -> profiler_pb2.Measurement:
    """A compaction's last record: the counters and every source's watermark (``labels.watermarks``,
    JSON {source: seq}), which outlive the records and the expiry of their source."""
    return profiler_pb2.Measurement(kind=META_KIND, values={"count": count, "model_revision": model_revision},
                                    labels={"watermarks": json.dumps(dict(sorted(watermarks.items())))})


def tombstone_keys(m: profiler_pb2.Measurement) -> list[tuple[str, Hashable]]:
    """The (window, key) pairs of a tombstone record."""
    return [_key_from_json(e) for e in json.loads(m.labels["keys"])]


def survivors(records: Iterable[Iterable[Slot]], retention: Retention) -> list[int]:
    """Indices of the records (each given by its ``slots``) that the windows retain."""
    w = Windows(retention)
    for i, s in enumerate(records):
        w.add(i, s)
    return sorted(w.refs)


async def _write_then(write: Callable[[], Any], apply: Callable[[], None]) -> None:
    """Run the blocking ``write`` in a thread, then ``apply()`` its effect in memory. A
    cancellation first waits for the thread (the store's lock must not be released while
    it works on the file); if the write completed, ``apply()`` still runs — what it wrote
    is durable and replay would apply it — and then the cancellation goes through. An
    exception of ``write`` (an OSError) propagates, ``apply`` not called."""
    fut = asyncio.ensure_future(asyncio.to_thread(write))
    try:
        await asyncio.shield(fut)
    except asyncio.CancelledError:
        await _settle(fut)
        if not fut.cancelled() and fut.exception() is None:
            apply()
        raise
    apply()


class StoreFailed(OSError):
    """The log could not be restored to a known-good state after a failed write, or a
    compaction replaced the log and no handle on the new one could be opened; the store
    refuses appends until it is reopened (which truncates any torn tail)."""


class Unindexable(ValueError):
    """A new measurement that ``slots`` cannot index: ``append`` refuses its whole batch
    before anything is written (the message ends in "(seq N)"). The one error of
    ``append`` that is about the batch rather than the store (estimator.api answers it
    INVALID_ARGUMENT naming the measurement, so the sender drops just that one); any
    other is the store's (OSError: UNAVAILABLE, the sender keeps the batch)."""


async def _settle(fut: asyncio.Future) -> None:
    """Wait until ``fut`` (a thread's work) is done, whatever cancellations arrive."""
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except BaseException:  # its own error: the caller reads it from ``fut``
            break


class MeasurementStore:
    """Measurements by (source, seq), deduplicated by each source's watermark (the
    highest persisted seq; a profilerd numbers in order, so anything at or below it has
    been seen). ``append`` is safe to call from concurrent RPCs.

    ``count``: measurements accepted over the log's life (kept across compaction);
    ``duplicates``: dropped since open; ``retained``: records held in memory;
    ``compactions``: log rewrites since open; ``expired``: keys expired since open, per
    window (``key_ttl_s``, see the module docstring); ``keys``: keys held, per window.
    ``clock``: wall clock (seconds since the epoch), read at open and by each sweep;
    ``monotonic``: a clock that never steps (seconds, any origin). Receipt times are
    ``clock()`` at open plus ``monotonic()`` elapsed since (``receipt_time``), so they
    never go backwards and a wall-clock step does not move them; a sweep is refused while
    the wall clock and the receipt clock disagree by more than ``max_clock_skew_s``, and the
    receipt clock follows a disagreement that held (within that bound) for
    ``clock_settle_s`` without making any key older (see the module docstring). Receipt
    times replayed from the log are kept; the receipt clock starts at the latest of them
    when that is after the open's reading. Records of a log
    written before receipt markers existed count as received at the open. Inject both
    clocks to move time by hand (a test clock that moves both is steady time; moving only
    ``clock`` is a step)."""

    def __init__(self, state_dir: str | os.PathLike, retention: Retention | None = None, *,
                 compact_bytes: int = DEFAULT_COMPACT_BYTES, key_ttl_s: float = DEFAULT_KEY_TTL_S,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = elapsed_clock,
                 max_clock_skew_s: float = MAX_CLOCK_SKEW_S, clock_settle_s: float = CLOCK_SETTLE_S) -> None:
        if compact_bytes < 0:
            raise ValueError(f"compact_bytes: must be >= 0, got {compact_bytes}")
        if not (math.isfinite(key_ttl_s) and key_ttl_s >= 0):
            raise ValueError(f"key_ttl_s: must be a finite number >= 0 (0 disables expiry), got {key_ttl_s}")
        if not max_clock_skew_s > 0 or not clock_settle_s >= 0:
            raise ValueError(f"max_clock_skew_s must be > 0 and clock_settle_s >= 0, got {max_clock_skew_s}, "
                             f"{clock_settle_s}")
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / LOG_NAME
        self.log = log.get(component="estimator.store")
        self.retention = retention or Retention()
        self.compact_bytes = compact_bytes
        self.key_ttl_s = key_ttl_s
        self.sweep_interval_s = min(key_ttl_s / 10, 60.0)
        self.clock = clock
        self.monotonic = monotonic
        self.max_clock_skew_s = max_clock_skew_s
        self.clock_settle_s = clock_settle_s
        # The receipt clock: the wall clock at open plus the monotonic time elapsed since.
        self.opened_at = self._anchor_wall = clock()
        self._anchor_mono = monotonic()
        self._step: tuple[float, float] | None = None  # a wall-clock step not yet settled: (skew, monotonic at first)
        self.rebases = 0  # times the receipt clock followed a settled wall-clock step since open
        self.expired: Counter[str] = Counter()
        self._next_sweep = -math.inf  # on the monotonic clock
        self.watermarks: dict[str, int] = {}
        self.count = 0
        self.duplicates = 0
        self.compactions = 0
        self._w = Windows(self.retention)
        # Inputs of the performance model (estimator/models.py): single-device runs
        # (run key -> {step: seconds}), communication rows, colocation pairs, rank rows; the
        # revision moves only when one of them changed (device samples do not refit).
        self.runs = self._w.runs
        self.run_fb = self._w.run_fb  # per run and step: forward + backward seconds (0: not reported)
        self.model_revision = 0
        # Encoded records the windows hold, by record index; insertion order is log order.
        self._blobs: dict[int, bytes] = {}
        self._rx: dict[int, float] = {}  # receipt time of each retained record
        # Tombstones a compaction may still need (see the module docstring): index -> (at, keys).
        self._tombs: dict[int, tuple[float, list[tuple[str, Hashable]]]] = {}
        self._next = 0
        self._retained_bytes = 0
        self._lock = asyncio.Lock()
        self._failed: str | None = None  # why appends are refused (see StoreFailed)
        self._dir_synced = True  # False: a compaction's rename not yet fsynced (see _write)
        self.replay_duplicates = 0  # records skipped on open: at or below their source's watermark
        tmp = self.dir / TMP_NAME
        if tmp.exists():  # a compaction that crashed before its replace: the log is the old one
            self.log.warning("removing an interrupted compaction", path=str(tmp), bytes=tmp.stat().st_size)
            tmp.unlink()
        records, good = self._recover()
        rx = self.opened_at  # the receipt time of records logged before receipt markers existed
        for m in records:
            if is_meta(m):
                if m.kind == RX_KIND:
                    rx = m.values["at"]
                elif m.kind == EXPIRED_KIND:
                    self._expire(tombstone_keys(m), m.values["at"])
                elif m.kind == REBASE_KIND:
                    self._rebase(m.values["by"], m.values["at"])
                    rx = min(rx + max(m.values["by"], 0.0), m.values["at"])
                else:
                    self._index(m, b"", [], rx)
                continue
            if m.seq <= self.watermarks.get(m.source, 0):
                self.replay_duplicates += 1  # e.g. a batch resent after its ack was lost
                continue
            self._index(m, encode(m), self._replay_slots(m), rx)
        # The log's latest receipt time after the open's wall-clock reading: either an earlier
        # run's clock was ahead, or this reading is behind (a host booting before NTP). The two
        # cannot be told apart here, so nothing is moved (a clamp kept only in memory would
        # make the records stamped from it look old to a later open, whose sweep would expire
        # fresh keys): the receipt clock starts at that latest time instead — no key ages at
        # the open — and sweeps wait until the wall clock agrees with it, or a lasting step is
        # followed through a persisted rebase record (``_clock_settled``).
        latest = max([rx, *self._rx.values(), *(at for at, _ in self._tombs.values())])
        if latest > self.opened_at:
            self._anchor_wall = latest
            self.log.warning("the log has receipt times after this open's wall-clock reading (an earlier clock "
                             "ahead, or this one behind); the receipt clock starts at the latest, and key expiry "
                             "waits for the wall clock to agree", latest=latest, opened_at=self.opened_at,
                             ahead_s=round(latest - self.opened_at, 3))
        self._file = self._open_append()
        self._size = good
        self.log.info("measurement store opened", path=str(self.path), measurements=self.count,
                      retained=self.retained, sources=len(self.watermarks), bytes=good,
                      replay_duplicates=self.replay_duplicates, keys=self.keys, key_ttl_s=key_ttl_s)

    def _recover(self) -> tuple[list[profiler_pb2.Measurement], int]:
        """Read the log for replay (at open). A torn tail (nothing intact after it: a crash
        mid-write, never acknowledged) is truncated away. Corrupt records followed by intact
        ones (a flipped byte, bad media) are never a reason to lose what follows: the
        original file is copied aside first (``<log>.corrupt-<unix time in ns>``), the log is
        rewritten atomically to its intact records only, and an error names the bytes and
        regions skipped. Returns the intact records and the log's size afterwards."""
        data = self.path.read_bytes() if self.path.exists() else b""
        scan = scan_log(data)
        if scan.skipped:
            aside = self.path.with_name(f"{LOG_NAME}.corrupt-{time.time_ns()}")
            with open(aside, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            blob = b"".join(data[a:b] for a, b in scan.spans)
            tmp = self.dir / TMP_NAME
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            fsync_dir(self.dir)
            self.log.error("measurement log has corrupt records followed by intact ones; skipped the corrupt "
                           "bytes, kept every intact record, original copied aside", path=str(self.path),
                           copy=str(aside), corrupt_regions=len(scan.skipped),
                           skipped_bytes=sum(b - a for a, b in scan.skipped),
                           torn_tail_bytes=len(data) - scan.end, records_kept=len(scan.records))
            return scan.records, len(blob)
        if scan.end < len(data):
            self.log.warning("truncating torn tail of the measurement log", path=str(self.path),
                             kept_bytes=scan.end, dropped_bytes=len(data) - scan.end)
            with open(self.path, "r+b") as f:
                f.truncate(scan.end)
                f.flush()
                os.fsync(f.fileno())
        return scan.records, scan.end

    def receipt_time(self) -> float:
        """Now on the receipt clock: the wall clock at open (or at the last rebase) plus the
        monotonic time elapsed since; never goes backwards but at a rebase."""
        return self._anchor_wall + (self.monotonic() - self._anchor_mono)

    def _rebase(self, by: float, at: float) -> int:
        """Move every retained receipt time by ``max(by, 0)`` and clamp it to at most ``at``
        (a rebase record's effect, live and on replay; ``by`` 0 at open). A key never gets
        older by it. Returns how many receipt times moved."""
        moved = 0
        up = max(by, 0.0)
        for i, r in self._rx.items():
            new = min(r + up, at)
            if new != r:
                self._rx[i] = new
                moved += 1
        return moved

    async def _clock_settled(self) -> bool:
        """Whether the wall clock agrees with the receipt clock (within ``max_clock_skew_s``),
        so that a sweep may run (caller holds the lock). A disagreement is a wall-clock step:
        refused (a warning when it starts); once it held within the bound for
        ``clock_settle_s``, the receipt clock follows it (a rebase record, appended and
        fsynced first) and the sweep runs."""
        wall, mono = self.clock(), self.monotonic()
        now = self._anchor_wall + (mono - self._anchor_mono)
        skew = wall - now
        if abs(skew) <= self.max_clock_skew_s:
            if self._step is not None:
                self.log.info("wall clock agrees with the receipt clock again; key expiry resumes", skew_s=skew)
            self._step = None
            return True
        if self._step is None or abs(skew - self._step[0]) > self.max_clock_skew_s:
            self._step = (skew, mono)
            self.log.warning("wall clock disagrees with the receipt clock (a clock step?); key expiry paused until "
                             "they agree or the step holds", skew_s=skew, wall=wall, receipt_time=now,
                             max_clock_skew_s=self.max_clock_skew_s, clock_settle_s=self.clock_settle_s)
            return False
        if mono - self._step[1] < self.clock_settle_s:
            return False
        blob = encode(profiler_pb2.Measurement(kind=REBASE_KIND, values={"by": skew, "at": wall}))
        try:
            await _write_then(lambda: self._write(blob), lambda: self._follow(skew, wall, mono))
        except OSError as e:
            self.log.error("receipt clock rebase not persisted; key expiry stays paused", path=str(self.path),
                           error=str(e))
            return False
        return True

    def _follow(self, skew: float, wall: float, mono: float) -> None:
        moved = self._rebase(skew, wall)
        self._anchor_wall, self._anchor_mono = wall, mono
        self._step = None
        self.rebases += 1
        self.log.warning("receipt clock follows a wall-clock step that held; no key got older by it", skew_s=skew,
                         receipt_times_moved=moved, held_s=self.clock_settle_s)

    @property
    def keys(self) -> dict[str, int]:
        """How many keys each window holds (what expiry bounds)."""
        out = {name: len(by_key) for name, by_key in sorted(self._w.last.items())}
        out["run"] = len(self._w.runs)
        return out

    def _open_append(self):
        # Unbuffered: a failed write leaves nothing in a user-space buffer that a later
        # flush could put after the truncation point.
        return open(self.path, "ab", buffering=0)

    @property
    def retained(self) -> int:
        """Records held in memory (what a compaction would keep, less its checkpoint)."""
        return len(self._blobs)

    @property
    def comm_rows(self) -> list[dict]:
        """Retained communication rows, in arrival order."""
        return self._w.rows("comm")

    @property
    def colocation_rows(self) -> list[dict]:
        """Retained colocation pairs, in arrival order."""
        return self._w.rows("colocation")

    @property
    def rank_rows(self) -> list[dict]:
        """Retained rank profiles (``models.rank_row``), in arrival order."""
        return self._w.rows("ranks")

    def _replay_slots(self, m: profiler_pb2.Measurement) -> list[Slot]:
        """``slots(m)`` of a logged record; one that cannot be indexed (written by an
        older version that persisted before indexing) keeps only its source's window
        (its watermark), with a warning, and is no model input: never a crash on open."""
        if is_meta(m):
            return []
        try:
            return slots(m)
        except Exception as e:
            self.log.warning("skipping a logged measurement that cannot be indexed", source=m.source, seq=m.seq,
                             kind=m.kind, error=repr(e))
            return [(("source", m.source), None)]

    def _index(self, m: profiler_pb2.Measurement, blob: bytes, record_slots: list[Slot], rx: float) -> None:
        if m.kind == META_KIND and not m.source:  # a compaction's checkpoint: restore the counters
            self.count = int(m.values["count"])
            self.model_revision = int(m.values["model_revision"])
            for src, seq in json.loads(m.labels.get("watermarks", "{}")).items():  # absent before watermarks outlived expiry
                self.watermarks[src] = max(self.watermarks.get(src, 0), int(seq))
            return
        self.watermarks[m.source] = max(self.watermarks.get(m.source, 0), m.seq)
        self.count += 1
        i = self._next
        self._next += 1
        self._blobs[i] = blob
        self._rx[i] = rx
        self._retained_bytes += len(blob)
        changed, dropped = self._w.add(i, record_slots)
        self._drop(dropped)
        if changed & MODEL_INPUTS:
            self.model_revision += 1

    def _drop(self, records: Iterable[int]) -> None:
        for j in records:
            self._retained_bytes -= len(self._blobs.pop(j))
            del self._rx[j]

    def _expire(self, keys: list[tuple[str, Hashable]], at: float) -> Counter[str]:
        """Drop ``keys`` from memory (a tombstone's effect, live or on replay); the
        tombstone stays known to compaction. Returns the keys dropped per window."""
        done: Counter[str] = Counter()
        for name, key in keys:
            present, dropped = self._w.remove(name, key)  # a source's watermark stays (see "Key expiry")
            self._drop(dropped)
            if present:
                done[name] += 1
        if done["run"]:
            self.model_revision += 1  # a model input is gone: refit
        self._tombs[self._next] = (at, list(keys))
        self._next += 1
        return done

    def _write(self, blob: bytes) -> None:
        """Append and fsync ``blob``; on any failure the log is cut back to its last good
        size (``self._size``) before the error propagates, or the store is marked failed.
        After a compaction whose directory fsync failed, the directory is fsynced first
        (an OSError then, with nothing written): nothing is acknowledged into a log whose
        rename may not be durable."""
        if self._failed is not None:
            raise StoreFailed(f"measurement store {self.path} refuses appends: {self._failed}")
        if not self._dir_synced:
            fsync_dir(self.dir)
            self._dir_synced = True
        fd = self._file.fileno()
        try:
            view = memoryview(blob)
            while view:  # unbuffered: a write may be short
                n = self._file.write(view)
                view = view[n:]
            os.fsync(fd)
        except BaseException as e:
            try:
                os.ftruncate(fd, self._size)
                os.lseek(fd, self._size, os.SEEK_SET)
            except OSError as t:
                self._failed = f"write failed ({e!r}) and truncating back to {self._size} bytes failed ({t!r})"
                self.log.error("measurement log left in an unknown state; refusing appends", path=str(self.path),
                               error=self._failed)
                raise StoreFailed(f"measurement store {self.path}: {self._failed}") from e
            self.log.error("measurement log write failed; truncated back to the last good size",
                           path=str(self.path), bytes=self._size, error=repr(e))
            raise
        self._size += len(blob)

    def _compaction_due(self) -> bool:
        # Also wait until at least half the log is garbage, so that a retained set near
        # compact_bytes is not rewritten on every append (nor after every restart).
        return self.compact_bytes > 0 and self._size > max(self.compact_bytes, 2 * self._retained_bytes)

    def _compacted(self) -> tuple[bytes, dict[int, tuple[float, list[tuple[str, Hashable]]]]]:
        """The compacted log (retained records in log order, each preceded by a receipt
        marker when its receipt time differs from the previous one's, the tombstones still
        needed, a checkpoint) and the tombstones it keeps."""
        parts: list[bytes] = []
        tombs: dict[int, tuple[float, list[tuple[str, Hashable]]]] = {}
        named: set[tuple[str, Hashable]] = set()  # expiring keys of the records written since their last tombstone
        rx = None
        tombstoned = {k for _, keys in self._tombs.values() for k in keys}  # without any, nothing to parse
        entries = heapq.merge(((i, 0, b) for i, b in self._blobs.items()),
                              ((i, 1, t) for i, t in self._tombs.items()))
        for i, what, x in entries:
            if what == 0:
                if self._rx[i] != rx:
                    rx = self._rx[i]
                    parts.append(encode(receipt_marker(rx)))
                parts.append(x)
                if tombstoned:
                    m = profiler_pb2.Measurement()
                    m.ParseFromString(x[_HEADER.size:])
                    named.update(k for k, _ in self._replay_slots(m) if k in tombstoned)
            else:
                at, keys = x
                needed = [k for k in keys if k in named]
                if needed:  # replay would put an earlier record back into these windows without it
                    named.difference_update(needed)
                    parts.append(encode(tombstone(needed, at)))
                    tombs[i] = (at, needed)
        meta = checkpoint(self.count, self.model_revision, self.watermarks)
        parts.append(encode(meta))
        return b"".join(parts), tombs

    def _compact(self) -> None:
        """Rewrite the log to what ``_compacted`` gives (caller holds the lock). A failure
        before the replace changes nothing (the temp file is removed). After it the old
        file is unlinked, and the store follows the new one at once (size, tombstones);
        appends go to a handle on the new file, opened before the old one is closed — if
        it cannot be opened the store refuses appends (``StoreFailed``, until reopened)
        rather than write where no replay reads. A failed directory fsync is raised too,
        and the next ``_write`` fsyncs the directory before writing."""
        before, kept = self._size, len(self._blobs)
        blob, tombs = self._compacted()
        tmp = self.dir / TMP_NAME
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # From here on the old file is unlinked: the store describes the new one, and
        # appends must go to it.
        self._size = len(blob)
        self._tombs = tombs
        self._dir_synced = False
        self.compactions += 1
        try:
            new = self._open_append()
        except OSError as e:  # the old handle stays (closed by close()); _write refuses first
            self._failed = f"compaction replaced the log but reopening it failed ({e!r})"
            self.log.error("measurement log not reopened after compaction; refusing appends", path=str(self.path),
                           error=self._failed)
            raise StoreFailed(f"measurement store {self.path}: {self._failed}") from e
        old, self._file = self._file, new
        try:
            old.close()
        except OSError as e:  # the unlinked old log: nothing more goes there
            self.log.warning("closing the replaced measurement log failed", path=str(self.path), error=repr(e))
        fsync_dir(self.dir)
        self._dir_synced = True
        self.log.info("measurement log compacted", path=str(self.path), bytes_before=before, bytes_after=len(blob),
                      records_kept=kept, tombstones_kept=len(tombs), measurements=self.count)

    async def _sweep_locked(self, force: bool = False) -> Counter[str]:
        """Expire the keys ``expired_keys`` names now (caller holds the lock): append and
        fsync their tombstone first, then drop them from memory. Not before
        ``sweep_interval_s`` (monotonic) since the last sweep unless ``force``; not while
        the wall clock disagrees with the receipt clock (``_clock_settled``). A failed write
        is logged and changes nothing (the next sweep tries again)."""
        mono = self.monotonic()
        if self.key_ttl_s <= 0 or (not force and mono < self._next_sweep):
            return Counter()
        self._next_sweep = mono + self.sweep_interval_s
        if not await self._clock_settled():
            return Counter()
        now = self.receipt_time()
        keys = expired_keys(self._w, self._rx, now, self.key_ttl_s)
        if not keys:
            return Counter()
        retained, before = self.retained, self._retained_bytes
        blob = encode(tombstone(keys, now))
        done: Counter[str] = Counter()

        def expire() -> None:  # durable once written: it takes effect (also when cancelled)
            done.update(self._expire(keys, now))
            self.expired.update(done)

        try:
            await _write_then(lambda: self._write(blob), expire)
        except OSError as e:
            self.log.error("key expiry not persisted; keys kept until the next sweep", path=str(self.path),
                           keys=len(keys), error=str(e))
            return Counter()
        self.log.info("keys expired", key_ttl_s=self.key_ttl_s, expired=dict(done),
                      sample=[_key_to_json(n, k) for n, k in keys[:5]], records_dropped=retained - self.retained,
                      bytes_dropped=before - self._retained_bytes, keys=self.keys,
                      expired_since_open=dict(self.expired))
        return done

    async def sweep(self) -> Counter[str]:
        """Expire what is due now (whatever the sweep interval), then compact when due.
        Returns the keys expired per window."""
        async with self._lock:
            done = await self._sweep_locked(force=True)
            await self._maybe_compact()
            return done

    async def _maybe_compact(self) -> None:
        """Compact when due (caller holds the lock); a failure is logged, not raised."""
        if not self._compaction_due():
            return
        fut = asyncio.ensure_future(asyncio.to_thread(self._compact))
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            await _settle(fut)
            if not fut.cancelled() and fut.exception() is not None:
                self.log.error("measurement log compaction failed", path=str(self.path), error=str(fut.exception()))
            raise
        except OSError as e:
            self.log.error("measurement log compaction failed", path=str(self.path), error=str(e))

    async def append(self, measurements: Iterable[profiler_pb2.Measurement]) -> tuple[int, int]:
        """Persist (write + fsync) the measurements not yet seen, then index them.
        Returns (accepted, duplicates). When it returns, the accepted ones are durable.
        Raises ``Unindexable`` (nothing persisted) for a batch with a new measurement that
        cannot be indexed, OSError (``StoreFailed`` included; nothing acknowledged) when the
        log cannot take it.
        Then, after a batch with something new, may expire keys (``_sweep_locked``) and
        compact the log (a failed expiry or compaction is logged; the batch stays durable)."""
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
                # Index first (pure), write second: a record that cannot be indexed is
                # refused before anything is written, so it can never reach the log and
                # fail every later replay.
                record_slots = []
                for j, m in enumerate(new):
                    try:
                        record_slots.append(slots(m))
                    except Exception as e:
                        # ends in "(seq N)" like estimator.api's refusals, which prefix
                        # "measurements[i]: " so that profilerd drops just this one
                        raise Unindexable(f"a {m.kind!r} measurement of {m.source!r} cannot be indexed: {e!r}; "
                                          f"nothing of this batch was persisted (seq {m.seq})") from e
                blobs = [encode(m) for m in new]
                rx = self.receipt_time()
                data = encode(receipt_marker(rx)) + b"".join(blobs)

                def indexed() -> None:  # what was written is durable: indexed, its duplicates counted
                    self._index_batch(new, blobs, record_slots, rx)
                    self.duplicates += dups

                # When the caller is cancelled, what the thread wrote is still indexed.
                await _write_then(lambda: self._write(data), indexed)
                # After indexing: a key that reports in this batch is not expired by it.
                await self._sweep_locked()
                await self._maybe_compact()
            else:
                self.duplicates += dups
            return len(new), dups

    def _index_batch(self, new: list[profiler_pb2.Measurement], blobs: list[bytes],
                     record_slots: list[list[Slot]], rx: float) -> None:
        for m, b, sl in zip(new, blobs, record_slots):
            self._index(m, b, sl, rx)

    def watermark(self, source: str) -> int:
        """Highest persisted seq of ``source`` (0: nothing from it)."""
        return self.watermarks.get(source, 0)

    def steps(self, job_id: str = "", model_key: str = "") -> list[StepSample]:
        """The most recent ``step_window`` step samples of a job, a model key, or both
        (intersection), oldest first."""
        if job_id and model_key:
            d = self._w.window("job_model", (job_id, model_key))
        elif job_id:
            d = self._w.window("job", job_id)
        else:
            d = self._w.window("model", model_key)
        return [s for _, s in d]

    def close(self) -> None:
        self._file.close()
