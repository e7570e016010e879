"""Partitions wired end to end: a real agent reports its CPU core-set partitions, the
controller's allocations name a partition and a quota, the agent grants it (the executor
runs on exactly its cores) and refuses a launch beyond the partition's capacity with the
reason. Real etcd, real gRPC on loopback, real executor subprocesses."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from _live import eventually, watch_until

from tessera import manifest
from tessera.api.v1 import agent_pb2, agent_pb2_grpc
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import controller_pb2_grpc as cgrpc
from tessera.api.v1 import types_pb2 as tpb

TINY = {"vocab": 64, "seq_len": 16, "layers": 1, "hidden": 32, "heads": 2}

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for a 2-core partition")


def spec(name: str, steps: int, share: float | None = None) -> tpb.JobSpec:
    res = {"devices": 1, "device_kind": "cpu"}
    if share is not None:
        res["share"] = share
    return manifest.to_proto(manifest.validate({
        "apiVersion": "tessera/v1", "name": name, "tenant": "it",
        "workload": {"type": "gpt", "model": TINY, "steps": steps, "batch_size": 4, "learning_rate": 0.01,
                     "checkpoint_every": 10},
        "resources": res,
    }))


@pytest.fixture
async def one_node(live):
    """The controller (policy tessera) and one agent with one 2-core partition."""
    async with live(policy="tessera", prefix="/wiring", grace_s=3.0, stop_grace_s=3, ready_timeout=30) as node:
        yield node


def _proc_status(pid: int, key: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith(key + ":"))


def _proc_env(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x]
    return {k.decode(): v.decode() for k, v in items}


async def test_partitions_reported_quota_applied_and_overcapacity_refused(one_node):
    jobs, nodes, cfg = one_node
    ls = await nodes.ListNodes(cpb.ListNodesRequest())
    (node,) = ls.nodes
    (part,) = node.partitions
    assert (part.id, part.kind, part.device_id, part.capacity_units, part.unit) == ("cpu0", "cpuset", "cpu0", 2, "cores")

    r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec("quota", 100000, share=0.5)))
    job = await watch_until(jobs, r.job.id, lambda j: j.status.phase == tpb.RUNNING and j.status.step > 0)
    (shard,) = job.status.placement
    assert list(shard.partition_ids) == ["cpu0"] and shard.units == 1  # half of 2 cores
    assert job.status.last_decision.action == "pack" and job.status.last_decision.policy == "tessera"

    async with grpc.aio.insecure_channel(cfg.listen) as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        st = await stub.GetStatus(agent_pb2.GetStatusRequest())
        (ex,) = [e for e in st.executors if e.running]
        assert (ex.partition_id, ex.units) == ("cpu0", 1)
        (p,) = st.partitions
        assert p.free_units == 1
        # The quota is applied to the process: one core, one thread.
        assert len(_proc_status(ex.pid, "Cpus_allowed_list").replace("-", ",").split(",")) == 1
        assert _proc_env(ex.pid)["OMP_NUM_THREADS"] == "1"

        # The agent's own check: a launch asking the whole partition while one core is held.
        ls = await nodes.ListNodes(cpb.ListNodesRequest())
        assert ls.nodes[0].partitions[0].allocated_units == 1
        req = agent_pb2.LaunchExecutorRequest(
            allocation_id="a-intruder", job_id="j-intruder", fencing_token=10**12, incarnation=ls.nodes[0].incarnation,
            rank=0, world_size=1, device_ids=["cpu0"], partition_id="cpu0", units=2,
            runtime_spec_json='{"workload": {"type": "gpt"}}')
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LaunchExecutor(req)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "partition cpu0 (cpuset): asked 2 cores" in e.value.details()
        assert "only 1 of 2 cores are free" in e.value.details() and job.status.allocation_id in e.value.details()
        req.partition_id = "cpu9"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LaunchExecutor(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "partition_id" in e.value.details()
        st = await stub.GetStatus(agent_pb2.GetStatusRequest())
        assert [e.job_id for e in st.executors if e.running] == [r.job.id] and st.partitions[0].free_units == 1

    await jobs.CancelJob(cpb.CancelJobRequest(job_id=r.job.id))
    # Released on stop: the agent's partition is whole again, and the controller's.
    async def released():
        p = (await nodes.ListNodes(cpb.ListNodesRequest())).nodes[0].partitions[0]
        return p.allocated_units == 0 and p.free_units == 2

    await eventually(released, 30, "partition released", interval=0.1)


async def test_controller_never_allocates_a_partition_beyond_capacity(one_node):
    """Three half-partition jobs of equal length on one 2-core partition: two run packed,
    the third waits with the reason (no preemption: equal remaining work), and is packed
    in once one of the others is cancelled."""
    jobs, nodes, _ = one_node
    ids = []
    for i in range(3):
        r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(f"cap-{i}", 100000, share=0.5)))
        ids.append(r.job.id)
        await watch_until(jobs, r.job.id, lambda j: j.status.last_decision.action != "")
    third = await jobs.GetJob(cpb.GetJobRequest(job_id=ids[2]))
    assert third.status.phase == tpb.PENDING
    assert third.status.last_decision.action == "wait" and "waiting" in third.status.last_decision.reason
    ls = await nodes.ListNodes(cpb.ListNodesRequest())
    assert ls.nodes[0].partitions[0].allocated_units == 2
    await jobs.CancelJob(cpb.CancelJobRequest(job_id=ids[0]))
    third = await watch_until(jobs, ids[2], lambda j: j.status.phase == tpb.RUNNING)
    assert third.status.last_decision.action == "pack" and third.status.placement[0].units == 1
    ls = await nodes.ListNodes(cpb.ListNodesRequest())
    assert ls.nodes[0].partitions[0].allocated_units == 2
    for j in ids[1:]:
        await jobs.CancelJob(cpb.CancelJobRequest(job_id=j))


async def test_register_with_bad_partition_is_refused_and_writes_nothing(controller):
    async with grpc.aio.insecure_channel(controller.listen) as ch:
        nodes = cgrpc.NodeServiceStub(ch)
        dev = tpb.Device(id="cpu0", kind="cpu", model="x", capacity=2, cores=[0, 1])
        bad = [
            (tpb.Partition(id="cpu0", kind="cpuset", device_id="gpu7", capacity_units=2, unit="cores"), "partitions[0].device_id"),
            (tpb.Partition(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=0, unit="cores"), "partitions[0].capacity_units"),
            (tpb.Partition(id="", kind="cpuset", device_id="cpu0", capacity_units=2, unit="cores"), "partitions[0].id"),
        ]
        for p, field in bad:
            async with asyncio.timeout(20):
                while True:  # the controller may still be campaigning: UNAVAILABLE until it leads
                    try:
                        await nodes.RegisterNode(cpb.RegisterNodeRequest(
                            name="bad-node", agent_address="127.0.0.1:1", devices=[dev], partitions=[p]))
                        raise AssertionError("registration should be refused")
                    except grpc.aio.AioRpcError as e:
                        if e.code() == grpc.StatusCode.UNAVAILABLE:
                            await asyncio.sleep(0.05)
                            continue
                        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.details(), e.details()
                        break
        ls = await nodes.ListNodes(cpb.ListNodesRequest())
        assert [n.name for n in ls.nodes] == []
