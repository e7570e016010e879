"""Repartitioning a colocated group, carried out: the agent's live ``UpdateGrant`` re-pins a
running executor (every thread of it) without restarting it, refuses beyond capacity with
the reason and then changes nothing; the controller carries out a policy's repartition
decision live (fenced etcd write of the job and the allocation record, then the RPC) and
the jobs still train to success; a reshard decision of a disaggregated multimodal job is
persisted fenced and carried out by checkpoint and relaunch under the new encoder:LLM
split, from which the job resumes and succeeds. Real etcd, real gRPC on loopback, real executors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import grpc
import pytest
from _live import cpus, ended, eventually, running_executors, thread_cpus, watch_until

from controller import main as cmain
from controller.policy import Repartition, Reshard, ScheduleReply, TesseraPolicy
from tessera import manifest
from tessera.api.v1 import agent_pb2, agent_pb2_grpc
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import types_pb2 as tpb

TINY = {"vocab": 64, "seq_len": 16, "layers": 1, "hidden": 32, "heads": 2}

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for a 2-core partition")


def spec(name: str, steps: int, share: float) -> tpb.JobSpec:
    return manifest.to_proto(manifest.validate({
        "apiVersion": "tessera/v1", "name": name, "tenant": "it",
        "workload": {"type": "gpt", "model": TINY, "steps": steps, "batch_size": 4, "learning_rate": 0.01,
                     "checkpoint_every": 10},
        "resources": {"devices": 1, "device_kind": "cpu", "share": share},
    }))


async def _free_units(stub, n: int) -> bool:
    return (await stub.GetStatus(agent_pb2.GetStatusRequest())).partitions[0].free_units == n


def _threads_events(log: Path) -> list[tuple[int, int]]:
    """(threads, cores) of every ``threads`` event the executor printed so far."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "TESSERA_EVENT" in line:
            ev = json.loads(line.split("TESSERA_EVENT", 1)[1])
            if ev.get("event") == "threads":
                out.append((ev["threads"], ev["cores"]))
    return out


async def _executor_units(stub, job_id: str, units: int) -> agent_pb2.ExecutorStatus | None:
    ex = (await running_executors(stub))[job_id]
    return ex if ex.units == units else None


async def test_update_grant_repins_running_executor_and_refuses_beyond_capacity(live):
    async with live(policy="tessera", prefix="/upd", stop_grace_s=5) as (jobs, nodes, acfg):
        a = (await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec("a", 100000, 0.5)))).job.id
        b = (await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec("b", 100000, 0.5)))).job.id
        ja = await watch_until(jobs, a, lambda j: j.status.phase == tpb.RUNNING and j.status.step > 0)
        await watch_until(jobs, b, lambda j: j.status.phase == tpb.RUNNING and j.status.step > 0)
        async with grpc.aio.insecure_channel(acfg.listen) as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            ex = await running_executors(stub)
            pa, pb = ex[a].pid, ex[b].pid
            ca, cb = cpus(pa), cpus(pb)
            assert len(ca) == 1 and len(cb) == 1 and not ca & cb
            req = agent_pb2.UpdateGrantRequest(allocation_id=ja.status.allocation_id, rank=0, units=2,
                                               fencing_token=10**12)

            # Beyond capacity: b holds the other core. Refused with the reason, nothing changed.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.UpdateGrant(req)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert "partition cpu0 (cpuset): asked 2 cores" in e.value.details()
            assert "only 1 of 2 cores are free" in e.value.details()
            ex = await running_executors(stub)
            assert (ex[a].pid, ex[a].units, ex[b].units) == (pa, 1, 1)
            assert cpus(pa) == ca and all(t == ca for t in thread_cpus(pa)) and cpus(pb) == cb
            st = await stub.GetStatus(agent_pb2.GetStatusRequest())
            assert st.partitions[0].free_units == 0

            # Bad input: named field, nothing written.
            for bad, field in ((agent_pb2.UpdateGrantRequest(allocation_id=ja.status.allocation_id, units=0,
                                                             fencing_token=10**12), "units"),
                               (agent_pb2.UpdateGrantRequest(units=1, fencing_token=10**12), "allocation_id")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.UpdateGrant(bad)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.UpdateGrant(agent_pb2.UpdateGrantRequest(allocation_id="a-none", units=1,
                                                                     fencing_token=10**12))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND

            # b ends: its core is free, a grows live to both cores — same process, every thread.
            await jobs.CancelJob(cpb.CancelJobRequest(job_id=b))
            await eventually(lambda: _free_units(stub, 1), 60, "b's core released")
            r = await stub.UpdateGrant(req)
            assert (r.pid, r.old_units, r.units, r.partition_id) == (pa, 1, 2, "cpu0")
            assert set(r.cores) == ca | cb == cpus(pa)
            assert all(t == ca | cb for t in thread_cpus(pa))
            # The runtime follows at its next step: two intra-op threads on the two cores.
            log = Path(acfg.state_dir) / "logs" / f"{a}.log"
            await eventually(lambda: _threads_events(log) == [(2, 2)], 60, "threads event after the grow")
            # And back to one core (the one it started on).
            req.units = 1
            r = await stub.UpdateGrant(req)
            assert (r.pid, r.units) == (pa, 1) and cpus(pa) == ca and all(t == ca for t in thread_cpus(pa))
            await eventually(lambda: _threads_events(log) == [(2, 2), (1, 1)], 60, "threads event after the shrink")
            # Not restarted, still training.
            step = (await jobs.GetJob(cpb.GetJobRequest(job_id=a))).status.step
            j = await watch_until(jobs, a, lambda j: j.status.step > step + 5)
            ex = await running_executors(stub)
            assert ex[a].pid == pa and ex[a].units == 1 and j.status.phase == tpb.RUNNING
        await jobs.CancelJob(cpb.CancelJobRequest(job_id=a))


class GrowOnce:
    """Tessera, plus one scripted repartition: once the packed job ``grow`` has run 20
    steps alone on its partition, its quota in the group goes to the whole partition.
    Scripted so that the decision comes at a known step (the policy's own decision from
    measured load: test_measured_repartition.py); under test is the controller carrying
    the decision out."""

    name = "grow-once"

    def __init__(self) -> None:
        self.inner = TesseraPolicy()
        self.sent = False

    def schedule(self, request):
        reply = self.inner.schedule(request)
        reps = list(reply.repartitions)
        for r in request.running:
            if not self.sent and r.job.done_iterations >= 20 and r.placement.quota < 1.0:
                s = r.placement.shards[0]
                reps.append(Repartition(f"share:{s.node}/{s.device_ids[0]}", ((r.job.job_id, 1.0),), True, 0.0,
                                        "scripted: measured load shifted"))
                self.sent = True
        return ScheduleReply(placements=reply.placements, infeasible=reply.infeasible, resizes=reply.resizes,
                             preemptions=reply.preemptions, repartitions=tuple(reps))


async def test_controller_repartitions_cpuset_group_live(live, monkeypatch):
    monkeypatch.setitem(cmain.POLICIES, "grow-once", GrowOnce)
    async with live(policy="grow-once", prefix="/rep", stop_grace_s=5) as (jobs, nodes, acfg):
        a = (await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec("grow", 400, 0.5)))).job.id
        seen: list[tpb.Job] = []
        j = await watch_until(jobs, a, lambda j: j.status.phase == tpb.RUNNING and j.status.step > 0, seen=seen)
        assert j.status.placement[0].units == 1 and j.status.last_decision.action == "pack"
        async with grpc.aio.insecure_channel(acfg.listen) as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            pid = (await running_executors(stub))[a].pid
            assert len(cpus(pid)) == 1
            j = await watch_until(jobs, a, lambda j: j.status.last_decision.action == "repartition", seen=seen)
            # Persisted: the job's quota and the partition's allocation record, in one write.
            assert j.status.placement[0].units == 2 and j.status.last_decision.quota == 1.0
            assert "cpu0 on node-1 1 -> 2 cores, live" in j.status.last_decision.reason
            assert j.status.last_decision.policy == "grow-once"
            # The steps measured at 1 core are forgotten with the decision (0 = none yet):
            # `tessera get` shows no 1-core median beside the 2-core estimate.
            i = next(i for i, x in enumerate(seen) if x.status.last_decision.action == "repartition")
            assert seen[i].status.step_time_s == seen[i].status.step_time_median_s == 0.0, seen[i].status
            assert any(x.status.step_time_median_s > 0 for x in seen[:i])
            ls = await nodes.ListNodes(cpb.ListNodesRequest())
            assert ls.nodes[0].partitions[0].allocated_units == 2
            # Carried out live: the same process, now on both cores (every thread).
            ex = await eventually(lambda: _executor_units(stub, a, 2), 30, "a's executor at 2 units")
            assert ex.pid == pid and len(cpus(pid)) == 2 and all(len(t) == 2 for t in thread_cpus(pid))
        final = await watch_until(jobs, a, ended, seen=seen)
    st = final.status
    assert st.phase == tpb.SUCCEEDED, st.reason
    assert st.step == 400 and st.loss < st.first_loss
    # Never restarted: one allocation, one placement.
    assert st.attempts == 1 and st.preemptions == 0
    assert {x.status.allocation_id for x in seen if x.status.allocation_id} == {st.allocation_id}


MM = {"mode": "disaggregated", "micro_batches": 2, "image": {"size": 16, "patch": 8, "pool": 2},
      "encoder": {"layers": 1, "hidden": 32, "heads": 2}, "data": {"max_images": 3, "min_text": 8, "max_text": 30},
      "mix": [{"step": 0, "image_prob": 0.2}, {"step": 20, "image_prob": 0.9}],
      "disaggregated": {"encoder_ranks": "auto", "adaptive": True}}


class ReshardOnce:
    """Tessera, plus one scripted reshard: the 3-rank multimodal job past step 8 goes from
    1:2 to 2:1 encoder:LLM ranks. Scripted so that the decision comes at a known step
    (the measured ``JobView.encoder_share`` never makes a 2-rank job reshard: 1:1 is its
    only split); under test is the controller carrying the decision out."""

    name = "reshard-once"

    def __init__(self) -> None:
        self.inner = TesseraPolicy()
        self.sent = False

    def schedule(self, request):
        reply = self.inner.schedule(request)
        rs = list(reply.reshards)
        for r in request.running:
            if not self.sent and r.job.workload == "multimodal" and r.job.done_iterations >= 8:
                rs.append(Reshard(r.job.job_id, 1, 1, 15.0, "scripted: encoder share 0.50: split auto -> 1:1"))
                self.sent = True
        return ScheduleReply(placements=reply.placements, infeasible=reply.infeasible, resizes=reply.resizes,
                             preemptions=reply.preemptions, reshards=tuple(rs))


async def test_controller_reshards_multimodal_job_by_checkpoint_and_relaunch(live, monkeypatch):
    monkeypatch.setitem(cmain.POLICIES, "reshard-once", ReshardOnce)
    mm = manifest.to_proto(manifest.validate({
        "apiVersion": "tessera/v1", "name": "mm", "tenant": "it",
        "workload": {"type": "multimodal", "model": {"vocab": 64, "seq_len": 48, "layers": 1, "hidden": 32, "heads": 2},
                     "steps": 120, "batch_size": 6, "learning_rate": 0.01, "seed": 0, "checkpoint_every": 4,
                     "multimodal": MM},
        "resources": {"devices": 2, "device_kind": "cpu"},
    }))
    seen: list[tpb.Job] = []
    async with live(policy="reshard-once", prefix="/rsh", cpu_devices=2, stop_grace_s=5) as (jobs, _, acfg):
        r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=mm))
        final = await watch_until(jobs, r.job.id, ended, timeout=120, seen=seen)
    st = final.status
    assert st.phase == tpb.SUCCEEDED, st.reason
    assert st.step == 120 and st.loss < st.first_loss
    # Persisted with the decision, carried out by one checkpoint-and-relaunch.
    assert st.encoder_ranks == 1
    # The runtime's per-module times reached the controller (PROGRESS ``modules``) and were
    # folded into the measured encoder share the live policy reads.
    assert 0.0 < st.encoder_share < 1.0
    assert st.last_decision.action == "reshard" and "encoder:LLM ranks 1:1" in st.last_decision.reason
    assert st.attempts == 2 and st.preemptions == 1
    assert any(h.phase == tpb.SCHEDULED and h.reason.startswith("reshard: checkpoint and relaunch") for h in st.history)
    # The relaunched ranks ran under the new split (their runtime spec) ...
    specs = Path(acfg.state_dir) / "specs"
    new = [json.loads((specs / f"{st.allocation_id}-r{k}.json").read_text()) for k in range(2)]
    assert all(s["workload"]["multimodal"]["disaggregated"]["encoder_ranks"] == 1 for s in new)
    first = next(x.status.allocation_id for x in seen if x.status.allocation_id)
    old = json.loads((specs / f"{first}-r0.json").read_text())
    assert old["workload"]["multimodal"]["disaggregated"]["encoder_ranks"] == "auto"
    # The runtime reported the pinned disjoint layout after the relaunch (its log).
    log = (Path(acfg.state_dir) / "logs" / f"{final.id}.log").read_text()
    assert '"layout": "1:1"' in log.split('"resumed_from": ')[-1]
    # ... and resumed from the checkpoint: no step before it was reported again.
    before = [x.status.step for x in seen if x.status.allocation_id == first and x.status.step]
    after = [x.status.step for x in seen if x.status.allocation_id not in ("", first) and x.status.step]
    assert before and max(before) >= 8
    assert after and min(after) > 4
