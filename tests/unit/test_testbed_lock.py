"""One testbed per directory: ``up``/``down`` hold ``<dir>/.lock``; a second ``up`` in the
same directory is refused at once and touches nothing; a failed start stops only what it
started (never the testbed recorded in testbed.json); ``down`` of a foreground ``up``
reports the processes that up stopped. No daemons are started: ``_start`` is stubbed or
fails, and the "processes" are sleepers carrying a marker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tessera import cli, testbed
from tessera.procfs import process_start_ticks


def _sleeper(marker: str) -> subprocess.Popen:
    env = dict(os.environ, **{testbed.MARKER_ENV: marker})
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)


def _recorded_controller(tmp_path, marker: str, procs: list) -> subprocess.Popen:
    """A sleeper carrying ``marker``, recorded in ``tmp_path/testbed.json`` as the testbed's
    controller (as a running testbed records it)."""
    p = _sleeper(marker)
    procs.append(p)
    (tmp_path / "testbed.json").write_text(json.dumps({"marker": marker, "processes": [
        {"name": "controller", "pid": p.pid, "log": "", "cmd": [], "address": "", "role": "controller"}]}))
    return p


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture
def no_etcd_check(monkeypatch):
    monkeypatch.setattr(testbed, "find_etcd", lambda: "etcd")


def _fake_start(self, *args, **kw):
    self.info = {"marker": "m-fake", "controller": "127.0.0.1:1", "processes": []}
    return self.info


def test_second_up_in_one_dir_is_refused_at_once_touching_nothing(tmp_path, monkeypatch, no_etcd_check):
    monkeypatch.setattr(testbed.Testbed, "_start", _fake_start)
    first = testbed.Testbed(tmp_path)
    first.up()  # holds the lock, as a starting or foreground `up` does
    (tmp_path / "etcd").mkdir()
    (tmp_path / "etcd" / "data").write_text("the winner's")
    (tmp_path / "logs" / "etcd.log").write_text("the winner's")
    second = testbed.Testbed(tmp_path)
    with pytest.raises(testbed.TestbedError) as ei:
        second.up()
    msg = str(ei.value)
    assert "starting or already running" in msg and str(tmp_path) in msg and str(os.getpid()) in msg
    assert f"tessera down --dir {tmp_path}" in msg
    assert (tmp_path / "etcd" / "data").read_text() == "the winner's"  # no state wiped
    assert (tmp_path / "logs" / "etcd.log").read_text() == "the winner's"
    first.down(timeout=1)  # releases the lock
    second.up()
    second.down(timeout=1)


def test_detach_releases_the_lock(tmp_path, monkeypatch, no_etcd_check):
    monkeypatch.setattr(testbed.Testbed, "_start", _fake_start)
    first = testbed.Testbed(tmp_path)
    first.up()
    first.detach()
    other = testbed.Testbed(tmp_path)
    assert other._try_lock()
    other._release()


def test_failed_start_stops_only_what_it_started(tmp_path, monkeypatch, no_etcd_check, procs):
    """The start fails after another run recorded its testbed in testbed.json (the race of
    two `up`s): the cleanup must not fall back to that record and stop its processes."""
    winner = _sleeper(f"{tmp_path}:winner")
    procs.append(winner)

    def failing_etcd(self, timeout):
        (tmp_path / "testbed.json").write_text(json.dumps({
            "marker": f"{tmp_path}:winner", "controller": "127.0.0.1:1", "up_pid": None,
            "processes": [{"name": "etcd", "pid": winner.pid, "log": "", "cmd": [], "address": "", "role": "etcd"}]}))
        raise RuntimeError("etcd not healthy")

    monkeypatch.setattr(testbed.Testbed, "_start_etcd", failing_etcd)
    tb = testbed.Testbed(tmp_path)
    with pytest.raises(testbed.TestbedError, match="etcd not healthy"):
        tb.up(timeout=1)
    assert winner.poll() is None  # the other testbed is untouched
    assert (tmp_path / "testbed.json").exists()
    assert tb._try_lock()  # and the failed up released the lock
    tb._release()


def test_refusal_of_a_running_testbed_names_the_dir_for_down(tmp_path, no_etcd_check, procs):
    p = _recorded_controller(tmp_path, f"{tmp_path}:old", procs)
    with pytest.raises(testbed.TestbedError) as ei:
        testbed.Testbed(tmp_path).up()
    assert "already running" in str(ei.value) and f"`tessera down --dir {tmp_path}`" in str(ei.value)


def test_down_waits_for_the_lock_then_refuses(tmp_path, procs):
    holder = testbed.Testbed(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    assert holder._try_lock()  # a starting `up` (no record yet)
    p = _recorded_controller(tmp_path, f"{tmp_path}:m", procs)
    try:
        with pytest.raises(testbed.TestbedError, match="is starting or stopping the testbed"):
            testbed.Testbed(tmp_path).down(timeout=0.3)
        assert p.poll() is None
    finally:
        holder._release()
    assert testbed.Testbed(tmp_path).down(timeout=5) == ["controller"]


def test_down_of_a_foreground_up_reports_what_the_up_stopped(tmp_path, procs):
    """`tessera down` of a foreground `up` asks that up to stop the cluster; the processes
    recorded and gone by the time it has finished are reported as stopped."""
    owner = _sleeper("the-up-process")  # stands for the foreground `tessera up` (SIGTERM ends it)
    procs.append(owner)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # a recorded daemon the up has already stopped
    (tmp_path / "testbed.json").write_text(json.dumps({
        "marker": f"{tmp_path}:m", "up_pid": owner.pid, "up_start": process_start_ticks(owner.pid),
        "processes": [{"name": "controller", "pid": done.pid, "log": "", "cmd": [], "address": "", "role": "controller"}]}))
    assert testbed.Testbed(tmp_path).down(timeout=5) == ["controller"]
    assert owner.wait(5) == -15


def test_cli_up_refused_exits_1_and_demo_does_not_stop_the_other_testbed(tmp_path, monkeypatch, no_etcd_check, procs):
    import io

    from rich.console import Console

    monkeypatch.setattr(testbed.Testbed, "_start", _fake_start)
    first = testbed.Testbed(tmp_path)
    first.up()
    p = _recorded_controller(tmp_path, f"{tmp_path}:winner", procs)
    try:
        for argv in (["up", "--dir", str(tmp_path)], ["demo", "--dir", str(tmp_path), "--examples", "examples"]):
            err = io.StringIO()
            code = cli.main(argv, out=Console(file=io.StringIO()), err=Console(file=err, width=300))
            assert code == 1, err.getvalue()
            assert "already running" in err.getvalue()
            assert p.poll() is None, argv  # the testbed of the other run still runs
    finally:
        first._release()
