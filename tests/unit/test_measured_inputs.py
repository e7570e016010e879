"""Measured inputs to the live policy: the encoder-share fold (controller/measured.py),
build_request's encoder_share / current split / colocation groups (controller/adapter.py),
and the pure Tessera policy deciding a reshard and a repartition from them."""

from __future__ import annotations

import pytest

from controller import adapter, measured
from controller.policy import TesseraPolicy
from tessera import manifest
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import types_pb2 as tpb


def mods(enc_f: float, enc_b: float, llm_f: float, llm_b: float, comm: float = 0.0, idle: float = 0.0) -> dict:
    return {"encoder": cpb.ModuleTime(forward_s=enc_f, backward_s=enc_b, communication_s=comm, idle_s=idle),
            "llm": cpb.ModuleTime(forward_s=llm_f, backward_s=llm_b, communication_s=comm, idle_s=idle)}


def test_step_share_counts_compute_only_and_needs_both_modules():
    # Communication and idle depend on the split, not the work: left out.
    assert measured.step_encoder_share(mods(1.0, 2.0, 3.0, 3.0, comm=5.0, idle=9.0)) == pytest.approx(1 / 3)
    assert measured.step_encoder_share({"encoder": cpb.ModuleTime(forward_s=1.0)}) is None
    assert measured.step_encoder_share(mods(0, 0, 0, 0, idle=1.0)) is None
    assert measured.step_encoder_share({}) is None


def test_fold_takes_first_sample_then_smooths_and_ignores_empty_reports():
    s = measured.fold_encoder_share(0.0, mods(1, 0, 1, 0))
    assert s == pytest.approx(0.5)
    s2 = measured.fold_encoder_share(s, mods(9, 0, 1, 0), alpha=0.3)
    assert s2 == pytest.approx(0.3 * 0.9 + 0.7 * 0.5)
    assert measured.fold_encoder_share(s2, {}) == s2
    # The proto map folds the same way as a dict.
    r = cpb.ExecutorReport(kind=cpb.ExecutorReport.PROGRESS)
    for k, v in mods(3, 0, 1, 0).items():
        r.modules[k].CopyFrom(v)
    assert measured.fold_encoder_share(0.0, r.modules) == pytest.approx(0.75)
    # A long run of one mix converges to it.
    for _ in range(40):
        s2 = measured.fold_encoder_share(s2, mods(1, 0, 3, 0))
    assert s2 == pytest.approx(0.25, abs=1e-4)


def cpu_node(name: str = "n1", parts: int = 2, cores: int = 2) -> tpb.Node:
    n = tpb.Node(name=name, state=tpb.READY)
    for i in range(parts):
        n.devices.add(id=f"cpu{i}", kind="cpu", model="Xeon", capacity=cores)
        n.partitions.add(id=f"cpu{i}", kind="cpuset", device_id=f"cpu{i}", capacity_units=cores, unit="cores")
    return n


def mm_job(jid: str, share: float, encoder_ranks: int = 0, pinned="auto", mode: str = "disaggregated") -> tpb.Job:
    wl = {"type": "multimodal", "steps": 1000, "batch_size": 4,
          "multimodal": {"mode": mode, "disaggregated": {"encoder_ranks": pinned}}}
    j = tpb.Job(id=jid, spec=manifest.to_proto(manifest.validate({
        "apiVersion": "tessera/v1", "name": jid, "tenant": "t", "workload": wl,
        # colocated mode runs on one device (refused at submission otherwise)
        "resources": {"devices": 1 if mode == "colocated" else 2, "device_kind": "cpu"}})))
    j.status.phase = tpb.RUNNING
    j.status.step = 10
    j.status.encoder_share = share
    j.status.encoder_ranks = encoder_ranks
    devs = ["cpu0"] if mode == "colocated" else ["cpu0", "cpu1"]
    j.status.placement.add(node="n1", device_ids=devs, partition_ids=devs)
    return j


def gpt_job(jid: str, share: float, units: int, pid: str = "cpu0", created: float = 0.0) -> tpb.Job:
    j = tpb.Job(id=jid, created=created)
    j.spec.tenant = "t"
    j.spec.workload.type = "gpt"
    j.spec.workload.steps = 1000
    j.spec.resources.devices = 1
    j.spec.resources.device_kind = "cpu"
    j.spec.resources.share = share
    j.status.phase = tpb.RUNNING
    j.status.placement.add(node="n1", device_ids=[pid], partition_ids=[pid], units=units)
    return j


def test_build_request_sets_encoder_share_and_current_split():
    req = adapter.build_request([cpu_node()], [mm_job("m", 0.8, encoder_ranks=1)], now=100.0)
    (r,) = req.running
    assert r.job.encoder_share == pytest.approx(0.8)
    assert r.placement.plan is not None and r.placement.plan.num_devices == 2 and r.placement.plan.encoder_ranks == 1
    # Pinned in the spec, no reshard yet: the spec's split.
    (r,) = adapter.build_request([cpu_node()], [mm_job("m", 0.5, pinned=1)], now=1.0).running
    assert r.placement.plan.encoder_ranks == 1
    # "auto" (the runtime picks) or colocated: no current split known, no plan.
    (r,) = adapter.build_request([cpu_node()], [mm_job("m", 0.5)], now=1.0).running
    assert r.placement.plan is None
    (r,) = adapter.build_request([cpu_node()], [mm_job("m", 0.5, mode="colocated")], now=1.0).running
    assert r.placement.plan is None and r.job.encoder_share == 0.5
    # Not multimodal: no encoder share even if a value were there.
    g = gpt_job("g", 0.5, 1)
    g.status.encoder_share = 0.7
    (r,) = adapter.build_request([cpu_node()], [g], now=1.0).running
    assert r.job.encoder_share == 0.0


def test_build_request_groups_partitions_shared_by_several_running_jobs():
    a, b = gpt_job("a", 0.5, 1), gpt_job("b", 0.5, 1, created=1.0)
    alone = gpt_job("c", 0.5, 1, pid="cpu1")      # alone on cpu1: no group
    whole = gpt_job("d", 0.0, 0, pid="cpu1")      # whole partition: quota 1, not shared
    whole.status.placement[0].partition_ids[:] = ["cpu1"]
    req = adapter.build_request([cpu_node()], [a, b, alone], now=1.0)
    (g,) = req.groups
    assert (g.group_id, g.node, g.device_ids, g.mode) == ("share:n1/cpu0", "n1", ("cpu0",), "cpuset")
    assert g.members == (("a", 0.5), ("b", 0.5))
    assert adapter.build_request([cpu_node()], [alone, whole], now=1.0).groups == ()


def test_policy_reshards_from_measured_encoder_share():
    pol = TesseraPolicy()
    # 2 ranks split 1:1; the encoder does almost nothing: no better split with both sides.
    req = adapter.build_request([cpu_node()], [mm_job("m", 0.1, encoder_ranks=1)], now=100.0)
    assert pol.schedule(req).reshards == ()
    # Four ranks on two nodes (2 each), split 1:3; measured share 0.75 -> 3:1 pays.
    j = mm_job("m", 0.75, encoder_ranks=1)
    j.spec.resources.devices = 4
    j.status.placement.add(node="n2", device_ids=["cpu0", "cpu1"], partition_ids=["cpu0", "cpu1"])
    req = adapter.build_request([cpu_node(), cpu_node("n2")], [j], now=100.0)
    (rs,) = pol.schedule(req).reshards
    assert (rs.job_id, rs.encoder_ranks, rs.llm_ranks) == ("m", 3, 1)
    assert "encoder share 0.75" in rs.reason


def test_policy_repartitions_a_shared_partition_from_member_demand():
    # a holds 3 of 4 cores but asks for a quarter; b holds 1 and asks for half.
    node = cpu_node(parts=1, cores=4)
    a, b = gpt_job("a", 0.25, 3), gpt_job("b", 0.5, 1, created=1.0)
    req = adapter.build_request([node], [a, b], now=100.0)
    (g,) = req.groups
    assert g.members == (("a", 0.75), ("b", 0.25))
    (rp,) = TesseraPolicy().schedule(req).repartitions
    assert rp.group_id == "share:n1/cpu0" and rp.live
    assert dict(rp.quotas) == {"a": 0.25, "b": 0.5}


def test_executor_forwards_latest_module_phases_in_progress_reports(tmp_path):
    import asyncio

    from agent.executors import Executor, ExecutorManager
    from agent.main import module_time

    reports = []

    async def on_report(ex, r):
        reports.append(r)

    mgr = ExecutorManager(tmp_path, [], on_report, report_interval_s=0.0)
    ex = Executor("a1", "m", 0, [], tmp_path / "m.log")
    events = [
        {"event": "progress", "step": 1, "total": 5, "loss": 2.0, "module": "multimodal", "phases": {"forward": 9.0}},
        {"event": "progress", "step": 1, "total": 5, "module": "encoder",
         "phases": {"idle": 0.5, "forward": 1.0, "backward": 2.0, "communication": 0.25}},
        {"event": "progress", "step": 1, "total": 5, "module": "llm", "phases": {"idle": 0.0, "forward": 3.0}},
        {"event": "progress", "step": 2, "total": 5, "loss": 1.5, "module": "multimodal", "phases": {"forward": 9.0}},
    ]

    async def feed():
        for ev in events:
            await mgr._event(ex, ev)

    asyncio.run(feed())
    assert reports[0]["modules"] == {}            # no breakdown reported yet
    last = reports[-1]
    assert last["kind"] == "PROGRESS" and last["step"] == 2 and last["loss"] == 1.5
    assert last["modules"] == {"encoder": {"idle": 0.5, "forward": 1.0, "backward": 2.0, "communication": 0.25},
                               "llm": {"idle": 0.0, "forward": 3.0}}
    mt = module_time(last["modules"]["encoder"])
    assert (mt.forward_s, mt.backward_s, mt.communication_s, mt.idle_s) == (1.0, 2.0, 0.25, 0.5)
    r = cpb.ExecutorReport(kind=cpb.ExecutorReport.PROGRESS)
    for name, ph in last["modules"].items():
        r.modules[name].CopyFrom(module_time(ph))
    assert measured.fold_encoder_share(0.0, r.modules) == pytest.approx(0.5)


# -- reviewer regressions: non-finite timings, splits that are not one of the ranks --------

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_timings_are_no_sample(bad):
    assert measured.step_encoder_share(mods(bad, 0.1, 0.2, 0.2)) is None
    assert measured.step_encoder_share(mods(0.1, 0.1, bad, 0.2)) is None
    assert measured.fold_encoder_share(0.0, mods(bad, 0.1, 0.2, 0.2)) == 0.0
    assert measured.fold_encoder_share(0.4, mods(0.1, bad, 0.2, 0.2)) == 0.4
    # A non-finite stored share reads as not measured: the next good sample is taken as is.
    assert measured.fold_encoder_share(float("nan"), mods(1, 0, 1, 0)) == pytest.approx(0.5)


def test_fold_busy_ignores_non_finite_samples_and_recovers_from_a_non_finite_value():
    assert measured.fold_busy(0.0, float("nan")) == 0.0
    assert measured.fold_busy(0.6, float("nan")) == 0.6
    assert measured.fold_busy(0.6, float("inf")) == 0.6
    assert measured.fold_busy(float("nan"), 0.5) == pytest.approx(0.5)
    assert measured.group_demands({"a": (0.5, float("nan"), 0.5), "b": (0.5, 1.0, 0.5)}) == \
        measured.group_demands({"a": (0.5, 0.0, 0.5), "b": (0.5, 1.0, 0.5)})


def test_nan_timing_does_not_stop_scheduling():
    s = measured.fold_encoder_share(0.0, mods(float("nan"), 0.1, 0.2, 0.2))
    j = mm_job("mm", share=s, encoder_ranks=1)
    TesseraPolicy().schedule(adapter.build_request([cpu_node()], [j], now=10.0))


@pytest.mark.parametrize("pinned,status,want", [(2, 0, 1), (5, 0, 1), (1, 0, 1), (1, 2, 1), ("auto", 0, 0)])
def test_current_split_is_clamped_to_the_ranks_like_the_runtime(pinned, status, want):
    # devices: 2 with encoder_ranks: 2 is a valid spec (the runtime clamps to world - 1);
    # a reshard's status.encoder_ranks stays stale when the job is re-placed on fewer ranks.
    j = mm_job("mm", share=0.4, encoder_ranks=status, pinned=pinned)
    req = adapter.build_request([cpu_node()], [j], now=10.0)
    (r,) = req.running
    assert (r.placement.plan.encoder_ranks if r.placement.plan else 0) == want
    assert adapter.encoder_ranks_now(j) == (status or (pinned if pinned != "auto" else 0))
    assert adapter.encoder_ranks_now(j, 1) == 0
    TesseraPolicy().schedule(req)  # no ZeroDivisionError


def test_unmeasured_share_keeps_a_pinned_split():
    j = mm_job("mm", share=0.0, pinned=2)  # unmeasured: 2:2 stays (it went to 1:3 and back)
    n = cpu_node(parts=4)
    j.status.ClearField("placement")
    j.status.placement.add(node="n1", device_ids=["cpu0", "cpu1", "cpu2", "cpu3"],
                           partition_ids=["cpu0", "cpu1", "cpu2", "cpu3"])
    req = adapter.build_request([n], [j], now=10.0)
    assert req.running[0].placement.plan.encoder_ranks == 2
    assert not TesseraPolicy().schedule(req).reshards
