"""The estimator interface: table lookups, injected error, sharing model."""

from __future__ import annotations

import pytest

from controller.policy import SharingModel, TableEstimator
from controller.policy.estimator import config_key, fixed_model, parse_config_key

TABLE = {"m": {"a:1x2": 2.0, "b:2x4": 1.0}}


def test_lookup_and_infeasible():
    e = TableEstimator(TABLE)
    assert e.iter_time("m", "a", 1, 2) == 2.0
    assert e.iter_time("m", "a", 1, 1) is None and e.iter_time("x", "a", 1, 2) is None
    assert sorted(e.configs("m")) == [("a", 1, 2), ("b", 2, 4)]
    assert parse_config_key(config_key("a40", 2, 2)) == ("a40", 2, 2)


def test_fixed_model_is_single_device_any_type():
    e = TableEstimator({})
    assert e.iter_time(fixed_model(1.5), "zz", 1, 1) == 1.5
    assert e.iter_time(fixed_model(1.5), "zz", 1, 2) is None


def test_error_is_deterministic_and_keeps_feasibility():
    a, b = TableEstimator(TABLE, error=0.3, seed=7), TableEstimator(TABLE, error=0.3, seed=7)
    assert a.iter_time("m", "a", 1, 2) == b.iter_time("m", "a", 1, 2) != 2.0
    assert a.iter_time("m", "a", 1, 1) is None
    c = TableEstimator(TABLE, error=0.3, seed=8)
    assert c.iter_time("m", "a", 1, 2) != a.iter_time("m", "a", 1, 2)


def test_sharing_model():
    s = SharingModel(interference=0.1, fused_step=0.05)
    assert s.colocation_slowdown(1) == 1.0
    assert s.colocation_slowdown(3) == pytest.approx(1.2)
    assert s.colocation_slowdown(3, fused=True) == pytest.approx(1.1)
