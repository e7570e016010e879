"""bench.page_faults: its configurations and the pure reductions (the measurement itself
is the benchmark's, not a test's)."""

from __future__ import annotations

import json
import os

import pytest

from bench import estimator_accuracy as ea
from bench import page_faults as pf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN = os.path.join(ROOT, "docs", "figures", "estimator_accuracy_s18x3.json")


def test_configs_are_the_grids_one_core_gpt_runs_and_the_one_core_profile_points():
    grid, prof = pf.configs()
    assert len(grid) >= 30 and len(prof) >= 8
    assert not set(grid) & set(prof)  # held out, as in the accuracy benchmark
    assert {k[0] for k in prof} == set(ea.PROFILED)
    assert all(isinstance(k[1], int) and k[3] >= 1 for k in grid)


def fake(faults_rel, faults_keep, ms_rel, ms_keep, rounds=2):
    data = {m: {"grid": {}, "profile": {}} for m in ("release", "keep")}
    for k, fr, fk, a, b in zip([("A", 8, 64, 1), ("B", 4, 32, 1)], faults_rel, faults_keep, ms_rel, ms_keep):
        data["release"]["grid"][k] = [(fr, a / 1e3)] * rounds
        data["keep"]["grid"][k] = [(fk, b / 1e3)] * rounds
    data["release"]["profile"][("A", 4, 32, 1)] = [(3.0, 0.01), (None, 0.01)]
    data["keep"]["profile"][("A", 4, 32, 1)] = [(0.0, 0.01), (None, 0.01)]
    return data


def test_summary_takes_medians_per_configuration_and_kind():
    s = pf.summary(fake([800.0, 10.0], [20.0, 0.0], [40.0, 20.0], [36.0, 20.0]))
    a = next(r for r in s["rows"] if r["model"] == "A")
    assert a["faults_release"] == 800.0 and a["faults_keep"] == 20.0
    assert a["keep_over_release"] == pytest.approx(0.9)
    assert s["kinds"]["grid"]["release"] == pytest.approx(405.0) and s["kinds"]["grid"]["keep"] == 10.0
    assert s["kinds"]["profile"]["release"] == 3.0  # the round without a count is skipped


def test_bias_correlates_only_runs_measured_with_the_released_heap(tmp_path):
    grid, _ = pf.configs()
    # A fault rate that falls with the configuration's tokens: some correlation either way.
    rows = [{"kind": "grid", "model": k[0], "batch": k[1], "seq": k[2], "micro_batches": k[3],
             "faults_release": float(k[1] * k[2]), "step_s_release": 0.02} for k in grid]
    b = pf.bias(rows, [RUN])
    assert b is not None and b["runs"] == 1 and b["n"] >= 30 and -1.0 <= b["corr"] <= 1.0
    run = json.load(open(RUN, encoding="utf-8"))
    run["heap"] = "keep"
    kept = tmp_path / "kept.json"
    kept.write_text(json.dumps(run))
    assert pf.bias(rows, [str(kept)]) is None
