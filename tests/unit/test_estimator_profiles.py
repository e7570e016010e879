"""The estimator's aggregation of step measurements (pure)."""

from __future__ import annotations

import pytest

from estimator.profiles import StepSample, percentile, summarize


def test_percentile_linear_between_ranks():
    v = [1.0, 2.0, 3.0, 4.0]
    assert percentile(v, 0.5) == 2.5
    assert percentile(v, 0.9) == pytest.approx(3.7)
    assert percentile(v, 0.0) == 1.0 and percentile(v, 1.0) == 4.0
    assert percentile([7.0], 0.9) == 7.0
    with pytest.raises(ValueError):
        percentile([], 0.5)
    with pytest.raises(ValueError):
        percentile(v, 1.5)


def test_summarize():
    s = summarize([
        StepSample(0.3, {"forward": 0.1, "backward": 0.2}, time=10.0),
        StepSample(0.1, {"forward": 0.05}, time=12.0),
        StepSample(0.2, {}, time=11.0),
    ])
    assert s.samples == 3
    assert s.mean_step_time_s == pytest.approx(0.2)
    assert s.p50_step_time_s == pytest.approx(0.2)
    assert s.p90_step_time_s == pytest.approx(0.28)
    # a phase is averaged over the samples that report it
    assert s.mean_phases == pytest.approx({"backward": 0.2, "forward": 0.075})
    assert s.last_time == 12.0


def test_summarize_nothing():
    assert summarize([]) is None


def test_summarize_leaves_out_non_finite_step_times():
    nan, inf = float("nan"), float("inf")
    s = summarize([StepSample(nan), StepSample(1.0), StepSample(inf, {"forward": 0.5}), StepSample(3.0)])
    assert s.samples == 2  # the step-time statistics are over the finite ones
    assert (s.mean_step_time_s, s.p50_step_time_s, s.p90_step_time_s) == (2.0, 2.0, pytest.approx(2.8))
    assert s.mean_phases == {"forward": 0.5}  # a phase is kept by its own value
    assert summarize([StepSample(nan), StepSample(-inf)]) is None  # no finite step time: nothing to summarize
