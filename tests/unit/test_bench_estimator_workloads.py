"""The estimator benchmark's peft / multimodal categories (bench/estimator_accuracy.py):
the grid holds them (full and --quick), their jobs are keyed by the workload's shape key,
and the evaluation turns (synthetic) profile steps and measured times into rows of those
categories with the estimator's own numbers. Pure: no training runs."""

from __future__ import annotations

import statistics

import pytest

from bench import estimator_accuracy as ea
from tessera.modelkey import shape_key
from tessera.perfmodel import PerfModel
from tessera.perfmodel.compute import COEFS, ComputeFit, quota_scale
from tessera.perfmodel.workload import workload_of

CATS = {"workload_peft": "peft", "workload_multimodal": "multimodal"}


def _workload_points(g: list[dict]) -> list[dict]:
    return [pt for pt in g if pt["category"] in CATS]


@pytest.mark.parametrize("quick", [False, True])
def test_grid_holds_the_workload_categories(quick):
    g = ea.grid(quick)
    cats = {pt["category"] for pt in g}
    assert set(CATS) <= cats
    pts = _workload_points(g)
    for pt in pts:
        assert len(pt["jobs"]) == 1, "single-device points"
        j = pt["jobs"][0]
        wtype = CATS[pt["category"]]
        assert j["type"] == wtype and ea.WORKLOADS[j["shape"]][0] == pt["category"]
        w = ea.workload_doc(j["shape"])["workload"]
        assert w["type"] == wtype
        # The module key is the job's shape key on one device, of the right workload type.
        assert j["module"] == shape_key(w, 1)
        assert workload_of(j["module"]) == wtype and ":w" in j["module"]
        # The profiling job (controller.profiling.profile_doc) and the held-out runs are
        # filed under that same key (workload_heldout raises otherwise).
        assert shape_key(ea.workload_profile(j["shape"]), 1) == j["module"]
        assert shape_key(ea.workload_heldout(j["shape"]), 1) == j["module"]
        assert j["batch"] == w["batch_size"] and j["m"] == 1 and j["seq"] == w["model"]["seq_len"]
        assert j["cores"] == [list(range(j["q"]))]
        # Single-device categories: they count into mape_single.
        assert not pt["category"].startswith("multi_")
    for cat in CATS:
        qs = {pt["jobs"][0]["q"] for pt in pts if pt["category"] == cat}
        assert 1 in qs and (quick or qs == {1, 2})
    if not quick:
        peft = {pt["jobs"][0]["shape"] for pt in pts if pt["category"] == "workload_peft"}
        assert len(peft) == 2
        modes = {ea.workload_doc(s)["workload"]["peft"]["mode"] for s in peft}
        assert modes == {"spatial", "temporal"}
        # Two shapes of one type never share a key.
        assert len({ea.workload_module(s) for s in ea.WORKLOADS}) == len(ea.WORKLOADS)
    # Each round profiles the shapes of the grid (a profile task of its own).
    assert ("wprof",) in ea._profile_tasks(True) and ("wprof",) not in ea._profile_tasks(False)


def test_profile_points_go_through_the_estimator_path():
    name = "peft-spatial"
    # Two rounds of a profiling run (8 steps): the first two are the estimator's warm-up.
    slow = [0.9, 0.5, 0.22, 0.21, 0.23, 0.20, 0.24, 0.22]
    fast = [0.9, 0.5, 0.11, 0.10, 0.12, 0.10, 0.13, 0.11]
    (p,) = ea.workload_points(name, [slow, fast])
    assert p.module == ea.workload_module(name)
    assert p.rows == ea.workload_doc(name)["workload"]["batch_size"]
    assert p.micro_batches == 1 and p.q == 1.0 and p.seq == 64
    # A peft run's point is its mean measured step (estimator.models.profiles).
    assert p.steps == 6 and p.seconds == pytest.approx(statistics.fmean(fast[2:]))  # least disturbed round
    assert ea.workload_points(name, []) == []
    # Three rounds: the mean of the two least disturbed rounds' means (bench step_time),
    # the spread and steps of the least disturbed one.
    mid = [0.9, 0.5, 0.16, 0.15, 0.17, 0.15, 0.18, 0.16]
    (p3,) = ea.workload_points(name, [slow, fast, mid])
    assert p3.seconds == pytest.approx((statistics.fmean(fast[2:]) + statistics.fmean(mid[2:])) / 2)
    assert p3.spread == pytest.approx(p.spread)


def _model(points) -> PerfModel:
    # All FLOPs: a backbone's step scales by the parallel part's s(q) / s(q0) exactly.
    fit = ComputeFit(device_type=ea.DEVICE, coef={k: (1e-9 if k == "c_flops" else 0.0) for k in COEFS}, p=0.8,
                     q_sat=float("inf"), rel_sigma=0.05, n=10, status="ok")
    return PerfModel(version=1, compute={ea.DEVICE: fit}, profiles={ea.DEVICE: points})


def test_evaluate_rows_of_the_workload_categories():
    g = ea.grid(False)
    pts = _workload_points(g)
    shapes = list(dict.fromkeys(pt["jobs"][0]["shape"] for pt in pts))
    prof = {name: 0.01 * (k + 1) for k, name in enumerate(shapes)}
    points = [pp for name in shapes for pp in ea.workload_points(name, [[1.0, 1.0] + [prof[name]] * 6])]
    model = _model(points)
    measured, want = [], []
    for k, pt in enumerate(pts):
        j = pt["jobs"][0]
        t = prof[j["shape"]] * (1.0 + 0.1 * (k % 3))  # synthetic held-out measurement
        measured.append({**pt, "measured": [t], "raw": [t * 1.2], "rounds": [t], "cpu_util": 1.0})
        # q = 1: the profile itself; q = 2: scaled by the device's fitted gpt quota curve.
        est = prof[j["shape"]] * float(quota_scale(j["q"], 0.8, float("inf")) / quota_scale(1, 0.8, float("inf")))
        want.append((pt["category"], j["module"], j["q"], t, est))
    rows = ea.evaluate(model, measured)["rows"]
    assert len(rows) == len(want)
    assert {r["category"] for r in rows} == set(CATS)
    for r, (cat, module, q, t, est) in zip(rows, want):
        assert r["category"] == cat and r["module"] == module and r["quota"] == q
        assert r["status"] == "ok", r
        assert r["estimated_s"] == pytest.approx(est, rel=1e-9)
        assert r["ape"] == pytest.approx(abs(est - t) / t * 100, rel=1e-9)
        assert r["ape_raw"] == pytest.approx(abs(est - 1.2 * t) / (1.2 * t) * 100, rel=1e-9)
    # Both quotas of one shape profiled: the module's own quota curve (exact on two points).
    name = shapes[0]
    two = ea.workload_points(name, [[1.0, 1.0] + [0.04] * 6])
    p2 = two[0].__class__(**{**two[0].__dict__, "q": 2.0, "seconds": 0.025})
    j = ea.workload_job(name, 2)
    (r,) = ea.evaluate(_model(two + [p2]), [{"category": ea.WORKLOADS[name][0], "jobs": [j], "measured": [0.02],
                                            "raw": [0.02], "rounds": [0.02], "cpu_util": 1.0}])["rows"]
    assert r["estimated_s"] == pytest.approx(0.025) and r["ape"] == pytest.approx(25.0)


def test_no_profile_no_number():
    """A shape without a profile is insufficient_data (no APE), never a guess."""
    j = ea.workload_job("mm-colocated", 1)
    (r,) = ea.evaluate(_model([]), [{"category": "workload_multimodal", "jobs": [j], "measured": [0.02],
                                      "raw": [0.02], "rounds": [0.02], "cpu_util": 1.0}])["rows"]
    assert r["status"] == "insufficient_data" and r["ape"] is None
