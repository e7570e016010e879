"""bench.step_work: its summary of whole steps and its component timings."""

from __future__ import annotations

import pytest

from bench import step_work as sw


def test_ratios_take_the_median_of_per_round_ratios():
    steps = {"x": {"this": [0.010, 0.030, 0.012], "baseline": [0.020, 0.030, 0.012]},
             "y": {"this": [0.050], "baseline": [0.040]}}
    r = sw.ratios(steps)
    assert r["rows"]["x"]["ratio"] == pytest.approx(1.0)  # rounds 0.5, 1.0, 1.0
    assert r["rows"]["x"]["this_ms"] == pytest.approx(12.0) and r["rows"]["x"]["baseline_ms"] == pytest.approx(20.0)
    assert r["rows"]["y"]["ratio"] == pytest.approx(1.25)
    assert r["median_ratio"] == pytest.approx(1.125)


def test_a_round_without_a_time_is_left_out():
    r = sw.ratios({"x": {"this": [0.0, 0.02], "baseline": [0.01, 0.01]}})
    assert r["rows"]["x"]["ratio"] == pytest.approx(2.0)
    assert sw.ratios({"x": {"this": [0.0], "baseline": [0.01]}})["median_ratio"] is None


def test_components_time_every_piece_of_every_model():
    import os

    import torch

    from bench import estimator_accuracy as ea

    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    rows = sw.components(2)
    assert os.sched_getaffinity(0) == cores and torch.get_num_threads() == threads  # the caller's, restored
    assert [r["model"] for r in rows] == list(ea.MODELS)
    for r in rows:
        assert r["tensors"] > 0 and r["params"] > 0
        for k in ("adamw_loop", "adamw_foreach", "adamw_fused", "finite_per_tensor", "finite_all_finite",
                  "data_torch_walk", "data_batch"):
            assert r[k] > 0, (r["model"], k)


def test_every_whole_step_configuration_is_a_valid_request():
    from bench import estimator_accuracy as ea

    for label, req in sw.CONFIGS:
        if req.get("shape"):
            assert req["shape"] in ea.WORKLOADS, label
            continue
        assert req["model"] in ea.MODELS, label
        world = 1
        for k in ("dp", "tp", "pp"):
            world *= req["plan"].get(k, 1)
        assert len(req["cores"]) == world, label
