"""bench._measure.run_jobs ends a run's last step at the step's end, not after the
runtime's teardown (a gloo world's destroy_process_group is tens of ms: as a measured
step it was a standing outlier of every multi-rank point)."""

from __future__ import annotations

import os
import statistics

import pytest

from bench import _measure

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two cores")


def test_last_measured_step_excludes_teardown():
    w = {"model": {"vocab": 64, "seq_len": 16, "layers": 2, "hidden": 32, "heads": 4}, "batch_size": 4,
         "steps": 2 + 6, "plan": {"dp": 1, "tp": 2, "pp": 1, "micro_batches": 1}}
    (res,) = _measure.run_jobs([{"workload": w, "cores": [[0], [1]]}], warmup=2)
    raw = res["raw_steps"]
    assert len(raw) == 6
    # The tiny step takes a few ms; the teardown alone took 30-60 ms when it was counted.
    assert raw[-1] < 3 * statistics.median(raw[:-1]), raw
