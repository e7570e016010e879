"""Page faults per measured step in the accuracy benchmark's harness (bench._measure):
the pure reduction of stamps, and a real stamp carrying the process's fault count."""

from __future__ import annotations

import resource

from bench._measure import _stamp, step_faults
from bench.estimator_accuracy import faults_median


def stamp(faults: int) -> list:
    return [0.0, 0.0, {}, "1", 1, faults]


def test_step_faults_is_the_mean_per_step_after_the_warmup():
    stamps = [stamp(f) for f in (0, 5000, 5600, 5610, 5620, 5640)]  # 5 steps; 2 warm-up
    assert step_faults(stamps, 2) == (5640 - 5600) / 3
    assert step_faults(stamps, 0) == 5640 / 5


def test_step_faults_is_none_without_counts_or_measured_steps():
    old = [s[:5] for s in (stamp(0), stamp(10), stamp(20))]  # stamps from before the field
    assert step_faults(old, 0) is None
    assert step_faults([stamp(0), stamp(3)], 1) is None  # one stamp left: no step
    assert step_faults([stamp(0), stamp(3)], 0) == 3


def test_a_real_stamp_counts_the_faults_of_touching_new_pages():
    before = _stamp()
    assert before[5] <= resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(64 << 20)  # 16,384 fresh 4-KiB pages ...
    block[::4096] = b"\1" * (len(block) // 4096)  # ... every one written
    after = _stamp()
    assert after[5] - before[5] >= 4096, (before[5], after[5])
    del block


def test_faults_median_skips_runs_without_counts():
    assert faults_median([None, 3.0, 1.0, 2.0]) == 2.0
    assert faults_median([None]) is None and faults_median([]) is None
