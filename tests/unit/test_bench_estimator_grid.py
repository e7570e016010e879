"""The estimator benchmark's held-out grid (bench/estimator_accuracy.py): no grid point
is a profile point, none is repeated, every category has several points (pure)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench import estimator_accuracy as ea


def _key(pt: dict) -> tuple:
    return pt["category"], tuple((j.get("model"), j.get("shape"), j["batch"], j["seq"], j["q"], j["m"],
                                  tuple(sorted(j["plan"].items())), tuple(map(tuple, j["cores"])))
                                 for j in pt["jobs"])


def test_no_grid_point_is_a_profile_point_or_a_repeat():
    g = ea.grid(False)
    profiled = set(ea.PROFILE_POINTS)
    for pt in g:
        if len(pt["jobs"]) == 1 and not pt["jobs"][0]["plan"] and not pt["jobs"][0].get("shape"):
            j = pt["jobs"][0]
            assert (j["model"], j["batch"], j["seq"], j["q"], j["m"]) not in profiled, pt
    keys = [_key(pt) for pt in g]
    assert len(keys) == len(set(keys))
    # Models the profiles never ran are in the grid (the model-size category needs them).
    assert {j["model"] for pt in g for j in pt["jobs"] if j.get("model") in ea.MODELS} - set(ea.PROFILED)


def test_every_category_has_points_and_quick_keeps_two():
    full = Counter(pt["category"] for pt in ea.grid(False))
    quick = Counter(pt["category"] for pt in ea.grid(True))
    assert set(full) == set(quick)
    assert all(n >= 2 for n in full.values()) and all(n == 2 for n in quick.values())
    multi = sum(n for c, n in full.items() if c.startswith("multi_"))
    assert multi >= 15, "enough multi-rank points for a per-category MAPE"


def test_multi_rank_points_are_estimated_as_ranks_sharing_the_cpu():
    """A dp / tp / pp point's two ranks run on cores 0 and 1 of one CPU: its candidate
    counts them as colocated "split" (disjoint cores); a single-rank point is alone."""
    for pt in ea.grid(False):
        job = pt["jobs"][0]
        if job.get("shape") or len(pt["jobs"]) > 1:
            continue
        c = ea.candidate(job)
        world = c.dp * c.tp * c.pp
        assert c.colocated == world and c.oversubscription == 1.0, pt
        assert (world > 1) == pt["category"].startswith("multi"), pt


def test_a_failed_colocation_profile_is_tried_again_and_its_time_counted():
    calls = []

    def flaky(wl, cores, warmup, measured):
        calls.append(cores)
        if len(calls) == 1:
            raise RuntimeError("colocation profile: 13 alone and 1 together steps of X (need 2 each)")
        return {"alone_s": 0.01, "together_s": 0.011, "device_s": 0.5}

    pcost = {"colocation": 0.0}
    res = ea.colocation_with_retry(flaky, {}, [[0], [1]], pcost)
    assert res["together_s"] == 0.011 and len(calls) == 2
    assert pcost["colocation"] >= 0.5  # the retry's, plus the failed attempt's wall time x 2 cores

    def broken(wl, cores, warmup, measured):
        raise RuntimeError("never enough steps")

    with pytest.raises(RuntimeError, match="never enough"):
        ea.colocation_with_retry(broken, {}, [[0], [0]], {"colocation": 0.0})
