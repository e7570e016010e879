"""e2e: `tessera demo` runs the two multimodal examples (colocated on one device,
disaggregated over two ranks) to completion on a local testbed, with the loss falling."""

from __future__ import annotations

import shutil

import pytest
from _e2e import REPO, require_etcd, run_demo

pytestmark = pytest.mark.slow


def test_demo_runs_both_multimodal_examples(tmp_path):
    require_etcd()
    ex = tmp_path / "examples"
    ex.mkdir()
    for name in ("mm-colocated.yaml", "mm-disagg.yaml"):
        shutil.copy(REPO / "examples" / name, ex / name)
    summary = run_demo(tmp_path, ex, 180, 300)
    jobs = {j["job"]: j for j in summary["jobs"]}
    assert set(jobs) == {"mm-colocated", "mm-disagg"}
    for j in jobs.values():
        assert j["phase"] == "SUCCEEDED" and j["steps"] == 60
        assert 0 < j["final_loss"] < 0.7 * j["first_loss"], j
