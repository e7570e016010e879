"""e2e: `tessera up --detach`, then the CLI against it; the last test takes it down.

Tests run in file order and share one testbed (module fixture `bed`)."""

from __future__ import annotations

import asyncio
import json

import aetcd
import grpc
import pytest

from tessera.api.v1 import controller_pb2, controller_pb2_grpc, types_pb2
from tessera.testbed import find_marked

from _e2e import stop_bed, tiny_manifest

pytestmark = pytest.mark.slow


def test_nodes_json_lists_agents_with_devices(bed):
    r = bed.run("nodes", "-o", "json")
    assert r.returncode == 0, r.stderr
    nodes = {n["name"]: n for n in json.loads(r.stdout)["nodes"]}
    assert set(nodes) == {"node-1", "node-2"}
    for n in nodes.values():
        assert n["state"] == "READY"
        assert [d["kind"] for d in n["devices"]] == ["cpu", "cpu"]
        assert n["agent_address"] == bed.info["addresses"]["nodes"][n["name"]]["agent"]
    # the table form too
    r = bed.run("nodes")
    assert r.returncode == 0 and "node-1" in r.stdout and "READY" in r.stdout


def test_submit_wait_succeeds(bed, tmp_path):
    m = tiny_manifest(tmp_path / "ok.yaml", "e2e-ok", steps=20)
    r = bed.run("submit", str(m), "--wait", "--timeout", "90", "-o", "json")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    job = json.loads(r.stdout)
    assert job["status"]["phase"] == "SUCCEEDED"
    assert int(job["status"]["step"]) == 20
    assert job["status"]["placement"][0]["node"] in ("node-1", "node-2")
    assert "step" in r.stderr  # live progress went to stderr
    # get/list/logs see it
    r = bed.run("get", job["id"])
    assert r.returncode == 0 and "SUCCEEDED" in r.stdout and job["id"] in r.stdout
    r = bed.run("list", "--phase", "succeeded", "--tenant", "e2e", "-o", "json")
    assert job["id"] in [j["id"] for j in json.loads(r.stdout)["jobs"]]
    r = bed.run("logs", job["id"])
    assert r.returncode == 0, r.stderr
    assert "exited with code 0" in r.stdout


def test_get_shows_the_estimate_next_to_the_measured_step_time(bed, tmp_path):
    """The testbed runs the estimator: a model never profiled gets a profiling job, then an estimate."""
    # Input-bound (0.3 s wait for each batch): its own steps are no profile of its model
    # (tessera.modelkey.profile_labels), so the profile comes from the profiling job — a
    # forked executor starts so fast that a plain job's own first steps could profile its
    # model before the controller's profiling cycle (every 1 s) saw it unprofiled; and it
    # runs ~4.5 s, so that the cycle sees it before it ends (a job that finished first
    # never gets a profiling job).
    m = tiny_manifest(tmp_path / "est.yaml", "e2e-est", steps=15, extra_workload="  step_delay_s: 0.3\n")
    # a model no other test submits (hidden 48), so that its first profile is this one's
    m.write_text(m.read_text().replace("hidden: 32", "hidden: 48"))
    r = bed.run("submit", str(m), "--wait", "--timeout", "90", "-o", "json")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    jid = json.loads(r.stdout)["id"]
    job = bed.wait_for(jid, lambda j: j["status"].get("estimate", {}).get("status") == "ok", 90, "an estimate")
    est = job["status"]["estimate"]
    assert est["profile_job_id"] and float(est["step_time_s"]) > 0
    pj = bed.job(est["profile_job_id"])
    assert pj["spec"]["tenant"] == "tessera-system" and pj["spec"]["resources"]["devices"] == 1
    r = bed.run("get", jid)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "step time" in ln)
    assert "ms measured" in line and "ms estimated" in line and "confidence" in line
    # dp=2 of the same model: its per-rank profile plus node-1's loopback all-reduce table
    m2 = tiny_manifest(tmp_path / "est2.yaml", "e2e-est-dp2", steps=5, devices=2)
    m2.write_text(m2.read_text().replace("hidden: 32", "hidden: 48"))
    r = bed.run("submit", str(m2), "-o", "json")
    assert r.returncode == 0, r.stderr
    j2 = bed.wait_for(json.loads(r.stdout)["id"], lambda j: j["status"].get("estimate", {}).get("status") == "ok",
                      120, "a dp=2 estimate")
    assert "all-reduce" in j2["status"]["estimate"]["reason"]


def test_cancel_running_job(bed, tmp_path):
    m = tiny_manifest(tmp_path / "long.yaml", "e2e-long", steps=1_000_000, checkpoint_every=1000)
    r = bed.run("submit", str(m), "-o", "json")
    assert r.returncode == 0, r.stderr
    jid = json.loads(r.stdout)["id"]
    bed.wait_for(jid, lambda j: j["status"]["phase"] == "RUNNING" and int(j["status"]["step"]) > 0, 60, "RUNNING with progress")
    r = bed.run("cancel", jid, "-o", "json")
    assert r.returncode == 0, r.stderr
    j = bed.wait_for(jid, lambda j: j["status"]["phase"] == "CANCELLED", 30, "CANCELLED")
    assert j["status"]["phase"] == "CANCELLED"
    # cancelling again is a no-op; the device is free again
    assert bed.run("cancel", jid).returncode == 0


async def _etcd_mentions(endpoint: str, needle: bytes) -> list[bytes]:
    host, port = endpoint.rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port)) as c:
        kvs = await c.get_prefix(b"/")
        return [kv.key for kv in kvs if needle in kv.key or needle in (kv.value or b"")]


MALFORMED = {
    "unknown-field": ("  bogus_field: 1\n", "workload.bogus_field"),
    "negative-steps": (None, "workload.steps"),
    "wrong-type": ("  batch_size: eight\n", "workload.batch_size"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_manifest_refused_and_nothing_written(bed, tmp_path, case):
    extra, field = MALFORMED[case]
    name = f"e2e-bad-{case}"
    m = tiny_manifest(tmp_path / "bad.yaml", name, steps=-5 if extra is None else 20)
    if extra:
        text = m.read_text().replace("  batch_size: 4\n", "") if "batch_size" in extra else m.read_text()
        m.write_text(text.replace("  plan:", extra + "  plan:"))
    r = bed.run("submit", str(m))
    assert r.returncode == 2, f"{r.stdout}\n{r.stderr}"
    assert field in r.stderr, r.stderr
    assert asyncio.run(_etcd_mentions(bed.info["addresses"]["etcd"], name.encode())) == []


def test_server_refuses_invalid_spec_too(bed):
    """The same negative steps sent straight over gRPC (no local validation)."""
    spec = types_pb2.JobSpec(api_version="tessera/v1", name="e2e-raw-bad", tenant="e2e",
                             workload=types_pb2.Workload(type="gpt", steps=-5),
                             resources=types_pb2.Resources(devices=1, device_kind="cpu"))
    with grpc.insecure_channel(bed.info["controller"]) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            controller_pb2_grpc.JobServiceStub(ch).SubmitJob(
                controller_pb2.SubmitJobRequest(spec=spec, idempotency_key="e2e-raw-bad"), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "workload.steps" in ei.value.details()
    assert asyncio.run(_etcd_mentions(bed.info["addresses"]["etcd"], b"e2e-raw-bad")) == []


def test_unknown_job_is_not_found(bed):
    r = bed.run("get", "j-000000000000")
    assert r.returncode == 1
    assert "NOT_FOUND" in r.stderr


def test_down_leaves_no_process_behind(bed):
    marker = bed.info["marker"]
    pids = [p["pid"] for p in bed.info["processes"]]
    assert find_marked(marker), "the testbed should be running before down"
    left = stop_bed(bed)
    assert left == []
    assert find_marked(marker) == []
    assert not (bed.dir / "testbed.json").exists()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"), f"pid {pid} still running"
        except FileNotFoundError:
            pass
    # with no testbed, the CLI explains how to find a controller
    r = bed.run("nodes")
    assert r.returncode == 2 and "TESSERA_CONTROLLER" in r.stderr  # a usage error: no server was asked
