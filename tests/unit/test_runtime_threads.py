"""The runtime's intra-op threads follow the cores the agent grants live (agent/runtime/threads.py)."""

from __future__ import annotations

import os

import pytest
import torch

from agent.runtime.threads import ThreadFollower, scaled_threads


def test_scaled_threads_keeps_the_threads_per_core_ratio():
    assert scaled_threads(2, 2, 4) == 4 and scaled_threads(2, 2, 1) == 1
    assert scaled_threads(1, 2, 4) == 2 and scaled_threads(1, 4, 1) == 1  # never below one
    assert scaled_threads(3, 3, 3) == 3
    with pytest.raises(ValueError, match="cores_now"):
        scaled_threads(1, 1, 0)


def test_follower_applies_a_new_count_only_when_the_core_count_changes():
    cores = {0, 1}
    applied: list[int] = []
    f = ThreadFollower(2, affinity=lambda: cores, set_threads=applied.append)
    assert f.poll() is None and applied == []
    cores = {0, 1, 2, 3}
    assert f.poll() == 4 and applied == [4] and f.cores == 4
    assert f.poll() is None and applied == [4]  # unchanged: nothing applied again
    cores = {5}
    assert f.poll() == 1 and applied == [4, 1]
    cores = {2}  # other core, same count: nothing to do
    assert f.poll() is None and applied == [4, 1]


def test_follower_without_a_budget_never_touches_torch():
    cores = {0}
    applied: list[int] = []
    f = ThreadFollower(0, affinity=lambda: cores, set_threads=applied.append)
    cores = {0, 1, 2}
    assert f.poll() is None and applied == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_follower_reads_the_real_affinity_and_sets_torch_threads():
    """Real sched_setaffinity on this thread and real torch.set_num_threads."""
    mask, threads = os.sched_getaffinity(0), torch.get_num_threads()
    two = set(sorted(mask)[:2])
    try:
        os.sched_setaffinity(0, two)
        f = ThreadFollower(2)
        os.sched_setaffinity(0, {min(two)})
        assert f.poll() == 1 and torch.get_num_threads() == 1
        os.sched_setaffinity(0, two)
        assert f.poll() == 2 and torch.get_num_threads() == 2
    finally:
        os.sched_setaffinity(0, mask)
        torch.set_num_threads(threads)
