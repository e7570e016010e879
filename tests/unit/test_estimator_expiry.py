"""Key expiry of the estimator store (``key_ttl_s``): job-scoped keys and sources of
long-gone jobs are forgotten, in memory, across a restart and in the compacted log,
while model keys, comm rows and the latest profile of each configuration stay. Ages are
receipt times on an injected clock."""

from __future__ import annotations

import os

import pytest
import structlog

from estimator import store as store_mod
from estimator.config import EstimatorConfig
from estimator.main import open_store
from estimator.models import profiles, run_key
from estimator.store import (LOG_NAME, MeasurementStore, Retention, Windows, expired_keys, is_meta, read_log,
                             slots, tombstone_keys)
from tessera import config
from tessera.errors import SpecError
from tests.unit.test_estimator_retention import comm, device, step

TTL = 1000.0
T0 = 1.7e9


class Clock:
    """Time the test moves by hand: ``t`` moves the wall clock and the monotonic clock
    together (time passing); ``step`` moves the wall clock alone (a clock step)."""

    def __init__(self, t: float = T0) -> None:
        self.t = t
        self.step = 0.0

    def __call__(self) -> float:
        return self.t + self.step

    def mono(self) -> float:
        return self.t


def clocks(c: Clock) -> dict:
    """The store's clock arguments for ``c``."""
    return {"clock": c, "monotonic": c.mono}


def run(source: str, seq0: int, job: str, n: int = 6, model: str = "gpt:x", **labels) -> list:
    """``n`` steps (1..n) of one single-device run; 5 make a profile point."""
    return [step(source, seq0 + k, job=job, model=model, t=0.01 * (k + 1), i=k + 1, world_size="1", **labels)
            for k in range(n)]


def state(s: MeasurementStore, jobs=("j1", "j2", "j3", "j4", "j5")) -> dict:
    """What a restart must rebuild, expiry included."""
    return {"watermarks": dict(s.watermarks),
            "jobs": {j: s.steps(job_id=j) for j in jobs},
            "job_models": {j: s.steps(j, "gpt:x") for j in jobs},
            "models": {k: s.steps(model_key=k) for k in ("gpt:x", "gpt:y")},
            "runs": {k: dict(v) for k, v in s.runs.items()}, "comm": s.comm_rows,
            "revision": s.model_revision, "count": s.count, "retained": s.retained, "keys": s.keys}


# --- the pure rule -------------------------------------------------------------------------------

def test_expired_keys_rule():
    """job / job_model / source keys expire on age; a run only when it is no profile point or
    a more recent run of its configuration is one; model and comm keys never."""
    recs = (run("p1", 1, "old-a", n=6)                  # 0..5   config A, a profile point, old
            + run("p1", 7, "new-a", n=6)                # 6..11  config A, a profile point, newer but old too
            + run("p1", 13, "late-a", n=2)              # 12..13 config A, no profile point, newest
            + run("p1", 15, "only-b", n=6, batch="16")  # 14..19 config B, the only run
            + run("p1", 21, "stub-c", n=2, batch="32")  # 20..21 config C, no profile point
            + [comm("p1", 23)])                         # 22
    w = Windows(Retention())
    for i, m in enumerate(recs):
        w.add(i, slots(m))
    received = {i: 100.0 + i for i in w.refs}
    key = {j: run_key(next(m for m in recs if m.job_id == j)) for j in ("old-a", "new-a", "late-a", "only-b", "stub-c")}
    assert expired_keys(w, received, now=100.0 + TTL, ttl=TTL) == []  # nothing older than the TTL
    assert expired_keys(w, received, now=1e9, ttl=0) == []                  # 0 disables expiry
    got = expired_keys(w, received, now=1e9, ttl=TTL)
    names = {n for n, _ in got}
    assert "model" not in names and "comm" not in names
    assert {k for n, k in got if n == "job"} == set(key)
    assert {k for n, k in got if n == "source"} == {"p1"}
    # new-a is config A's latest profile point (late-a is none), only-b config B's: pinned
    assert {k for n, k in got if n == "run"} == {key["old-a"], key["late-a"], key["stub-c"]}
    # only the keys older than the TTL: at 100 + 12 + TTL + 0.5, records 0..11 are old
    got = expired_keys(w, received, now=100.0 + 11 + TTL + 0.5, ttl=TTL)
    assert {k for n, k in got if n == "run"} == {key["old-a"]} and ("job", "late-a") not in got


# --- the store -----------------------------------------------------------------------------------

async def populate(s: MeasurementStore, clock: Clock) -> None:
    """Five jobs from source p1, then the clock moves past the TTL and p2 reports: its batch
    triggers the sweep that expires p1's jobs (but not p2's j5)."""
    await s.append(run("p1", 1, "j1", n=30))                # config A, superseded by j2 below
    clock.t += 10
    await s.append(run("p1", 31, "j2") + run("p1", 37, "j3", batch="16", model="gpt:y"))
    await s.append(run("p1", 43, "j4", n=2, batch="32"))      # no profile point
    await s.append([comm("p1", 45)])
    clock.t += TTL + 1
    await s.append(run("p2", 1, "j5", n=3))


async def test_expiry_forgets_jobs_and_sources_but_not_profiles_nor_model_keys(tmp_path):
    clock = Clock()
    s = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    assert s.sweep_interval_s == 60.0  # min(TTL / 10, 60)
    with structlog.testing.capture_logs() as logs:
        await populate(s, clock)
    for j in ("j1", "j2", "j3", "j4"):
        assert s.steps(job_id=j) == [] and s.steps(j, "gpt:x") == []
    assert len(s.steps(job_id="j5")) == 3
    assert len(s.steps(model_key="gpt:x")) == 30 + 6 + 2 + 3 and len(s.steps(model_key="gpt:y")) == 6
    assert s.watermark("p1") == 45 and s.watermark("p2") == 3 and s.count == 48  # watermarks outlive expiry
    assert len(s.comm_rows) == 1
    # j2 is config A's latest profile point, j3 config B's: they stay however old; j5 is fresh
    assert sorted(p.job_id for p in profiles(s.runs)) == ["j2", "j3"]
    assert sorted(k[0] for k in s.runs) == ["j2", "j3", "j5"]
    assert dict(s.expired) == {"job": 4, "job_model": 4, "run": 2, "source": 1}
    (line,) = [e for e in logs if e["event"] == "keys expired"]
    assert line["expired"] == {"job": 4, "job_model": 4, "run": 2, "source": 1}
    # every record is still held by its model key's window (step_window 4096) or the comm window
    assert line["records_dropped"] == 0 and line["keys"]["job"] == 1 and s.retained == 48
    s.close()


async def test_revision_moves_when_a_run_expires(tmp_path):
    clock = Clock()
    s = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    await s.append(run("p1", 1, "j1") + run("p1", 7, "j2"))
    rev = s.model_revision
    clock.t += TTL + 1
    assert await s.sweep() == {"job": 2, "job_model": 2, "run": 1, "source": 1}
    assert s.model_revision == rev + 1 and [k[0] for k in s.runs] == ["j2"]
    assert await s.sweep() == {} and s.model_revision == rev + 1  # nothing more to expire
    s.close()


async def test_a_key_reporting_within_the_ttl_is_kept(tmp_path):
    clock = Clock()
    s = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    await s.append([step("p1", 1, job="j1", model="")])
    clock.t += TTL  # exactly the TTL old: not *longer* than it
    await s.append([step("p2", 1, job="j2", model="")])
    assert await s.sweep() == {}
    clock.t += TTL / 2
    await s.append([step("p1", 2, job="j1", model="")])  # j1 reports again: its age starts over
    clock.t += TTL * 0.75
    assert await s.sweep() == {"job": 1, "source": 1}    # j2 and p2 are older than the TTL now
    assert len(s.steps(job_id="j1")) == 2 and s.steps(job_id="j2") == []
    s.close()


async def test_ages_are_receipt_times_not_measurement_times(tmp_path):
    """A measurement stamped 1970 (``time`` 0) by its sender is as young as its receipt."""
    clock = Clock()
    s = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    m = step("p1", 1, job="j1")
    m.time = 0.0
    await s.append([m])
    assert await s.sweep() == {} and len(s.steps(job_id="j1")) == 1
    s.close()


async def test_expiry_survives_a_restart_whatever_the_clock_or_ttl(tmp_path):
    clock = Clock()
    s = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    await populate(s, clock)
    before = state(s)
    s.close()
    # the log still holds every record (no compaction), yet the expired keys stay expired:
    # with the clock back at the start and expiry off, and with the clock where it was
    for ttl, t in ((0.0, T0), (TTL, clock.t)):
        r = MeasurementStore(tmp_path, key_ttl_s=ttl, **clocks(Clock(t)), compact_bytes=0)
        assert state(r) == before and r.expired == {}  # replaying a tombstone is not a new expiry
        r.close()
    # a job (and source) that reports again after its expiry keeps only its new records
    r = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    assert await r.append([step("p1", 46, job="j1", model="gpt:x")]) == (1, 0)  # above p1's kept watermark
    assert len(r.steps(job_id="j1")) == 1
    after = state(r)
    r.close()
    r = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    assert state(r) == after
    r.close()


async def test_a_source_resending_after_its_expiry_is_still_deduplicated(tmp_path):
    """p1's key expires while it is disconnected (its ack was lost); its resent batch is a
    duplicate, live, after a compaction dropped all its records, and after a restart."""
    clock = Clock()
    s = MeasurementStore(tmp_path, Retention(step_window=2), key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    batch = [step("p1", k, job="j1", model="gpt:x", i=k) for k in (1, 2, 3)]
    assert await s.append(batch) == (3, 0)
    clock.t += TTL + 1
    await s.append([step("p2", k, job="j2", model="gpt:x", i=k) for k in (1, 2)])  # sweeps; evicts p1's records
    assert s.expired["source"] == 1 and s.keys["source"] == 1 and s.watermark("p1") == 3
    assert await s.append(batch) == (0, 3) and len(s.steps(model_key="gpt:x")) == 2
    s.compact_bytes = 1
    await s.sweep()
    assert s.compactions == 1 and all(r.source != "p1" for r in read_log(tmp_path / LOG_NAME)[0])
    assert s.watermark("p1") == 3
    s.close()
    r = MeasurementStore(tmp_path, Retention(step_window=2), key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    assert r.watermark("p1") == 3 and r.watermark("p2") == 2
    assert await r.append(batch) == (0, 3) and await r.append([step("p1", 4, job="j1", i=4)]) == (1, 0)
    r.close()


DAY = 86400.0


async def test_one_wall_clock_spike_neither_expires_nor_misdates(tmp_path):
    """The wall clock reads 30 days ahead during one append (NTP step, VM resume), then is
    right again: nothing expires, the records keep their real receipt times, and keys still
    expire one TTL after their last measurement."""
    clock = Clock()
    s = MeasurementStore(tmp_path, key_ttl_s=7 * DAY, **clocks(clock), compact_bytes=0)
    seq = 0
    for j in range(5):
        for k in range(3):
            seq += 1
            await s.append([step("p1", seq, job=f"j{j}", i=k + 1)])
        clock.t += 600
    keys = s.keys
    with structlog.testing.capture_logs() as logs:
        clock.step = 30 * DAY
        await s.append([step("p2", 1, job="jx", i=1)])  # appends sweep: refused
        assert await s.sweep() == {}
    assert s.expired == {} and s.keys["job"] == keys["job"] + 1 and s.watermark("p1") == 15
    assert any(e["event"].startswith("wall clock disagrees") and e["skew_s"] == 30 * DAY for e in logs)
    assert max(s._rx.values()) == T0 + 3000  # noqa: SLF001 - dated on the receipt clock, not the spike
    clock.step = 0.0
    clock.t += 3600
    await s.append([step("p3", 1, job="jnew", i=1)])
    assert max(s._rx.values()) == T0 + 6600  # noqa: SLF001
    clock.t += 7 * DAY  # one TTL after jnew: the older jobs (and jx, received at the spike) go, jnew stays
    assert await s.sweep() == {"job": 6, "job_model": 6, "source": 2} and len(s.steps(job_id="jnew")) == 1
    clock.t += 1
    assert await s.sweep() == {"job": 1, "job_model": 1, "source": 1}
    s.close()


async def test_a_bad_wall_clock_reading_at_open_expires_nothing(tmp_path):
    clock = Clock()
    s = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    await s.append([step("p1", 1, job="j1")])
    s.close()
    clock.step = 30 * TTL  # the store opens on a spike: its receipt clock starts 30 TTLs ahead
    r = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    clock.step = 0.0
    assert await r.sweep() == {} and len(r.steps(job_id="j1")) == 1  # the wall clock disagrees: refused
    clock.t += r.clock_settle_s  # the correct reading holds: the receipt clock follows it back
    assert await r.sweep() == {} and r.rebases == 1 and r.receipt_time() == clock()
    clock.t += TTL - r.clock_settle_s + 1  # j1 expires one TTL after its receipt, not 30 TTLs early
    assert (await r.sweep())["job"] == 1
    r.close()


async def test_a_wall_clock_step_that_holds_is_followed_and_ages_no_key(tmp_path):
    """A step that holds for ``clock_settle_s`` moves the receipt clock (a rebase record);
    ages stay what the monotonic clock measured, live and after a restart."""
    clock = Clock()
    kw = dict(key_ttl_s=TTL, compact_bytes=0, clock_settle_s=300.0)
    s = MeasurementStore(tmp_path, **clocks(clock), **kw)
    await s.append([step("p1", 1, job="j1")])
    clock.t += 100
    clock.step = 30 * TTL  # forward, for good
    assert await s.sweep() == {} and s.rebases == 0
    clock.t += 299
    assert await s.sweep() == {} and s.rebases == 0
    clock.t += 1
    assert await s.sweep() == {} and s.rebases == 1 and s.receipt_time() == clock()
    assert s._rx == {0: T0 + 30 * TTL}  # noqa: SLF001 - moved with the step: still 400 s old
    await s.append([step("p2", 1, job="j2")])
    clock.t += TTL - 400
    assert await s.sweep() == {}
    clock.t += 1
    assert await s.sweep() == {"job": 1, "job_model": 1, "source": 1} and len(s.steps(job_id="j2")) == 1
    live = full_state(s)
    s.close()
    r = MeasurementStore(tmp_path, **clocks(clock), **kw)  # replays the rebase record
    assert full_state(r) == live
    # back by 40 TTLs, for good: receipt times after the new time are clamped to it
    clock.step = -10 * TTL
    assert await r.sweep() == {}
    clock.t += 300
    assert await r.sweep() == {} and r.rebases == 1 and set(r._rx.values()) == {clock()}  # noqa: SLF001
    live = full_state(r)
    r.close()
    r = MeasurementStore(tmp_path, **clocks(clock), **kw)
    assert full_state(r) == live
    r.close()


async def test_receipt_times_after_the_open_wait_for_the_wall_clock(tmp_path):
    """Records received while the clock was 30 TTLs ahead (a run that opened on a spike):
    after a restart with a correct clock nothing ages at the open (the receipt clock starts
    at their time); expiry waits until the correct reading has held ``clock_settle_s``
    (a rebase record), then they age from there — never expired early, never blocked."""
    clock = Clock()
    clock.step = 30 * TTL
    s = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    await s.append([step("p1", 1, job="j1")])
    s.close()
    clock.step = 0.0
    clock.t += 10
    r = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    assert set(r._rx.values()) == {T0 + 30 * TTL}  # noqa: SLF001 - not moved by the open
    assert await r.sweep() == {}  # the wall clock disagrees with the receipt clock: refused
    clock.t += r.clock_settle_s
    assert await r.sweep() == {} and r.rebases == 1  # followed: receipt times capped at the correct now
    clock.t += TTL + 1
    assert (await r.sweep())["job"] == 1
    r.close()


@pytest.mark.parametrize("compact", [False, True])
async def test_an_open_with_the_clock_behind_never_ages_keys_for_a_later_open(tmp_path, compact):
    """A host whose wall clock reads 30 TTLs behind at one open (before NTP), restarted
    before that step was followed: what that run received and wrote (compaction included)
    must not look old to the next open, with a correct clock."""
    clock = Clock()
    kw = dict(key_ttl_s=TTL, compact_bytes=1 if compact else 0)
    s = MeasurementStore(tmp_path, **clocks(clock), **kw)
    await s.append([step("p1", 1, job="j1", i=1)])
    s.close()
    clock.t += 5
    clock.step = -30 * TTL  # this open reads 30 TTLs behind
    s = MeasurementStore(tmp_path, **clocks(clock), **kw)
    clock.step = 0.0  # NTP fixes it a moment later
    clock.t += 5
    await s.append([step("p2", 1, job="j2", i=1)])
    assert await s.sweep() == {}
    s.close()  # restarted before clock_settle_s
    clock.t += 5
    r = MeasurementStore(tmp_path, **clocks(clock), **kw)
    assert await r.sweep() == {}
    assert len(r.steps(job_id="j1")) == 1 and len(r.steps(job_id="j2")) == 1
    r.close()


async def test_compaction_drops_expired_records_and_keeps_only_needed_tombstones(tmp_path):
    clock = Clock()
    ret = Retention(step_window=4)
    s = MeasurementStore(tmp_path, ret, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    await populate(s, clock)
    before = state(s)
    s.compact_bytes = 1
    await s.sweep()  # nothing more to expire; compacts (most of the log is garbage)
    assert s.compactions == 1
    records, _ = read_log(tmp_path / LOG_NAME)
    data = [r for r in records if not is_meta(r)]
    # p1's records survive only where a model-key window, a pinned run or the comm window holds them
    assert {r.job_id for r in data if r.source == "p1"} <= {"j2", "j3", "j4", ""}
    assert len(data) == s.retained
    tombs = [k for r in records if r.kind == store_mod.EXPIRED_KIND for k in tombstone_keys(r)]
    # j1's records are all gone, so no tombstone names j1; p1 still has records in the log: its
    # source tombstone stays, as do those of j2/j3/j4 (records held by model windows / their runs)
    assert ("job", "j1") not in tombs and ("source", "p1") in tombs and ("job", "j2") in tombs
    assert [r.kind for r in records].count(store_mod.META_KIND) == 1 and records[-1].kind == store_mod.META_KIND
    assert state(s) == before
    s.close()
    for ttl in (0.0, TTL):
        r = MeasurementStore(tmp_path, ret, key_ttl_s=ttl, **clocks(Clock(T0)), compact_bytes=0)
        assert state(r) == before
        r.close()
    # receipt times survive compaction: j5 (received at the end) expires one TTL after it, not before
    later = Clock(clock.t + TTL)
    r = MeasurementStore(tmp_path, ret, key_ttl_s=TTL, **clocks(later), compact_bytes=0)
    assert await r.sweep() == {}
    later.t += 1
    assert await r.sweep() == {"job": 1, "job_model": 1, "run": 1, "source": 1}
    r.close()


async def test_legacy_records_count_as_received_at_open(tmp_path):
    """A log written before receipt markers: its records age from the first open."""
    (tmp_path / LOG_NAME).write_bytes(b"".join(store_mod.encode(m) for m in run("p1", 1, "j1", n=2)))
    clock = Clock()
    s = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    clock.t += TTL
    assert await s.sweep() == {}
    clock.t += 1
    assert (await s.sweep())["job"] == 1 and s.steps(job_id="j1") == []
    s.close()


async def test_a_failed_tombstone_write_expires_nothing(tmp_path, monkeypatch):
    clock = Clock()
    s = MeasurementStore(tmp_path, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    await s.append([step("p1", 1, job="j1")])
    size = (tmp_path / LOG_NAME).stat().st_size
    clock.t += TTL + 1
    real = os.fsync

    def fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(store_mod.os, "fsync", fsync)  # the disk fails
    assert await s.sweep() == {}
    assert len(s.steps(job_id="j1")) == 1 and s.watermark("p1") == 1 and s.expired == {}
    assert (tmp_path / LOG_NAME).stat().st_size == size
    monkeypatch.setattr(store_mod.os, "fsync", real)
    assert (await s.sweep())["job"] == 1
    s.close()


# --- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_key_ttl_must_be_finite_and_not_negative(value):
    with pytest.raises(SpecError) as e:
        EstimatorConfig(key_ttl_s=value)
    assert e.value.field == "key_ttl_s"
    with pytest.raises(ValueError, match="key_ttl_s"):
        MeasurementStore("/nonexistent-never-created", key_ttl_s=value)


def test_key_ttl_precedence_default_and_wiring(tmp_path, monkeypatch):
    for k in [k for k in os.environ if k.startswith("TESSERA_ESTIMATOR_")]:
        monkeypatch.delenv(k)
    assert EstimatorConfig().key_ttl_s == 7 * 86400
    f = tmp_path / "est.yaml"
    f.write_text(f"state_dir: {tmp_path / 'st'}\nkey_ttl_s: 10\n")
    assert config.load(EstimatorConfig, ["--config", str(f)], "TESSERA_ESTIMATOR_").key_ttl_s == 10
    monkeypatch.setenv("TESSERA_ESTIMATOR_KEY_TTL_S", "20")
    assert config.load(EstimatorConfig, ["--config", str(f)], "TESSERA_ESTIMATOR_").key_ttl_s == 20
    cfg = config.load(EstimatorConfig, ["--config", str(f), "--key-ttl-s", "0"], "TESSERA_ESTIMATOR_")
    assert cfg.key_ttl_s == 0
    monkeypatch.setenv("TESSERA_ESTIMATOR_KEY_TTL_S", "-5")
    with pytest.raises(SpecError) as e:
        config.load(EstimatorConfig, ["--config", str(f)], "TESSERA_ESTIMATOR_")
    assert e.value.field == "key_ttl_s"
    clock = Clock()
    s = open_store(EstimatorConfig(state_dir=str(tmp_path / "st"), key_ttl_s=30), clock, clock.mono)
    assert s.key_ttl_s == 30 and s.clock is clock and s.monotonic == clock.mono
    s.close()


# --- replay equivalence under random histories ---------------------------------------------------

def full_state(s: MeasurementStore) -> dict:
    """Every window's content, the runs, watermarks and counters."""
    w = s._w  # noqa: SLF001 - the test compares the whole in-memory state
    return {"last": {n: {k: [v for _, v in d] for k, d in by_key.items()} for n, by_key in w.last.items() if by_key},
            "runs": {k: dict(v) for k, v in w.runs.items()}, "watermarks": dict(s.watermarks),
            "revision": s.model_revision, "count": s.count, "retained": s.retained,
            "received": sorted(s._rx.values())}  # noqa: SLF001


@pytest.mark.parametrize("seed", range(12))
async def test_random_histories_replay_to_the_live_state(tmp_path, seed):
    """Appends from sources that come and go, with jobs that reuse configurations, time
    passing the TTL, wall-clock steps and sweeps: a compacting store equals a plain one at
    every step, and reopening either log (expiry on or off, at the receipt clock's time)
    rebuilds the same state."""
    import random

    rnd = random.Random(seed)
    ret = Retention(step_window=3, run_steps=3, row_window=2)
    clock = Clock()
    plain = MeasurementStore(tmp_path / "p", ret, key_ttl_s=TTL, **clocks(clock), compact_bytes=0)
    comp = MeasurementStore(tmp_path / "c", ret, key_ttl_s=TTL, **clocks(clock), compact_bytes=1)
    seqs: dict[str, int] = {}
    steps: dict[str, int] = {}
    for _ in range(60):
        batch = []
        for _ in range(rnd.randint(1, 6)):
            src = f"p{rnd.randint(1, 3)}"
            seqs[src] = seqs.get(src, 0) + 1
            kind = rnd.random()
            if kind < 0.8:
                job = f"j{rnd.randint(1, 6)}"
                steps[job] = steps.get(job, 0) + rnd.choice((1, 1, 1, -1))  # now and then a step resent
                batch.append(step(src, seqs[src], job=job, model=rnd.choice(("gpt:x", "gpt:y")),
                                  t=rnd.choice((0.01, 0.02, 0.03)), i=max(steps[job], 1), world_size="1",
                                  batch=rnd.choice(("8", "16"))))
            elif kind < 0.9:
                batch.append(comm(src, seqs[src], nbytes=rnd.choice((4096, 8192))))
            else:
                batch.append(device(src, seqs[src]))
        assert await plain.append(batch) == await comp.append(batch)
        r = rnd.random()
        if r < 0.06:  # the wall clock steps (or steps back), for good or for a while
            clock.step = rnd.choice((0.0, 30 * TTL, -30 * TTL, 2 * TTL))
        if r < 0.15:
            clock.t += TTL * rnd.choice((0.5, 1.2, 3))
        elif r < 0.25:
            assert await plain.sweep() == await comp.sweep()
        else:
            clock.t += rnd.random() * 100
        assert full_state(comp) == full_state(plain)
    assert plain.expired and comp.compactions
    live, now = full_state(plain), plain.receipt_time()
    plain.close()
    comp.close()
    for d in ("p", "c"):
        for ttl in (0.0, TTL):
            r = MeasurementStore(tmp_path / d, ret, key_ttl_s=ttl, **clocks(Clock(now)), compact_bytes=0)
            assert full_state(r) == live, (d, ttl)
            r.close()
