"""e2e: a node dies (its agent and executors SIGKILLed) while running a job; after the
controller's grace period the job goes back to PENDING, runs on the other node from its
last checkpoint, and succeeds."""

from __future__ import annotations

import json
import os
import signal

import pytest
from _e2e import start_bed, stop_bed, tiny_manifest

from tessera.testbed import find_marked

pytestmark = pytest.mark.slow

GRACE_S = 3.0


@pytest.fixture(scope="module")
def bed3(tmp_path_factory):
    b = start_bed(tmp_path_factory.mktemp("bed-loss"), agents=2, cpu_devices=2, grace_s=GRACE_S)
    try:
        yield b
    finally:
        if (b.dir / "testbed.json").exists():
            assert stop_bed(b) == []


def test_killed_agent_job_requeued_and_finishes_elsewhere(bed3, tmp_path):
    m = tiny_manifest(tmp_path / "loss.yaml", "e2e-node-loss", steps=300, checkpoint_every=20)
    r = bed3.run("submit", str(m), "-o", "json")
    assert r.returncode == 0, r.stderr
    jid = json.loads(r.stdout)["id"]
    j = bed3.wait_for(jid, lambda j: j["status"]["phase"] == "RUNNING" and int(j["status"]["step"]) >= 40, 120,
                      "RUNNING past its first checkpoint")
    victim = j["status"]["placement"][0]["node"]
    agent = next(p for p in bed3.info["processes"] if p["name"] == f"{victim}-agent")

    # The node dies: its agent and the job's executors vanish at once.
    os.kill(agent["pid"], signal.SIGKILL)
    execs = find_marked(jid, key="TESSERA_JOB_ID")
    assert execs, "the job's executor should be running on the victim node"
    for pid in execs:
        os.kill(pid, signal.SIGKILL)

    final = bed3.wait_for(jid, lambda j: j["status"]["phase"] in ("SUCCEEDED", "FAILED", "CANCELLED"), 180, "a terminal phase")
    st = final["status"]
    assert st["phase"] == "SUCCEEDED", st
    phases = [h["phase"] for h in st["history"]]
    first_run = phases.index("RUNNING")
    assert "PENDING" in phases[first_run:], phases  # requeued after the node was lost
    assert [s["node"] for s in st["placement"]] != [victim]
    assert st["attempts"] >= 2
    assert int(st["step"]) == 300

    r = bed3.run("nodes", "-o", "json")
    states = {n["name"]: n["state"] for n in json.loads(r.stdout)["nodes"]}
    assert states[victim] == "NOT_READY"
