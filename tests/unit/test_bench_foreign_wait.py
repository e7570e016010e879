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


def _stamps(points, cpu=None):
    """Stamps of one rank with one thread "m": (wall, cumulative run, cumulative wait)."""
    return [[t, run if cpu is None else cpu[i], {"m": [run, wait]}, "1", 1] for i, (t, run, wait) in enumerate(points)]


def test_time_sliced_partner_is_discounted_over_the_window_not_per_step():
    from bench._measure import _steps

    # Our 10 ms steps on a core shared with a partner whose steps take 20 ms: in steps 1
    # and 3 we waited 8 ms while the partner ran, in 2 and 4 it waited for us. The
    # partner's CPU is known at its own boundaries only (0, 8, 16 ms at 0, 20, 40 ms):
    # interpolated, each of our steps gets 4 ms. Per step that subtracted 4 ms from
    # steps 1 and 3 and nothing (never negative) from 2 and 4; over the window the
    # waits are all the partner's.
    ours = _stamps([(0.00, 0.000, 0.000), (0.01, 0.002, 0.008), (0.02, 0.012, 0.008), (0.03, 0.014, 0.016),
                    (0.04, 0.024, 0.016)])
    partner = _stamps([(0.00, 0.000, 0.0), (0.02, 0.008, 0.0), (0.04, 0.016, 0.0)])
    st = _steps([ours], -1e18, 1e18, 0, partner)
    assert st["raw"] == pytest.approx([0.01] * 4)
    assert st["corrected"] == pytest.approx([0.01] * 4)
    # 6 ms of the 16 ms waited were another tenant's (the partner ran only 10 ms): spread
    # over the four steps by duration.
    partner = _stamps([(0.00, 0.000, 0.0), (0.02, 0.005, 0.0), (0.04, 0.010, 0.0)])
    st = _steps([ours], -1e18, 1e18, 0, partner)
    assert st["corrected"] == pytest.approx([0.01 - 0.006 / 4] * 4)
    # Without a partner the correction stays per step (own threads are stamped exactly).
    st = _steps([ours], -1e18, 1e18, 0, None)
    assert st["corrected"] == pytest.approx([0.002, 0.01, 0.002, 0.01])
