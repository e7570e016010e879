"""Simulator conservation on random traces: every job finishes exactly once and no
device is ever over-allocated, for every policy (small clusters, fast)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.policy import (FCFSPolicy, GavelPolicy, Placement, ScheduleReply, Shard, SiaPolicy,
                               TableEstimator, TesseraPolicy)
from controller.sim import SimError, SimJob, Simulator, cluster_nodes, summarize
from controller.sim.engine import Overheads

TABLE = {
    "m1": {"a:1x1": 2.0, "a:1x2": 1.2, "a:2x2": 0.8, "b:1x1": 1.0, "b:1x2": 0.6},
    "m2": {"a:1x2": 3.0, "a:2x2": 1.8, "b:1x2": 1.5},
    "m3": {"b:1x1": 0.5, "a:1x1": 0.9},
}
NODES = cluster_nodes({"a": (2, 2), "b": (1, 2)})
POLICIES = [FCFSPolicy, GavelPolicy, SiaPolicy, TesseraPolicy, lambda: TesseraPolicy(multiplexing=False)]


class CheckingSim(Simulator):
    """Checks device usage after every decision, not only at the end."""

    def apply(self, reply, now, count):
        super().apply(reply, now, count)
        for k, u in self.usage.items():
            assert u <= 1.0 + 1e-6, (k, u)
        held = [(s.node, d) for r in self.running.values() if r.placement.quota >= 1.0
                for s in r.placement.shards for d in s.device_ids]
        assert len(held) == len(set(held))
        assert not (set(self.running) & set(self.pending))


job_st = st.builds(
    lambda i, t, it, m, n, kind, frac, bb: SimJob(f"j{i}", float(t), it, m if frac == 1.0 else "fixed:1", n if frac == 1.0 else 1,
                                                   kind, gpu_fraction=frac, backbone=bb if frac < 1 else ""),
    st.integers(0, 10**6), st.integers(0, 20000), st.integers(1, 3000), st.sampled_from(sorted(TABLE)),
    st.sampled_from([1, 2, 4]), st.sampled_from(["a", "b", ""]), st.sampled_from([1.0, 1.0, 0.3, 0.5]),
    st.sampled_from(["", "llama"]))


def unique(jobs):
    seen, out = set(), []
    for j in jobs:
        if j.job_id not in seen:
            seen.add(j.job_id)
            out.append(j)
    return out


@pytest.mark.parametrize("make", POLICIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=st.lists(job_st, min_size=1, max_size=14))
def test_every_job_finishes_once_and_devices_never_overbooked(make, jobs):
    jobs = unique(jobs)
    est = TableEstimator(TABLE)
    sim = CheckingSim(NODES, jobs, est, make(), est, round_s=300.0)
    res = sim.run()
    m = summarize(res)
    assert m["finished"] == len(jobs)
    assert all(r.finish is not None and r.finish >= r.submit for r in res.records.values())
    assert m["max_device_usage"] <= 1.0 + 1e-6
    assert all(abs(r.done - sim.by_id[r.job_id].iterations) < 1e-6 for r in res.records.values())


@settings(max_examples=20, deadline=None)
@given(jobs=st.lists(job_st, min_size=1, max_size=10), err=st.sampled_from([0.1, 0.5]))
def test_estimator_error_changes_decisions_not_truth(jobs, err):
    jobs = unique(jobs)
    truth = TableEstimator(TABLE)
    res = CheckingSim(NODES, jobs, truth, TesseraPolicy(), TableEstimator(TABLE, error=err, seed=3)).run()
    assert summarize(res)["finished"] == len(jobs)


def test_single_job_jct_is_launch_plus_runtime():
    j = SimJob("x", 0.0, 1000, "m1", 1, "b")
    res = Simulator(NODES, [j], TableEstimator(TABLE), FCFSPolicy(), overheads=Overheads(launch_s=30)).run()
    assert res.records["x"].finish == pytest.approx(30 + 1000 * 1.0)


def test_preempted_job_resumes_with_progress_and_restart_cost():
    est = TableEstimator({"m": {"a:1x1": 1.0}})
    nodes = cluster_nodes({"a": (1, 1)})
    long = SimJob("long", 0.0, 100000, "m", 1, "a")
    short = SimJob("short", 600.0, 100, "m", 1, "a")
    res = Simulator(nodes, [long, short], est, TesseraPolicy(), round_s=300.0).run()
    r = res.records
    assert r["short"].finish < r["long"].finish
    assert r["long"].restarts == 1
    # long lost only the short job's time plus overheads, never its progress.
    ov = Overheads()
    assert r["long"].finish == pytest.approx(ov.launch_s + 100000 + (r["short"].finish - 600.0) + ov.restart_s, abs=301)


def test_shared_device_slows_members_by_the_sharing_model():
    est = TableEstimator({}, interference=0.1)
    nodes = cluster_nodes({"a": (1, 1)})
    jobs = [SimJob(f"f{i}", 0.0, 1000, "fixed:1", 1, gpu_fraction=0.4) for i in range(2)]
    res = Simulator(nodes, jobs, est, TesseraPolicy()).run()
    for r in res.records.values():
        assert r.finish == pytest.approx(30 + 1000 * 1.1)
    res2 = Simulator(nodes, jobs, est, TesseraPolicy(multiplexing=False)).run()
    assert max(r.finish for r in res2.records.values()) > max(r.finish for r in res.records.values())


class Overbooker:
    name = "bad"

    def schedule(self, request):
        return ScheduleReply(placements=tuple(Placement(j.job_id, (Shard(request.nodes[0].name, ("g0",)),))
                                              for j in request.pending))


class DoublePlacer:
    name = "bad2"

    def schedule(self, request):
        out = []
        for r in request.running:
            out.append(Placement(r.job.job_id, r.placement.shards))
        for j in request.pending:
            out.append(Placement(j.job_id, (Shard(request.nodes[0].name, ("g0",)),)))
        return ScheduleReply(placements=tuple(out))


def test_simulator_rejects_over_allocation():
    jobs = [SimJob(f"j{i}", 0.0, 10, "m3", 1) for i in range(2)]
    with pytest.raises(SimError, match="over-allocated"):
        Simulator(NODES, jobs, TableEstimator(TABLE), Overbooker()).run()


def test_simulator_rejects_placing_a_running_job():
    jobs = [SimJob("a", 0.0, 10**6, "m3", 1), SimJob("b", 400.0, 10, "m3", 1)]
    with pytest.raises(SimError):
        Simulator(NODES, jobs, TableEstimator(TABLE), DoublePlacer()).run()


def test_metrics_fields():
    jobs = [SimJob(f"j{i}", 100.0 * i, 500, "m1", 2, "a") for i in range(6)]
    m = summarize(Simulator(NODES, jobs, TableEstimator(TABLE), TesseraPolicy()).run())
    for k in ("avg_jct", "median_jct", "p99_jct", "makespan", "avg_queue", "finished_in_horizon",
              "arena_avg_jct", "avg_norm_throughput", "decision_ms_median"):
        assert k in m
    assert m["finished"] == 6 and m["p99_jct"] >= m["median_jct"] > 0
