"""Measured group demand: the agent's CPU busy fraction (/proc), its fold into
``JobStatus.busy``, the adapter's measured member demand, and the policy's repartition."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import pytest

from agent.executors import STEP_WINDOW, Executor, ExecutorManager, busy_fraction, process_cpu_s, step_time_median
from controller import adapter, measured
from controller.policy import TesseraPolicy
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import types_pb2 as tpb


def spin(seconds: float) -> float:
    """Busy-loop a thread for ``seconds`` of wall time; return that wall time."""
    def loop():
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    t0 = time.perf_counter()
    th = threading.Thread(target=loop)
    th.start()
    th.join()
    return time.perf_counter() - t0


def test_proc_reader_counts_a_busy_thread_of_this_process():
    c0 = process_cpu_s(os.getpid())
    wall = spin(0.4)
    c1 = process_cpu_s(os.getpid())
    assert c0 is not None and c1 is not None
    busy = busy_fraction(c1 - c0, wall, 1)
    assert busy is not None and busy > 0.2   # a CPU-bound 0.4 s: most of one core even on a loaded box
    assert process_cpu_s(2 ** 31 - 1) is None                     # no such process
    assert busy_fraction(1.0, 0.0, 1) is None and busy_fraction(1.0, 1.0, 0) is None
    assert busy_fraction(5.0, 1.0, 2) == 1.0 and busy_fraction(-1.0, 1.0, 2) == 0.0


def test_executor_progress_report_carries_busy_on_cpu(tmp_path):
    from agent.main import K

    reports = []

    async def on_report(ex, r):
        reports.append(r)

    mgr = ExecutorManager(tmp_path, [], on_report, report_interval_s=0.0)
    ex = Executor("a1", "j", 0, [], tmp_path / "j.log", cores=1)
    ex.proc = SimpleNamespace(pid=os.getpid())
    ex.cpu_mark = (process_cpu_s(os.getpid()), time.monotonic())
    spin(0.3)
    asyncio.run(mgr._event(ex, {"event": "progress", "step": 1, "total": 5, "loss": 1.0}))
    assert 0.0 < reports[-1]["busy"] <= 1.0
    # Not a CPU executor (cores 0): no measurement, no field.
    ex2 = Executor("a2", "j", 0, [], tmp_path / "j.log")
    ex2.proc = SimpleNamespace(pid=os.getpid())
    asyncio.run(mgr._event(ex2, {"event": "progress", "step": 1, "total": 5}))
    assert "busy" not in reports[-1]
    msg = K(kind=K.PROGRESS)
    assert not msg.HasField("busy")
    msg.busy = 0.0
    assert msg.HasField("busy")       # a measured 0 (idle) is distinguishable from unset


def test_progress_reports_carry_the_median_of_every_step_not_only_the_sampled_one(tmp_path):
    assert step_time_median([]) == 0.0
    assert step_time_median([3.0, 1.0, 2.0]) == 2.0 and step_time_median([4.0, 1.0, 2.0, 3.0]) == 2.5
    reports = []

    async def on_report(ex, r):
        reports.append(r)

    # Throttled: one report per hour, except the first and the final one.
    mgr = ExecutorManager(tmp_path, [], on_report, report_interval_s=3600.0)
    ex = Executor("a1", "j", 0, [], tmp_path / "j.log")
    ex.proc = SimpleNamespace(pid=os.getpid())
    steps = [0.010] * 5 + [0.500] + [0.012] * 5 + [float("nan"), -1.0, "x", 0.030]   # one disturbed step, junk ignored

    async def feed():
        for i, dt in enumerate(steps):
            await mgr._event(ex, {"event": "progress", "step": i + 1, "total": len(steps), "loss": 1.0,
                                  "step_time_s": dt})
    asyncio.run(feed())
    assert len(reports) == 2                                   # the first step's, and the final step's
    assert reports[0]["step_time_median_s"] == 0.010
    assert reports[-1]["step_time_s"] == 0.030                 # the step the report happened to sample
    assert reports[-1]["step_time_median_s"] == 0.012          # the 12 valid steps' median
    assert ex.max_step_s == 0.5
    # A multimodal step's per-module events repeat its wall time: counted once.
    asyncio.run(mgr._event(ex, {"event": "progress", "step": 16, "total": 99, "step_time_s": 0.9, "module": "encoder",
                                "phases": {"forward": 0.1}}))
    assert len(ex.step_times) == 12
    # A report sent at a junk step carries no step time (0: the controller keeps its last)
    # rather than one the controller refuses with the whole report.
    mgr.report_interval_s = 0.0
    asyncio.run(mgr._event(ex, {"event": "progress", "step": 17, "total": 99, "step_time_s": float("nan")}))
    assert reports[-1]["step_time_s"] == 0.0 and reports[-1]["step_time_median_s"] == 0.012
    ex.step_times.extend([0.02] * (2 * STEP_WINDOW))
    assert len(ex.step_times) == STEP_WINDOW and step_time_median(ex.step_times) == 0.02   # the window slides


def test_fold_busy_takes_first_sample_smooths_and_keeps_zero_for_unmeasured():
    assert measured.fold_busy(0.0, None) == 0.0
    assert measured.fold_busy(0.4, None) == 0.4
    assert measured.fold_busy(0.0, 0.8) == pytest.approx(0.8)
    assert measured.fold_busy(0.0, 0.0) == measured.MIN_BUSY   # measured idle is not "unmeasured"
    assert measured.fold_busy(0.5, 1.0) == pytest.approx(0.3 * 1.0 + 0.7 * 0.5)
    assert measured.fold_busy(0.5, 7.0) == pytest.approx(0.3 + 0.35)   # sample clamped to 1
    v = 1.0
    for _ in range(40):
        v = measured.fold_busy(v, 0.1)
    assert v == pytest.approx(0.1, abs=1e-4)


def test_group_demands_rule():
    # Nothing measured: the requested shares.
    assert measured.group_demands({"a": (0.5, 0.0, 0.3), "b": (0.5, 0.0, 0.6)}) == {"a": 0.3, "b": 0.6}
    # a idle at 20 % of its half, b saturated: a keeps 0.1, b takes the rest.
    d = measured.group_demands({"a": (0.5, 0.2, 0.5), "b": (0.5, 0.95, 0.5)})
    assert d["a"] == pytest.approx(0.1) and d["b"] == pytest.approx(0.9)
    # Nobody saturated: divided by measured use (0.1 : 0.3), no core left unassigned.
    d = measured.group_demands({"a": (0.5, 0.2, 0.5), "b": (0.5, 0.6, 0.5)})
    assert d == pytest.approx({"a": 0.25, "b": 0.75})
    # Both using their halves alike: nothing moves.
    d = measured.group_demands({"a": (0.5, 0.5, 0.5), "b": (0.5, 0.5, 0.5)})
    assert d == pytest.approx({"a": 0.5, "b": 0.5})
    # One measured (not saturated), one not yet: the unmeasured keeps its ask.
    d = measured.group_demands({"a": (0.5, 0.1, 0.5), "b": (0.5, 0.0, 0.5)})
    assert d == pytest.approx({"a": 0.5, "b": 0.5})
    # Unmeasured member keeps its ask; the saturated measured one takes the slack.
    d = measured.group_demands({"a": (0.5, 0.0, 0.25), "b": (0.5, 1.0, 0.5)})
    assert d == pytest.approx({"a": 0.25, "b": 0.75})


def cpu_node(cores: int = 4) -> tpb.Node:
    n = tpb.Node(name="n1", state=tpb.READY)
    n.devices.add(id="cpu0", kind="cpu", model="Xeon", capacity=cores)
    n.partitions.add(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=cores, unit="cores")
    return n


def gpt_job(jid: str, share: float, units: int, busy: float = 0.0, created: float = 0.0) -> tpb.Job:
    j = tpb.Job(id=jid, created=created)
    j.spec.tenant = "t"
    j.spec.workload.type = "gpt"
    j.spec.workload.steps = 1000
    j.spec.resources.devices = 1
    j.spec.resources.device_kind = "cpu"
    j.spec.resources.share = share
    j.status.phase = tpb.RUNNING
    j.status.busy = busy
    j.status.placement.add(node="n1", device_ids=["cpu0"], partition_ids=["cpu0"], units=units)
    return j


def test_build_request_sets_group_members_demand_from_measured_busy():
    alone = gpt_job("c", 0.5, 2, busy=0.1)
    alone.status.placement[0].partition_ids[:] = ["cpu1"]
    alone.status.placement[0].device_ids[:] = ["cpu1"]
    node = cpu_node()
    node.devices.add(id="cpu1", kind="cpu", model="Xeon", capacity=4)
    node.partitions.add(id="cpu1", kind="cpuset", device_id="cpu1", capacity_units=4, unit="cores")
    req = adapter.build_request([node], [gpt_job("a", 0.5, 2, busy=0.2), gpt_job("b", 0.5, 2, busy=0.95, created=1.0),
                                         alone], now=1.0)
    (g,) = req.groups
    assert g.members == (("a", 0.5), ("b", 0.5))
    frac = {r.job.job_id: r.job.gpu_fraction for r in req.running}
    assert frac["a"] == pytest.approx(0.1) and frac["b"] == pytest.approx(0.9)
    assert frac["c"] == 0.5                       # not in a group: its requested share
    # Unmeasured: requested shares, as before.
    req = adapter.build_request([cpu_node()], [gpt_job("a", 0.5, 2), gpt_job("b", 0.5, 2, created=1.0)], now=1.0)
    assert {r.job.job_id: r.job.gpu_fraction for r in req.running} == {"a": 0.5, "b": 0.5}


def test_policy_shifts_cores_from_an_idle_member_to_a_saturated_one():
    # Both asked for (and hold) half of 4 cores; a is measured idle, b saturated.
    a, b = gpt_job("a", 0.5, 2, busy=0.05), gpt_job("b", 0.5, 2, busy=1.0, created=1.0)
    req = adapter.build_request([cpu_node()], [a, b], now=100.0)
    pol = TesseraPolicy()
    (rp,) = pol.schedule(req).repartitions
    q = dict(rp.quotas)
    assert rp.group_id == "share:n1/cpu0" and rp.live
    assert q["a"] < 0.5 < q["b"] and sum(q.values()) <= 1.0 + 1e-9
    assert adapter.quota_units(q["a"], 4) == 1 and adapter.quota_units(q["b"], 4) == 3
    # Both busy as asked: no repartition.
    a, b = gpt_job("a", 0.5, 2, busy=0.97), gpt_job("b", 0.5, 2, busy=0.97, created=1.0)
    assert pol.schedule(adapter.build_request([cpu_node()], [a, b], now=100.0)).repartitions == ()


def test_policy_shifts_cores_on_a_loaded_machine_and_then_holds():
    """A compute-bound member that a loaded machine holds below SATURATED (busy 0.6) still
    takes the cores an idle member leaves (before the fix both shrank to 1 of 4 cores and
    2 cores stayed unassigned); once shifted, the policy does not decide again while the
    split rounds to the units held (it used to repeat a no-op repartition every round)."""
    a, b = gpt_job("a", 0.5, 2, busy=0.08), gpt_job("b", 0.5, 2, busy=0.6, created=1.0)
    pol = TesseraPolicy()
    (rp,) = pol.schedule(adapter.build_request([cpu_node()], [a, b], now=100.0)).repartitions
    q = dict(rp.quotas)
    assert (adapter.quota_units(q["a"], 4), adapter.quota_units(q["b"], 4)) == (1, 3)
    # After the shift: a holds 1 core, b 3 (b's busy fraction now over 3 cores).
    a, b = gpt_job("a", 0.5, 1, busy=0.1), gpt_job("b", 0.5, 3, busy=0.55, created=1.0)
    assert pol.schedule(adapter.build_request([cpu_node()], [a, b], now=200.0)).repartitions == ()


def test_repartition_action_skips_splits_that_round_to_the_units_held():
    from controller.policy import multiplex as mx
    from controller.policy.types import ColocationGroup, JobView

    g = ColocationGroup("share:n1/cpu0", "n1", ("cpu0",), (("a", 0.25), ("b", 0.75)), "cpuset")
    jobs = {"a": JobView("a", gpu_fraction=0.05), "b": JobView("b", gpu_fraction=0.95)}
    assert mx.repartition_action(g, jobs, 60.0) is not None          # quota moved by 0.2 ...
    assert mx.repartition_action(g, jobs, 60.0, capacity=4) is None   # ... but 1:3 cores either way
    assert mx.repartition_action(g, jobs, 60.0, capacity=100) is not None
    assert [mx.quota_units(q, 4) for q in (0.05, 0.25, 0.5, 0.95, 1.0)] == [1, 1, 2, 3, 4]


def test_a_live_grant_change_restarts_the_step_window_and_the_profile_run(tmp_path):
    """UpdateGrant on a running executor: the median window restarts (its steps ran on the
    old quota) and the profile labels carry the new quota, so the estimator files the
    steps from here on as a new run (whose first steps are its warm-up), not into the old
    quota's profile point. (No cores in the grants: nothing is re-pinned here.)"""
    from agent.partitions.base import Grant

    class Parts:
        def regrant(self, gid, units):
            return Grant(gid, "cpu0", "cpuset", "cpu0", units, threads=units)

    mgr = ExecutorManager(tmp_path, [], None, report_interval_s=0.0)
    mgr.parts = Parts()
    ex = Executor("a1", "j", 0, [], tmp_path / "j.log", cores=4)
    ex.proc = SimpleNamespace(pid=os.getpid())
    ex.grant = Grant(ex.grant_id, "cpu0", "cpuset", "cpu0", 4, threads=4)
    ex.labels = {"module": "gpt:x", "threads": "4"}
    ex.step_times.extend([0.01, 0.011, 0.012])
    mgr.executors[("a1", 0)] = ex
    _, g, old = mgr.update_grant("a1", 0, 2)
    assert (old, g.units) == (4, 2)
    assert list(ex.step_times) == [] and step_time_median(ex.step_times) == 0.0
    assert ex.labels == {"module": "gpt:x", "threads": "2"}
