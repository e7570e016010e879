"""bench._measure.profile_points: one profiling process, several points (real training)."""

import os

import pytest

pytest.importorskip("torch")

from bench._measure import profile_points  # noqa: E402


def _w(batch: int, steps: int) -> dict:
    return {"model": {"layers": 1, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16}, "batch_size": batch,
            "steps": steps, "plan": {"dp": 1, "tp": 1, "pp": 1, "micro_batches": 1}}


def test_each_point_skips_its_own_warm_up():
    core = [sorted(os.sched_getaffinity(0))[0]]
    # The first point of the process warms up 3 steps, the later ones (warm process) 1.
    out, dev_s = profile_points([(_w(4, 3 + 4), core), (_w(8, 1 + 4), core)], [3, 1])
    assert [len(x["steps"]) for x in out] == [4, 4]
    assert all(x["step_s"] > 0 for x in out) and dev_s > 0
    # One count for every point, as before.
    out, _ = profile_points([(_w(4, 2 + 3), core), (_w(8, 2 + 3), core)], 2)
    assert [len(x["steps"]) for x in out] == [3, 3]
    with pytest.raises(ValueError, match="warmup"):
        profile_points([(_w(4, 5), core)], [1, 1])


def test_each_point_reports_its_forward_backward_share():
    """The runtime's forward + backward phases of a point's measured steps, over its
    median step: a share in (0, 1), larger for the larger batch (the optimizer and the
    data source cost the same per step)."""
    core = [sorted(os.sched_getaffinity(0))[0]]
    out, _ = profile_points([(_w(2, 3 + 5), core), (_w(32, 2 + 5), core)], [3, 2])
    small, large = (x["mb_frac"] for x in out)
    assert 0 < small < 1 and 0 < large < 1
    assert large > small
