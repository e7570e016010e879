"""e2e: `tessera demo` on a directory of two tiny manifests: up, submit all, summary, down."""

from __future__ import annotations

import pytest
from _e2e import cli, require_etcd, run_demo, tiny_manifest

pytestmark = pytest.mark.slow


def test_demo_runs_every_manifest_and_tears_down(tmp_path):
    require_etcd()
    ex = tmp_path / "examples"
    ex.mkdir()
    tiny_manifest(ex / "a.yaml", "demo-a", steps=15)
    tiny_manifest(ex / "b.yaml", "demo-b", steps=15, devices=2)
    summary = run_demo(tmp_path, ex, 120, 240)
    assert sorted(j["job"] for j in summary["jobs"]) == ["demo-a", "demo-b"]
    for j in summary["jobs"]:
        assert j["phase"] == "SUCCEEDED" and j["steps"] == 15 and j["final_loss"] > 0
    assert not (tmp_path / ".tessera" / "demo" / "testbed.json").exists()  # torn down


def test_demo_refuses_invalid_manifest_before_starting(tmp_path):
    ex = tmp_path / "examples"
    ex.mkdir()
    (ex / "bad.yaml").write_text("apiVersion: tessera/v1\nkind: Job\nname: x\nworkload: {type: gpt, steps: 0}\n")
    r = cli("demo", "--examples", str(ex), cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert "workload.steps" in r.stderr
    assert not (tmp_path / ".tessera").exists()
