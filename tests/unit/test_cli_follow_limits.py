"""The CLI at the limits of following jobs, without servers: `submit --wait --timeout`
and `demo --timeout` (the demo still prints its summary, -o json valid, exit 1), a watch
that loses the controller (a note once, then exit 1), `down -o json` with no testbed."""

from __future__ import annotations

import io
import json

import grpc
import pytest
from rich.console import Console

from tessera import cli, testbed
from tessera.api.v1 import controller_pb2, types_pb2
from tessera.client import TesseraError

GOOD = """apiVersion: tessera/v1
kind: Job
name: slow
workload: {type: gpt, steps: 100}
resources: {devices: 1}
"""


def job(jid, phase, step=0):
    j = types_pb2.Job(id=jid)
    j.spec.name = "slow"
    j.spec.workload.steps = 100
    j.status.phase = phase
    j.status.step = step
    return j


class Client:
    """Submits, then its watch shows the job RUNNING and ends with ``error``; ``get``
    reads a later state."""

    def __init__(self, error, notes=()):
        self.error, self.notes, self.n = error, list(notes), 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def submit(self, spec, idempotency_key=None):
        self.n += 1
        return job(f"j-00000000000{self.n}", types_pb2.PENDING)

    def get(self, job_id):
        return job(job_id, types_pb2.RUNNING, 42)

    def watch(self, job_id="", tenant="", start_revision=0, timeout=None, on_retry=None):
        for i in range(1, self.n + 1):
            yield controller_pb2.JobEvent(job=job(f"j-00000000000{i}", types_pb2.RUNNING, 7), revision=i)
        for note in self.notes:
            on_retry(note)
        raise self.error


def run(argv, client):
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(argv, client_factory=lambda address: client,
                    out=Console(file=out, width=200, soft_wrap=True), err=Console(file=err, width=200, soft_wrap=True))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def manifest(tmp_path):
    p = tmp_path / "slow.yaml"
    p.write_text(GOOD)
    return p


@pytest.fixture
def fake_testbed(monkeypatch):
    calls = []
    monkeypatch.setattr(testbed.Testbed, "up", lambda self, **kw: calls.append("up") or {"controller": "127.0.0.1:1"})
    monkeypatch.setattr(testbed.Testbed, "down", lambda self, timeout=20.0: calls.append("down") or [])
    return calls


TIMEOUT = TesseraError(grpc.StatusCode.DEADLINE_EXCEEDED, "the jobs did not finish within 5s (...)")


def test_demo_timeout_still_emits_the_json_summary_and_exits_1(manifest, fake_testbed, tmp_path):
    code, out, err = run(["demo", str(manifest), str(manifest), "--dir", str(tmp_path / "tb"), "--timeout", "5",
                          "-o", "json"], Client(TIMEOUT))
    assert code == 1
    d = json.loads(out)
    assert d["ok"] is False and d["timed_out"] is True
    assert [(j["id"], j["phase"], j["steps"]) for j in d["jobs"]] == [
        ("j-000000000001", "RUNNING", 42), ("j-000000000002", "RUNNING", 42)]  # each read once after the timeout
    assert "within 5s" in err
    assert fake_testbed == ["up", "down"]


def test_demo_timeout_table_summary(manifest, fake_testbed, tmp_path):
    code, out, err = run(["demo", str(manifest), "--dir", str(tmp_path / "tb"), "--timeout", "5"], Client(TIMEOUT))
    assert code == 1 and "0/1 succeeded" in out and "RUNNING" in out


def test_demo_other_errors_still_propagate(manifest, fake_testbed, tmp_path):
    gone = TesseraError(grpc.StatusCode.UNAVAILABLE, "controller 127.0.0.1:1 unreachable for 30s")
    code, out, err = run(["demo", str(manifest), "--dir", str(tmp_path / "tb")], Client(gone))
    assert code == 1 and "UNAVAILABLE" in err and fake_testbed == ["up", "down"]


def test_submit_wait_notes_a_lost_controller_once_then_exits_1(manifest):
    gone = TesseraError(grpc.StatusCode.UNAVAILABLE, "controller 127.0.0.1:1 unreachable for 30s while following job j")
    code, out, err = run(["submit", str(manifest), "--wait", "--controller", "127.0.0.1:1"],
                         Client(gone, notes=["controller 127.0.0.1:1 unreachable, retrying for up to 30s…"]))
    assert code == 1
    assert err.count("unreachable, retrying") == 1
    assert "error: UNAVAILABLE: controller 127.0.0.1:1 unreachable for 30s" in err


def test_down_json_without_a_testbed_is_valid_json(tmp_path):
    code, out, err = run(["down", "--dir", str(tmp_path / "none"), "-o", "json"], None)
    assert code == 0 and json.loads(out) == {"stopped": []}
    assert "nothing to stop" in err


def test_readme_states_the_watch_give_up_time():
    from pathlib import Path

    from tessera.client import WATCH_GIVE_UP_S

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert f"after {WATCH_GIVE_UP_S:.0f} s unreachable in a row" in readme
