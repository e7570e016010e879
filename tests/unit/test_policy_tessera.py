"""Tessera policy: every reply action and the infeasible paths, on tiny clusters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.policy import (
    ColocationGroup, DeviceView, FCFSPolicy, GavelPolicy, JobView, NodeView, Placement, Plan, RunningJob,
    ScheduleRequest, Shard, SiaPolicy, TableEstimator, TesseraPolicy,
)
from controller.policy.grid import Cell, build_grid, cluster_shape, prune_dominated

TABLE = {
    "m": {"a:1x1": 10.0, "a:1x2": 6.0, "a:1x4": 4.0, "a:2x4": 3.0, "b:1x1": 5.0, "b:1x2": 3.0},
    "big": {"a:1x4": 8.0, "a:2x4": 5.0},
}
EST = TableEstimator(TABLE)


def nodes(a: int = 2, b: int = 1, per_a: int = 4, per_b: int = 2) -> tuple[NodeView, ...]:
    out = [NodeView(f"a{i}", tuple(DeviceView(f"g{k}", "gpu", "a", 0, 100) for k in range(per_a))) for i in range(a)]
    out += [NodeView(f"b{i}", tuple(DeviceView(f"g{k}", "gpu", "b", 0, 100) for k in range(per_b))) for i in range(b)]
    return tuple(out)


def job(jid: str, n: int = 1, kind: str = "", model: str = "m", iters: int = 1000, t: float = 0.0, **kw) -> JobView:
    return JobView(jid, num_devices=n, device_kind=kind, model=model, iterations=iters, submit_time=t, **kw)


def running(j: JobView, node: str, devs: tuple[str, ...], gpu: str, quota: float = 1.0, group: str = "",
            plan: Plan | None = None) -> RunningJob:
    n = len(devs)
    return RunningJob(j, Placement(j.job_id, (Shard(node, devs),), "", gpu, plan or Plan(1, n, 0, 1.0), quota, group))


def req(pending=(), run=(), ns=None, **kw) -> ScheduleRequest:
    return ScheduleRequest(ns if ns is not None else nodes(), tuple(pending), tuple(run), estimator=EST, **kw)


def test_grid_cells_are_pruned_and_sorted():
    shape = cluster_shape(nodes())
    assert shape == (("a", 2, 4), ("b", 1, 2))
    g = build_grid(EST, "m", shape)
    assert [c.label() for c in g] == ["a:2x4", "b:1x2", "a:1x4", "b:1x1", "a:1x2", "a:1x1"]
    assert prune_dominated([Cell(5, "a", 1, 1), Cell(6, "a", 1, 2)]) == (Cell(5, "a", 1, 1),)


def test_place_picks_a_cell_with_plan_and_reason():
    r = TesseraPolicy().schedule(req([job("j", 2)]))
    (p,) = r.placements
    assert p.plan is not None and p.plan.num_devices == p.num_devices
    assert p.gpu_type in ("a", "b") and "cell" in p.reason
    assert not r.infeasible


def test_type_change_for_pending_job_is_explained():
    r = TesseraPolicy().schedule(req([job("j", 2, kind="a")], ns=nodes(a=1, b=1)))
    (p,) = r.placements
    assert p.gpu_type == "b" and "type changed" in p.reason


def test_shrink_at_most_two_x():
    # 4 'a' devices requested; only 2 free (b occupied, one a-node half used).
    busy = running(job("r", 2, iters=10**9), "a0", ("g0", "g1"), "a")
    r = TesseraPolicy(multiplexing=False, expand=False).schedule(
        req([job("j", 4, kind="a")], [busy], ns=nodes(a=1, b=0)))
    (p,) = r.placements
    assert p.num_devices == 2 and "shrunk" in p.reason
    # Only 1 free: below half of 4, so it waits instead.
    busy3 = running(job("r", 3, iters=10), "a0", ("g0", "g1", "g2"), "a")
    r = TesseraPolicy(multiplexing=False, expand=False).schedule(
        req([job("j", 4, kind="a")], [busy3], ns=nodes(a=1, b=0)))
    assert not r.placements and r.infeasible[0].reason.startswith("waiting")


def test_preempt_long_running_job_for_a_much_shorter_one():
    ns = nodes(a=1, b=0)
    long = running(job("long", 4, iters=10**7, elastic=False), "a0", ("g0", "g1", "g2", "g3"), "a",
                   plan=Plan(1, 4, 0, 4.0))
    short = job("short", 4, iters=10, elastic=False)
    r = TesseraPolicy().schedule(req([short], [long], ns=ns))
    assert [p.job_id for p in r.placements] == ["short"]
    assert [a.job_id for a in r.preemptions] == ["long"]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_non_preempting_job_waits_for_a_free_device_however_short(fraction):
    """``preempts=False`` (the controller's profiling jobs): ordered first, as short as it
    is, but it takes no running job's devices: it waits, and the running job is kept."""
    ns = nodes(a=1, b=0)
    long = running(job("long", 4, iters=10**7, elastic=False), "a0", ("g0", "g1", "g2", "g3"), "a",
                   plan=Plan(1, 4, 0, 4.0))
    prof = job("prof", 1, iters=8, gpu_fraction=fraction, preempts=False)
    r = TesseraPolicy().schedule(req([prof], [long], ns=ns))
    assert not r.preemptions and not r.placements and r.infeasible[0].job_id == "prof"
    assert r.infeasible[0].reason.startswith("waiting")
    # the same job allowed to preempt takes a device of the long one
    r = TesseraPolicy().schedule(req([replace(prof, preempts=True)], [long], ns=ns))
    assert [a.job_id for a in r.preemptions] == ["long"] and [p.job_id for p in r.placements] == ["prof"]
    # with a device free it is placed like any job
    ns2 = nodes(a=2, b=0)
    r = TesseraPolicy().schedule(req([prof], [long], ns=ns2))
    assert not r.preemptions and [p.job_id for p in r.placements] == ["prof"]


def test_no_preempt_when_gain_is_small():
    ns = nodes(a=1, b=0)
    cur = running(job("cur", 4, iters=1000, elastic=False), "a0", ("g0", "g1", "g2", "g3"), "a")
    r = TesseraPolicy().schedule(req([job("new", 4, iters=800, elastic=False)], [cur], ns=ns))
    assert not r.preemptions and not r.placements


def test_victim_is_moved_when_other_devices_are_free():
    # 'long' holds a0; 'short' wants 4 'a' devices on one node (a:1x4) while a1 is free:
    # best fit takes a1, so no one is disturbed.
    long = running(job("long", 4, iters=10**7, kind="a", elastic=False), "a0", ("g0", "g1", "g2", "g3"), "a")
    r = TesseraPolicy().schedule(req([job("short", 4, iters=10, kind="a", elastic=False)], [long], ns=nodes(a=2, b=0)))
    assert not r.preemptions and r.placements[0].shards[0].node == "a1"


def test_expand_running_job_on_idle_devices_charges_restart():
    r0 = running(job("r", 1, kind="a", iters=10**6), "a0", ("g0",), "a", plan=Plan(1, 1, 0, 10.0))
    r = TesseraPolicy().schedule(req([], [r0], ns=nodes(a=2, b=0)))
    (a,) = r.resizes
    assert a.kind == "expand" and a.cost_s > 0 and a.placement.num_devices > 1


def test_type_change_and_migrate_kinds():
    from controller.policy.engine import resize_kind
    old = Placement("j", (Shard("a0", ("g0",)),), gpu_type="a")
    assert resize_kind(old, Placement("j", (Shard("b0", ("g0",)),), gpu_type="b")) == "type-change"
    assert resize_kind(old, Placement("j", (Shard("a1", ("g0",)),), gpu_type="a")) == "migrate"
    big = Placement("j", (Shard("a0", ("g0", "g1")),), gpu_type="a")
    assert resize_kind(big, old) == "shrink" and resize_kind(old, big) == "expand"


def test_running_job_on_lost_node_is_migrated():
    r0 = running(job("r", 2, kind="a", iters=10**6, elastic=False), "gone", ("g0", "g1"), "a")
    r = TesseraPolicy(expand=False).schedule(req([], [r0], ns=nodes(a=1, b=0)))
    (a,) = r.resizes
    assert a.placement.shards[0].node == "a0" and a.kind == "migrate"


def test_running_job_on_lost_node_is_preempted_when_nothing_is_free():
    other = running(job("o", 4, kind="a", iters=10, elastic=False), "a0", ("g0", "g1", "g2", "g3"), "a")
    r0 = running(job("r", 2, kind="a", iters=10**6, elastic=False), "gone", ("g0", "g1"), "a")
    r = TesseraPolicy().schedule(req([], [other, r0], ns=nodes(a=1, b=0)))
    assert [p.job_id for p in r.preemptions] == ["r"]


def test_fractional_jobs_are_packed_on_one_device():
    js = [job(f"f{i}", 1, model="fixed:1", gpu_fraction=0.3) for i in range(3)]
    r = TesseraPolicy().schedule(req(js, ns=nodes(a=1, b=0, per_a=1)))
    devs = {(p.shards[0].node, p.shards[0].device_ids) for p in r.placements}
    assert len(r.placements) == 3 and len(devs) == 1
    assert all(p.quota == pytest.approx(0.3) and p.group for p in r.placements)
    (g,) = r.colocations
    assert g.mode == "mps" and sum(q for _, q in g.members) <= 1.0


def test_fractional_job_prefers_a_free_device_to_packing():
    js = [job(f"f{i}", 1, model="fixed:1", gpu_fraction=0.3) for i in range(2)]
    r = TesseraPolicy().schedule(req(js, ns=nodes(a=1, b=0, per_a=2)))
    assert len({p.shards[0] for p in r.placements}) == 2


def test_without_multiplexing_fractional_jobs_get_whole_devices():
    js = [job(f"f{i}", 1, model="fixed:1", gpu_fraction=0.3) for i in range(3)]
    r = TesseraPolicy(multiplexing=False).schedule(req(js, ns=nodes(a=1, b=0)))
    assert len({p.shards[0] for p in r.placements}) == 3 and not r.colocations


def test_lora_jobs_on_same_backbone_are_fused_with_discount():
    js = [job(f"l{i}", 1, model="fixed:1", gpu_fraction=0.4, backbone="llama") for i in range(3)]
    r = TesseraPolicy().schedule(req(js, ns=nodes(a=1, b=0, per_a=1)))
    groups = [g for g in r.colocations if g.mode == "fused-spatial"]
    assert groups and len(groups[0].members) == 3  # 0.4 + 0.24 + 0.24 <= 1 thanks to fusion
    assert sum(q for _, q in groups[0].members) <= 1.0


def test_shared_device_respects_quota_sum_and_running_members():
    run = running(job("r", 1, model="fixed:1", gpu_fraction=0.8), "a0", ("g0",), "a", quota=0.8, group="share:a0/g0")
    r = TesseraPolicy().schedule(req([job("f", 1, model="fixed:1", gpu_fraction=0.5)], [run], ns=nodes(a=1, b=0)))
    (p,) = r.placements
    assert p.shards[0].device_ids != ("g0",)


def test_multimodal_single_device_gets_module_quotas():
    j = job("mm", 1, model="fixed:1", workload="multimodal", encoder_share=0.3)
    r = TesseraPolicy().schedule(req([j], ns=nodes(a=1, b=0)))
    (g,) = [g for g in r.colocations if g.mode == "modules"]
    assert dict(g.members) == {"mm:encoder": 0.3, "mm:llm": 0.7}


def test_reshard_when_modality_mix_shifts():
    j = job("mm", 4, kind="a", workload="multimodal", encoder_share=0.75, elastic=False)
    r0 = running(j, "a0", ("g0", "g1", "g2", "g3"), "a", plan=Plan(1, 4, 0, 4.0, encoder_ranks=1))
    r = TesseraPolicy().schedule(req([], [r0], ns=nodes(a=1, b=0)))
    (a,) = r.reshards
    assert (a.encoder_ranks, a.llm_ranks) == (3, 1) and a.cost_s > 0
    # Balanced already: nothing to do.
    j2 = job("mm", 4, kind="a", workload="multimodal", encoder_share=0.5, elastic=False)
    r1 = running(j2, "a0", ("g0", "g1", "g2", "g3"), "a", plan=Plan(1, 4, 0, 4.0, encoder_ranks=2))
    assert not TesseraPolicy().schedule(req([], [r1], ns=nodes(a=1, b=0))).reshards


def test_repartition_when_measured_load_shifts():
    a = running(job("x", 1, model="fixed:1", gpu_fraction=0.7), "a0", ("g0",), "a", quota=0.3, group="share:a0/g0")
    b = running(job("y", 1, model="fixed:1", gpu_fraction=0.2), "a0", ("g0",), "a", quota=0.6, group="share:a0/g0")
    g = ColocationGroup("share:a0/g0", "a0", ("g0",), (("x", 0.3), ("y", 0.6)), "mps")
    r = TesseraPolicy().schedule(req([], [a, b], ns=nodes(a=1, b=0), groups=(g,)))
    (rp,) = r.repartitions
    assert dict(rp.quotas) == {"x": 0.7, "y": 0.2} and not rp.live and rp.cost_s > 0
    live = ColocationGroup("share:a0/g0", "a0", ("g0",), (("x", 0.3), ("y", 0.6)), "cpuset")
    (rp,) = TesseraPolicy().schedule(req([], [a, b], ns=nodes(a=1, b=0), groups=(live,))).repartitions
    assert rp.live and rp.cost_s == 0


def test_infeasible_no_configuration():
    r = TesseraPolicy().schedule(req([job("x", 1, model="unknown")]))
    assert "no feasible configuration" in r.infeasible[0].reason


def test_infeasible_tenant_quota():
    r = TesseraPolicy().schedule(req([job("x", 2, tenant="t", elastic=False)], tenant_quotas=(("t", 1),)))
    assert not r.placements and "quota" in r.infeasible[0].reason


def test_infeasible_waiting_and_starvation_reported():
    full = running(job("r", 4, kind="a", iters=10**9, elastic=False), "a0", ("g0", "g1", "g2", "g3"), "a")
    j = job("w", 4, kind="a", iters=10**9, elastic=False, t=0.0)
    pol = TesseraPolicy(wait_bound_s=100.0, preempt=False)
    r = pol.schedule(req([j], [full], ns=nodes(a=1, b=0), now=1000.0))
    assert r.infeasible[0].reason.startswith("waiting") and r.starving == ("w",)


def test_starving_job_goes_first():
    ns = nodes(a=1, b=0)
    old = job("old", 4, kind="a", iters=10**6, elastic=False, t=0.0)
    new = job("new", 4, kind="a", iters=10, elastic=False, t=900.0)
    r = TesseraPolicy(wait_bound_s=500.0).schedule(req([new, old], ns=ns, now=1000.0))
    assert [p.job_id for p in r.placements] == ["old"]


def test_srpt_order_without_estimator_noise():
    ns = nodes(a=1, b=0)
    r = TesseraPolicy().schedule(req([job("long", 4, kind="a", iters=10**6, elastic=False, t=0),
                                      job("short", 4, kind="a", iters=10, elastic=False, t=5)], ns=ns))
    assert [p.job_id for p in r.placements] == ["short"]


def test_deterministic():
    js = [job(f"j{i}", 1 + i % 4, iters=100 * (i + 1), t=i) for i in range(12)]
    a = TesseraPolicy().schedule(req(js))
    b = TesseraPolicy().schedule(req(list(reversed(js))))
    assert a == b


@pytest.mark.parametrize("pol", [FCFSPolicy(), GavelPolicy(), SiaPolicy()])
def test_baselines_place_and_never_double_book(pol):
    js = [job(f"j{i}", 1 + i % 3, kind="a" if i % 2 else "b", iters=100 * (i + 1), t=i) for i in range(10)]
    r = pol.schedule(req(js))
    used = [(s.node, d) for p in r.placements for s in p.shards for d in s.device_ids]
    assert len(used) == len(set(used)) and r.placements


def test_fcfs_uses_requested_type_and_count():
    r = FCFSPolicy().schedule(req([job("x", 2, kind="a")]))
    (p,) = r.placements
    assert p.gpu_type == "a" and p.num_devices == 2 and len(p.shards) == 1


def test_fcfs_falls_back_to_least_feasible_count():
    r = FCFSPolicy().schedule(req([job("x", 1, kind="a", model="big")]))
    assert r.placements[0].num_devices == 4


def test_gavel_picks_fastest_type_for_requested_count():
    r = GavelPolicy().schedule(req([job("x", 2, kind="a")]))
    assert r.placements[0].gpu_type == "b" and r.placements[0].num_devices == 2


def test_policy_without_estimator_uses_requested_resources():
    r = TesseraPolicy().schedule(ScheduleRequest(nodes(), (job("x", 2, kind="a"),)))
    assert r.placements[0].num_devices == 2 and r.placements[0].gpu_type == "a"


def test_firstfit_and_controller_imports_unchanged():
    from controller.policy import FirstFit, JobView as JV, NodeView as NV, Placement as P, RunningJob as RJ, Shard as S  # noqa: F401
    r = FirstFit().schedule(ScheduleRequest(nodes(a=1, b=0), (JV("x", num_devices=2),)))
    assert r.placements[0].num_devices == 2 and r.resizes == () and r.preemptions == ()


# -- reviewer regressions: nothing a running job carries may stop a round ------------------

def _mm_running(share: float, ranks: int, enc: int) -> RunningJob:
    j = job("mm", ranks, kind="a", workload="multimodal", encoder_share=share, elastic=False)
    devs = tuple(f"g{i}" for i in range(ranks))
    return running(j, "a0", devs, "a", plan=Plan(1, ranks, 0, 4.0, encoder_ranks=enc))


@pytest.mark.parametrize("ranks,enc", [(2, 2), (2, 3), (4, 4), (4, 7)])
def test_reshard_ignores_a_split_that_is_not_one_of_the_ranks(ranks, enc):
    # encoder ranks == world (pinned to the world size, or stale after a re-placement on
    # fewer ranks) divided by zero; above it gave a negative pace.
    r = TesseraPolicy().schedule(req([], [_mm_running(0.4, ranks, enc)], ns=nodes(a=1, b=0)))
    assert not r.reshards


@pytest.mark.parametrize("share", [0.0, float("nan"), float("inf"), -0.2])
def test_reshard_keeps_the_split_while_the_share_is_not_measured(share):
    # 0 = not measured (measured.py's contract): no reshard to 1:n-1 and back; a non-finite
    # share is no share (round(nan) raised every round).
    r = TesseraPolicy().schedule(req([], [_mm_running(share, 4, 2)], ns=nodes(a=1, b=0)))
    assert not r.reshards


def test_multimodal_module_group_with_a_non_finite_share_reads_as_not_measured():
    j = job("mm", 1, model="fixed:1", workload="multimodal", encoder_share=float("nan"))
    r = TesseraPolicy().schedule(req([j], ns=nodes(a=1, b=0)))
    (g,) = [g for g in r.colocations if g.mode == "modules"]
    assert dict(g.members) == {"mm:encoder": 0.05, "mm:llm": 0.95}


def test_lora_job_is_not_fused_into_a_group_whose_device_was_preempted():
    # A short whole-device job preempts the running LoRA group's only device; a LoRA job
    # on the same backbone must not then be fused into that group (two jobs on one device).
    ns = (NodeView("n", (DeviceView("d0", "gpu", "a100", 0, 100),)),)
    run = [RunningJob(JobView(j, iterations=10**6, gpu_fraction=0.3, backbone="llama", workload="peft"),
                      Placement(j, (Shard("n", ("d0",)),), gpu_type="a100", quota=0.3, group="share:n/d0"))
           for j in ("r1", "r2")]
    a = JobView("A", iterations=10, submit_time=1)
    f = JobView("F", iterations=100, gpu_fraction=0.2, backbone="llama", workload="peft", submit_time=2)
    r = TesseraPolicy().schedule(ScheduleRequest(nodes=ns, pending=(a, f), running=tuple(run), now=100))
    on_d0 = [p.job_id for p in r.placements if p.shards[0].device_ids == ("d0",)]
    assert on_d0 == ["A"]
    assert {p.job_id for p in r.preemptions} == {"r1", "r2"}
    assert not r.colocations and [i.job_id for i in r.infeasible] == ["F"]


def test_repartition_hands_out_every_unit_of_the_partition():
    from controller.policy.multiplex import quota_units, repartition_action
    # 1/3, 4/9, 2/9 of 6 cores: 2, 2.67, 1.33 -> 2, 3, 1 (0.3333 x 6 used to floor to 1).
    g = ColocationGroup("share:n/c0", "n", ("c0",), (("A", 0.5), ("B", 1 / 3), ("C", 1 / 6)), "cpuset")
    jobs = {k: JobView(k, gpu_fraction=f) for k, f in (("A", 1 / 3), ("B", 4 / 9), ("C", 2 / 9))}
    a = repartition_action(g, jobs, 60.0, capacity=6)
    units = {j: quota_units(q, 6) for j, q in a.quotas}
    assert units == {"A": 2, "B": 3, "C": 1}
    # Scaled down (sum above 1): still the whole partition, at least 1 unit each.
    jobs = {k: JobView(k, gpu_fraction=f) for k, f in (("A", 0.9), ("B", 0.9), ("C", 0.05))}
    g = ColocationGroup("share:n/c0", "n", ("c0",), (("A", 1 / 6), ("B", 1 / 6), ("C", 2 / 3)), "cpuset")
    a = repartition_action(g, jobs, 60.0, capacity=6)
    units = {j: quota_units(q, 6) for j, q in a.quotas}
    assert units == {"A": 3, "B": 2, "C": 1}  # the leftover unit by largest remainder (tie: by id)


def test_quota_units_tolerates_rounded_shares():
    from controller.policy.multiplex import quota_units
    assert quota_units(0.3333, 6) == 1  # 1.9998 is not within the tolerance of 2
    assert quota_units(1 / 3, 6) == 2 and quota_units(0.333333333, 6) == 2
    assert quota_units(round(5 / 6, 9), 6) == 5 and quota_units(0.16, 6) == 1


def test_running_jobs_count_against_their_tenant_from_the_start_of_the_round():
    ns = (NodeView("n", tuple(DeviceView(f"d{i}", "gpu", "a100", 0, 100) for i in range(8))),)
    r0 = RunningJob(JobView("R", tenant="t", num_devices=4, iterations=10**5),
                    Placement("R", (Shard("n", ("d0", "d1", "d2", "d3")),), gpu_type="a100"))
    p = JobView("P", tenant="t", num_devices=4, iterations=10)
    r = TesseraPolicy().schedule(ScheduleRequest(nodes=ns, pending=(p,), running=(r0,), tenant_quotas=(("t", 4),)))
    assert not r.placements and not r.preemptions
    assert "quota" in r.infeasible[0].reason
    # Below the cap the pending job is placed next to it.
    r = TesseraPolicy().schedule(ScheduleRequest(nodes=ns, pending=(p,), running=(r0,), tenant_quotas=(("t", 8),)))
    assert [x.job_id for x in r.placements] == ["P"]
