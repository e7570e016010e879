"""e2e: the 8-task LoRA example on a testbed; every task is a job of its own to its tenant
(`tessera get JOB/TASK`, `tessera list --tasks`), and `tessera cancel JOB/TASK` stops one
task through the agent and the executor's control file while the others finish."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tessera.api.v1 import types_pb2
from tessera.client import Client

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lora-8tasks.yaml"
STEPS = {"t5": 40, "t7": 80}  # the others take the example's default, 60


def test_lora_8tasks_every_task_learns_and_is_its_own_job(bed):
    r = bed.run("submit", str(EXAMPLE), "--wait", "--timeout", "180", "-o", "json", timeout=240)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    job = json.loads(r.stdout)
    assert job["status"]["phase"] == "SUCCEEDED"
    jid = job["id"]
    assert sorted(t["name"] for t in job["status"]["tasks"]) == [f"t{i}" for i in range(8)]

    with Client(bed.info["controller"]) as c:
        listed = c.list(tenant="demo", include_tasks=True)
    tasks = [j for j in listed if j.parent_id == jid]
    assert [j.id for j in tasks] == [f"{jid}/t{i}" for i in range(8)]
    for t in tasks:
        name = t.id.split("/")[1]
        assert t.spec.tenant == "demo"
        assert t.status.phase == types_pb2.SUCCEEDED, (t.id, t.status.reason)
        assert t.status.step == t.status.total_steps == STEPS.get(name, 60)
        assert 0 < t.status.loss < t.status.first_loss, (t.id, t.status.first_loss, t.status.loss)
        assert t.status.tasks[0].tokens_per_s > 0

    r = bed.run("get", f"{jid}/t5", "-o", "json")
    assert r.returncode == 0, r.stderr
    t5 = json.loads(r.stdout)
    assert t5["parent_id"] == jid and t5["status"]["phase"] == "SUCCEEDED" and int(t5["status"]["step"]) == 40
    r = bed.run("get", jid)
    assert r.returncode == 0 and f"{jid}/t7" in r.stdout  # the tasks table
    r = bed.run("list", "--tasks", "--tenant", "demo")
    assert r.returncode == 0 and f"{jid}/t3" in r.stdout
    r = bed.run("get", f"{jid}/nope")
    assert r.returncode == 1 and "NOT_FOUND" in r.stderr


def test_cancel_one_task_mid_run_the_others_finish(bed, tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["name"] = "lora-cancel"
    t7 = next(t for t in doc["workload"]["peft"]["tasks"] if t["name"] == "t7")
    t7["steps"] = 1_000_000  # would outlive the others by far: it ends only by being cancelled
    m = tmp_path / "lora-cancel.yaml"
    m.write_text(yaml.safe_dump(doc))
    r = bed.run("submit", str(m), "-o", "json")
    assert r.returncode == 0, r.stderr
    jid = json.loads(r.stdout)["id"]

    with Client(bed.info["controller"]) as c:
        # Event-driven: follow the parent's record until t7 has trained at least once.
        for ev in c.watch(job_id=jid, timeout=120):
            t = next((x for x in ev.job.status.tasks if x.name == "t7"), None)
            if t is not None and t.step > 0:
                break
        r = bed.run("cancel", f"{jid}/t7", "-o", "json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["id"] == f"{jid}/t7"
        final = c.wait(jid, timeout=180)
        assert final.status.phase == types_pb2.SUCCEEDED, final.status.reason
        views = {v.id.split("/")[1]: v for v in c.list(tenant="demo", include_tasks=True) if v.parent_id == jid}
    assert views["t7"].status.phase == types_pb2.CANCELLED
    assert 0 < views["t7"].status.step < 1_000_000
    for name, v in views.items():
        if name != "t7":
            assert v.status.phase == types_pb2.SUCCEEDED and v.status.step == STEPS.get(name, 60), name
    # Cancelling it again is a no-op; a finished task cannot be cancelled.
    assert bed.run("cancel", f"{jid}/t7").returncode == 0
    r = bed.run("cancel", f"{jid}/t0")
    assert r.returncode == 1 and "FAILED_PRECONDITION" in r.stderr

