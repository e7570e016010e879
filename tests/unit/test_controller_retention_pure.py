"""Retention of finished jobs, the pure part: which jobs are expired at a given time
(``controller.core.expired_jobs`` / ``finished_at``, the clock injected as ``now``), and the
``finished_job_ttl_s`` setting (flag, env, file; negative is an error naming it)."""

from __future__ import annotations

import pytest

from controller.config import ControllerConfig
from controller.core import expired_jobs, finished_at
from tessera import config
from tessera.api.v1 import types_pb2 as tpb
from tessera.errors import SpecError

P = tpb.JobPhase
DAY = 86400.0
NOW = 100 * DAY
TTL = 7 * DAY


def job(jid: str, phase: int, ended: float | None = None, *, created: float = 1.0, fused_into: str = "",
        profile_job: str = "") -> tpb.Job:
    """A job that was PENDING at ``created`` and, when ``ended`` is given, entered ``phase`` then."""
    j = tpb.Job(id=jid, created=created)
    j.status.history.add(phase=P.PENDING, time=created, reason="submitted")
    if ended is not None:
        j.status.history.add(phase=phase, time=ended, reason="ended")
    j.status.phase = phase
    j.status.fused_into = fused_into
    if profile_job:
        j.status.estimate.profile_job_id = profile_job
    return j


def ids(jobs) -> list[str]:
    return [j.id for j in jobs]


def test_finished_at_is_the_last_entry_into_the_terminal_phase_with_fallbacks():
    j = job("a", P.FAILED, 50.0)
    j.status.history.add(phase=P.RUNNING, time=60.0, reason="odd later entry")
    assert finished_at(j) == 50.0
    # Older records: no entry of the current phase -> the last entry of any phase; none -> created.
    k = job("b", P.SUCCEEDED, created=5.0)
    k.status.history.add(phase=P.RUNNING, time=40.0, reason="running")
    assert finished_at(k) == 40.0
    bare = tpb.Job(id="c", created=7.0)
    bare.status.phase = P.CANCELLED
    assert finished_at(bare) == 7.0


def test_only_terminal_jobs_older_than_the_ttl_expire():
    jobs = [
        job("old-ok", P.SUCCEEDED, NOW - TTL - 1),
        job("old-failed", P.FAILED, NOW - 30 * DAY),
        job("old-cancelled", P.CANCELLED, NOW - 8 * DAY),
        job("young", P.SUCCEEDED, NOW - TTL + 1),
        job("exactly-ttl", P.SUCCEEDED, NOW - TTL),
        # Active ones are kept however old they are.
        job("pending", P.PENDING, created=1.0),
        job("scheduled", P.SCHEDULED, 2.0),
        job("running", P.RUNNING, 3.0),
    ]
    # Longest-finished first.
    assert ids(expired_jobs(jobs, NOW, TTL)) == ["old-failed", "old-cancelled", "old-ok"]
    # The clock moves: the young one expires later.
    assert "young" in ids(expired_jobs(jobs, NOW + 2, TTL))


def test_ttl_zero_keeps_everything_and_the_limit_bounds_a_round():
    jobs = [job(f"j{i}", P.SUCCEEDED, float(i)) for i in range(20)]
    assert expired_jobs(jobs, NOW, 0) == []
    assert ids(expired_jobs(jobs, NOW, TTL, limit=5)) == ["j0", "j1", "j2", "j3", "j4"]
    assert expired_jobs(jobs, NOW, TTL, limit=0) == []


def test_a_fused_guest_is_kept_while_its_host_is_active_and_a_host_while_a_kept_guest_names_it():
    host = job("host", P.RUNNING, 1.0)
    guest = job("guest", P.SUCCEEDED, 10.0, fused_into="host")
    assert expired_jobs([host, guest], NOW, TTL) == []
    host_done = job("host", P.SUCCEEDED, 20.0)
    assert ids(expired_jobs([host_done, guest], NOW, TTL)) == ["guest", "host"]
    # An old finished host whose guest is still young (or active): the host stays.
    young_guest = job("guest", P.CANCELLED, NOW - 1, fused_into="host")
    assert expired_jobs([host_done, young_guest], NOW, TTL) == []
    active_guest = job("guest", P.RUNNING, 1.0, fused_into="host")
    assert expired_jobs([host_done, active_guest], NOW, TTL) == []


def test_a_profiling_job_named_by_a_kept_job_estimate_is_kept():
    prof = job("profile", P.FAILED, 1.0)
    user = job("user", P.RUNNING, 2.0, profile_job="profile")
    assert expired_jobs([prof, user], NOW, TTL) == []
    # Both expired: both go (nothing left to re-profile for), the job naming the profiling
    # job first although it finished later: never a stored job naming a removed one.
    user_done = job("user", P.SUCCEEDED, 3.0, profile_job="profile")
    assert ids(expired_jobs([prof, user_done], NOW, TTL)) == ["user", "profile"]
    # A round cut at the limit takes the job naming it, and leaves the profiling job.
    assert ids(expired_jobs([prof, user_done], NOW, TTL, limit=1)) == ["user"]


def test_protection_is_transitive():
    # host <- guest (old, kept because it names a profiling job ... kept by a young job).
    prof = job("profile", P.SUCCEEDED, 1.0)
    young = job("young", P.SUCCEEDED, NOW - 1, profile_job="guest")
    host = job("host", P.SUCCEEDED, 3.0)
    guest = job("guest", P.SUCCEEDED, 2.0, fused_into="host", profile_job="profile")
    assert expired_jobs([prof, young, host, guest], NOW, TTL) == []


def test_kept_jobs_do_not_use_up_the_limit():
    # The longest-finished candidates are all kept (guests of a running host): the limit
    # is applied to the removable ones only, so the others still go (it used to cut the
    # candidates to the limit first, and then remove nothing, every round).
    host = job("host", P.RUNNING, 1.0)
    guests = [job(f"g{i:03d}", P.SUCCEEDED, 10.0 + i, fused_into="host") for i in range(20)]
    others = [job(f"x{i:03d}", P.SUCCEEDED, 100.0 + i) for i in range(8)]
    jobs = [host, *guests, *others]
    assert ids(expired_jobs(jobs, NOW, TTL, limit=5)) == [f"x{i:03d}" for i in range(5)]
    assert ids(expired_jobs(jobs, NOW, TTL, limit=20)) == [f"x{i:03d}" for i in range(8)]


def test_every_job_comes_after_the_removable_jobs_naming_it_also_when_cut():
    # prof <- a (estimate), prof <- b (estimate); host <- guest (fused_into) with the guest
    # naming prof too; an unrelated one in between. Longest-finished first otherwise.
    prof = job("prof", P.FAILED, 1.0)
    host = job("host", P.SUCCEEDED, 2.0)
    lone = job("lone", P.SUCCEEDED, 3.0)
    a = job("a", P.SUCCEEDED, 4.0, profile_job="prof")
    guest = job("guest", P.SUCCEEDED, 5.0, fused_into="host", profile_job="prof")
    b = job("b", P.CANCELLED, 6.0, profile_job="prof")
    jobs = [b, guest, a, lone, host, prof]
    order = ids(expired_jobs(jobs, NOW, TTL))
    assert sorted(order) == sorted(ids(jobs))
    for j in jobs:
        for ref in (j.status.fused_into, j.status.estimate.profile_job_id):
            if ref:
                assert order.index(j.id) < order.index(ref), order
    assert order == ["a", "guest", "b", "prof", "host", "lone"]
    for limit in range(1, len(jobs) + 1):
        cut = ids(expired_jobs(jobs, NOW, TTL, limit=limit))
        assert cut == order[:limit]
        # Nothing named by a job left stored is in the cut.
        left = {j.id: j for j in jobs if j.id not in cut}
        named = {r for j in left.values() for r in (j.status.fused_into, j.status.estimate.profile_job_id) if r}
        assert not named & set(cut), (limit, cut)


def test_config_field_flag_env_file_and_negative_is_an_error(tmp_path, monkeypatch):
    assert ControllerConfig().finished_job_ttl_s == 7 * DAY
    assert config.load(ControllerConfig, ["--finished-job-ttl-s", "60"], "TESSERA_CONTROLLER_").finished_job_ttl_s == 60
    f = tmp_path / "c.yaml"
    f.write_text("finished_job_ttl_s: 0\n")
    assert config.load(ControllerConfig, ["--config", str(f)], "TESSERA_CONTROLLER_").finished_job_ttl_s == 0
    monkeypatch.setenv("TESSERA_CONTROLLER_FINISHED_JOB_TTL_S", "3600")
    assert config.load(ControllerConfig, ["--config", str(f)], "TESSERA_CONTROLLER_").finished_job_ttl_s == 3600
    with pytest.raises(SpecError) as e:
        config.load(ControllerConfig, ["--finished-job-ttl-s", "-1"], "TESSERA_CONTROLLER_")
    assert e.value.field == "finished_job_ttl_s" and "finished_job_ttl_s" in str(e.value)
    with pytest.raises(SpecError):
        ControllerConfig(finished_job_ttl_s=-0.5)


def test_the_daemon_refuses_a_negative_ttl(capsys):
    from controller import main as cmain

    assert cmain.main(["--finished-job-ttl-s", "-5"]) == 2
    assert "finished_job_ttl_s" in capsys.readouterr().err
