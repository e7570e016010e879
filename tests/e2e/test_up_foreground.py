"""e2e: `tessera up` in the foreground stops the whole cluster on Ctrl-C (SIGINT), and a
`tessera down` from another shell stops a foreground testbed through its owner."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from _e2e import REPO, cli, require_etcd

from tessera.testbed import find_marked

pytestmark = pytest.mark.slow


def _start_foreground(root):
    require_etcd()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TESSERA_CONTROLLER", None)
    proc = subprocess.Popen([sys.executable, "-m", "tessera.cli", "up", "--agents", "1", "--cpu-devices", "1"],
                            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # progress lines until the cluster is ready
        lines.append(line)
        if "press Ctrl-C" in line:
            break
    else:
        pytest.fail("tessera up ended before it was ready:\n" + "".join(lines))
    info = json.loads((root / ".tessera" / "testbed.json").read_text())
    assert find_marked(info["marker"])
    return proc, info


@pytest.mark.parametrize("how", ["sigint", "down"])
def test_foreground_up_stops_everything(tmp_path, how):
    proc, info = _start_foreground(tmp_path)
    try:
        if how == "sigint":
            proc.send_signal(signal.SIGINT)
        else:
            r = cli("down", cwd=tmp_path, timeout=120)
            assert r.returncode == 0, r.stderr
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert find_marked(info["marker"]) == []
    assert not (tmp_path / ".tessera" / "testbed.json").exists()


def test_second_up_is_refused_and_down_reports_what_the_foreground_up_stopped(tmp_path):
    """A second `up` in the directory of a running foreground `up` is refused at once (exit 1)
    and leaves that cluster running; `down -o json` then lists the processes stopped."""
    proc, info = _start_foreground(tmp_path)
    try:
        r = cli("up", "--detach", "--agents", "1", "--cpu-devices", "1", cwd=tmp_path, timeout=60)
        assert r.returncode == 1 and "already running" in r.stderr, r.stderr
        assert cli("nodes", cwd=tmp_path, timeout=60).returncode == 0  # the first cluster still serves
        r = cli("down", "-o", "json", cwd=tmp_path, timeout=120)
        assert r.returncode == 0, r.stderr
        stopped = json.loads(r.stdout)["stopped"]
        assert set(stopped) == {p["name"] for p in info["processes"]}
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cli("down", cwd=tmp_path, timeout=120)
    assert find_marked(info["marker"]) == []
