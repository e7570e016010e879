"""e2e: `tessera demo` on a directory of manifests — a tiny GPT job and three of the
shipped examples as they are (the multimodal ones colocated on one device and
disaggregated over two ranks, the 8-task LoRA job): up, submit all, every job and task
succeeds with its loss falling, summary, down. One demo run for all of them: each
demo starts and stops a whole testbed, and the jobs share its devices as a user's would."""

from __future__ import annotations

import shutil

import pytest
from _e2e import REPO, cli, require_etcd, run_demo, tiny_manifest

pytestmark = pytest.mark.slow

LORA_STEPS = {"t5": 40, "t7": 80}  # lora-8tasks.yaml: the others take its default, 60


def test_demo_runs_every_manifest_every_job_learns_and_tears_down(tmp_path):
    require_etcd()
    ex = tmp_path / "examples"
    ex.mkdir()
    tiny_manifest(ex / "a.yaml", "demo-a", steps=15)
    for name in ("mm-colocated.yaml", "mm-disagg.yaml", "lora-8tasks.yaml"):
        shutil.copy(REPO / "examples" / name, ex / name)
    summary = run_demo(tmp_path, ex, 300, 420)
    jobs = {j["job"]: j for j in summary["jobs"]}
    assert sorted(jobs) == ["demo-a", "lora-8tasks", "mm-colocated", "mm-disagg"]
    a = jobs["demo-a"]
    assert a["phase"] == "SUCCEEDED" and a["steps"] == 15 and a["final_loss"] > 0
    for name in ("mm-colocated", "mm-disagg"):
        j = jobs[name]
        assert j["phase"] == "SUCCEEDED" and j["steps"] == 60
        assert 0 < j["final_loss"] < 0.7 * j["first_loss"], j
    lora = jobs["lora-8tasks"]
    assert lora["phase"] == "SUCCEEDED"
    assert [t["task"] for t in lora["tasks"]] == [f"t{i}" for i in range(8)]
    for t in lora["tasks"]:
        assert t["phase"] == "SUCCEEDED" and t["steps"] == LORA_STEPS.get(t["task"], 60)
        assert 0 < t["final_loss"] < t["first_loss"], t
    assert not (tmp_path / ".tessera" / "demo" / "testbed.json").exists()  # torn down


def test_demo_refuses_invalid_manifest_before_starting(tmp_path):
    ex = tmp_path / "examples"
    ex.mkdir()
    (ex / "bad.yaml").write_text("apiVersion: tessera/v1\nkind: Job\nname: x\nworkload: {type: gpt, steps: 0}\n")
    r = cli("demo", "--examples", str(ex), cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert "workload.steps" in r.stderr
    assert not (tmp_path / ".tessera").exists()
