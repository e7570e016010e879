"""The live Tessera policy repartitions a colocation group on its own, from measured load.

Two real jobs are packed by the ``tessera`` policy on ONE CPU core-set partition, half
each: an input-bound one (``workload.step_delay_s``: each step waits for its input, its
cores mostly idle) and a compute-bound GPT job. Nothing is scripted: the executors'
measured CPU busy fractions (/proc utime+stime over wall x granted cores, in PROGRESS
reports) are folded into ``JobStatus.busy`` (controller/measured.py); the adapter turns
them into the members' demand; the policy decides a repartition ("measured load
shifted"); controller/actions.py carries it out live through the agent's ``UpdateGrant``
(fenced write of the job and the allocation record, then every thread of the running
executor re-pinned). Asserted: the compute-bound job's units and its process's real CPU
affinity grow, the input-bound job's units shrink, neither process is restarted, and
both jobs succeed with their loss falling.

The partition has 4 units or more: on a machine with fewer than 4 cores the agent counts
each core twice (``--cpu-units-per-core 2``: 2 cores = a 4-unit partition, a grant runs
on the physical cores of its units), so that the 1:3 split exists; with 4 or more cores
it is the machine's own cores. Every wait is a watch or a poll on a condition with a
timeout; the timeouts are generous for a loaded 2-core machine.
"""

from __future__ import annotations

import os
import time

import grpc
import pytest
from _live import cpus, ended, eventually, running_executors, thread_cpus, watch_until

from tessera import manifest
from tessera.api.v1 import agent_pb2, agent_pb2_grpc
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import types_pb2 as tpb

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")]

TINY = {"vocab": 64, "seq_len": 16, "layers": 1, "hidden": 32, "heads": 2}
SMALL = {"vocab": 64, "seq_len": 32, "layers": 2, "hidden": 64, "heads": 4}
IDLE_STEPS, IDLE_DELAY_S = 80, 0.25    # ~20 s of mostly waiting; the decision came 3-5 s in
BUSY_STEPS = 700                       # compute-bound: ~10-60 s depending on the machine's load


def spec(name: str, model: dict, steps: int, batch: int, delay: float = 0.0) -> tpb.JobSpec:
    w = {"type": "gpt", "model": model, "steps": steps, "batch_size": batch, "learning_rate": 0.01,
         "checkpoint_every": 1000}
    if delay:
        w["step_delay_s"] = delay
    return manifest.to_proto(manifest.validate({
        "apiVersion": "tessera/v1", "name": name, "tenant": "it", "workload": w,
        "resources": {"devices": 1, "device_kind": "cpu", "share": 0.5},
    }))


def units(j: tpb.Job) -> int:
    return j.status.placement[0].units


async def test_tessera_policy_shifts_cores_to_the_busy_member_from_measured_load(live):
    ncores = len(os.sched_getaffinity(0))
    per_core = 2 if ncores < 4 else 1
    cap = ncores * per_core
    half = cap // 2
    async with live(policy="tessera", prefix="/measured", cpu_units_per_core=per_core) as (jobs, nodes, acfg):
        (part,) = (await nodes.ListNodes(cpb.ListNodesRequest())).nodes[0].partitions
        assert (part.kind, part.capacity_units) == ("cpuset", cap)

        # The input-bound job first, then the compute-bound one: packed half and half.
        idle = (await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec("input-bound", TINY, IDLE_STEPS, 4,
                                                                 IDLE_DELAY_S)))).job.id
        await watch_until(jobs, idle, lambda j: j.status.phase == tpb.RUNNING and j.status.step > 0)
        busy = (await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec("compute-bound", SMALL, BUSY_STEPS, 16)))).job.id
        seen_busy: list[tpb.Job] = []
        jb = await watch_until(jobs, busy, lambda j: j.status.phase == tpb.RUNNING and j.status.step > 0,
                               seen=seen_busy)
        t_both = time.monotonic()
        for jid in (idle, busy):
            j = await jobs.GetJob(cpb.GetJobRequest(job_id=jid)) if jid == idle else jb
            assert j.status.last_decision.action == "pack" and units(j) == half, j.status.last_decision

        async with grpc.aio.insecure_channel(acfg.listen) as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            ex = await running_executors(stub)
            pid_idle, pid_busy = ex[idle].pid, ex[busy].pid
            before_idle, before_busy = cpus(pid_idle), cpus(pid_busy)
            assert ex[idle].units == ex[busy].units == half

            # The policy decides on its own, from the measured busy fractions.
            jb = await watch_until(jobs, busy, lambda j: j.status.last_decision.action == "repartition", 120,
                                   seen_busy)
            t_shift = time.monotonic() - t_both
            d = jb.status.last_decision
            # Controller clock: from the compute-bound job's RUNNING to the decision.
            running_at = next(h.time for h in jb.status.history if h.phase == tpb.RUNNING)
            assert d.policy == "tessera" and d.reason.startswith("measured load shifted"), d
            assert ", live" in d.reason and f"{part.id} on node-1 {half} -> " in d.reason, d.reason
            ji = await jobs.GetJob(cpb.GetJobRequest(job_id=idle))
            assert ji.status.last_decision.action == "repartition", ji.status.last_decision
            new_idle, new_busy = units(ji), units(jb)
            assert new_busy > half > new_idle >= 1 and new_idle + new_busy <= cap
            # What drove it: measured busy fractions (EWMA), the input-bound job's far lower.
            assert 0.0 < ji.status.busy < jb.status.busy, (ji.status.busy, jb.status.busy)
            assert ji.status.busy < 0.5
            ls = await nodes.ListNodes(cpb.ListNodesRequest())
            assert ls.nodes[0].partitions[0].allocated_units == new_idle + new_busy

            # Carried out live by the agent: same processes, new units, every thread re-pinned.
            ex = await eventually(
                lambda: _executors_at(stub, {idle: new_idle, busy: new_busy}), 30, "agent grants at the new units")
            assert (ex[idle].pid, ex[busy].pid) == (pid_idle, pid_busy)
            after_idle, after_busy = cpus(pid_idle), cpus(pid_busy)
            assert len(after_busy) > len(before_busy), (before_busy, after_busy)
            assert all(t == after_busy for t in thread_cpus(pid_busy))
            assert all(t == after_idle for t in thread_cpus(pid_idle))
            if per_core == 1:  # real cores: one per unit, and the input-bound job's set shrinks too
                assert len(after_busy) == new_busy and not after_busy & after_idle
                assert len(after_idle) == new_idle < len(before_idle), (before_idle, after_idle)
            else:              # 2 units per core: its units shrink; it keeps (at least) one core
                assert after_idle <= before_idle and len(after_idle) >= 1
            print(f"\nmeasured repartition: {cap} units on {ncores} cores ({per_core}/core); "
                  f"{half}:{half} -> {new_idle}:{new_busy} units, decided {d.time - running_at:.1f}s after the "
                  f"compute-bound job started running ({t_shift:.1f}s after the test saw both step); busy fractions "
                  f"input-bound {ji.status.busy:.2f}, compute-bound {jb.status.busy:.2f}; affinity input-bound "
                  f"{sorted(before_idle)} -> {sorted(after_idle)}, compute-bound {sorted(before_busy)} -> "
                  f"{sorted(after_busy)}")

        final_busy = await watch_until(jobs, busy, ended, 240, seen_busy)
        final_idle = await watch_until(jobs, idle, ended, 120)
    for f in (final_idle, final_busy):
        st = f.status
        assert st.phase == tpb.SUCCEEDED, st.reason
        assert st.loss < st.first_loss
        # Never restarted: one allocation, one attempt.
        assert st.attempts == 1 and st.preemptions == 0, st
    assert final_idle.status.step == IDLE_STEPS and final_busy.status.step == BUSY_STEPS
    # The shift held: no decision took the cores back while both ran.
    assert units(final_busy) >= new_busy
    assert {x.status.allocation_id for x in seen_busy if x.status.allocation_id} == {final_busy.status.allocation_id}


async def _executors_at(stub, want: dict[str, int]) -> dict[str, agent_pb2.ExecutorStatus] | None:
    ex = await running_executors(stub)
    return ex if all(j in ex and ex[j].units == u for j, u in want.items()) else None
