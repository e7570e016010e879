"""bench._measure.foreign_wait: the run-queue wait other tenants caused, not the wait
behind a rank's own threads (pure arithmetic)."""

from __future__ import annotations

import pytest

from bench._measure import foreign_wait


def test_wait_behind_own_threads_on_one_core_is_the_configuration():
    # Main thread waited 9 ms while the rank's own gloo thread ran 9 ms on its one core.
    assert foreign_wait({"main": 0.009, "gloo": 0.001}, {"main": 0.020, "gloo": 0.009}, 1, 0.030) == pytest.approx(0.0, abs=1e-12)


def test_wait_beyond_own_threads_is_another_tenants():
    # 9 ms waited, own other threads ran 2 ms: 7 ms were someone else's.
    assert foreign_wait({"main": 0.009}, {"main": 0.020, "gloo": 0.002}, 1, 0.031) == pytest.approx(0.007)


def test_several_cores_absorb_own_threads_up_to_their_count():
    # Two cores, the worker ran the whole 30 ms on the other core: it explains nothing.
    assert foreign_wait({"main": 0.004, "w": 0.0}, {"main": 0.026, "w": 0.030}, 2, 0.030) == pytest.approx(0.004)
    # ... it ran 36 ms (two workers): 6 ms beyond the other core's 30 may have delayed main.
    assert foreign_wait({"main": 0.004}, {"main": 0.026, "w1": 0.018, "w2": 0.018}, 2, 0.030) == 0.0


def test_a_colocated_partners_cpu_time_is_the_configuration_and_never_negative():
    assert foreign_wait({"main": 0.010}, {"main": 0.010}, 1, 0.020, extra=0.008) == pytest.approx(0.002)
    assert foreign_wait({"main": 0.001}, {"main": 0.010}, 1, 0.020, extra=0.008) == 0.0
    assert foreign_wait({}, {}, 1, 0.02) == 0.0
