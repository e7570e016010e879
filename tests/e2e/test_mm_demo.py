"""e2e: `tessera demo` runs the two multimodal examples (colocated on one device,
disaggregated over two ranks) to completion on a local testbed, with the loss falling."""

from __future__ import annotations

import json
import shutil

import pytest
from _e2e import REPO, cli

from tessera.etcdproc import EtcdNotFound, find_etcd

pytestmark = pytest.mark.slow


def test_demo_runs_both_multimodal_examples(tmp_path):
    try:
        find_etcd()
    except EtcdNotFound as e:
        pytest.skip(str(e))
    ex = tmp_path / "examples"
    ex.mkdir()
    for name in ("mm-colocated.yaml", "mm-disagg.yaml"):
        shutil.copy(REPO / "examples" / name, ex / name)
    r = cli("demo", "--examples", str(ex), "--timeout", "180", "-o", "json", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    summary = json.loads(r.stdout)
    assert summary["ok"] is True
    jobs = {j["job"]: j for j in summary["jobs"]}
    assert set(jobs) == {"mm-colocated", "mm-disagg"}
    for j in jobs.values():
        assert j["phase"] == "SUCCEEDED" and j["steps"] == 60
        assert 0 < j["final_loss"] < 0.7 * j["first_loss"], j
