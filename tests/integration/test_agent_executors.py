"""Controller + agents in-process, executors as real subprocesses running real PyTorch
training; real etcd, real gRPC on loopback."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from agent.config import AgentConfig
from agent.main import serve as agent_serve
from tessera import manifest
from tessera.api.v1 import agent_pb2, agent_pb2_grpc
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import controller_pb2_grpc as cgrpc
from tessera.api.v1 import types_pb2 as tpb
from tessera.ports import free_port

TINY = {"vocab": 64, "seq_len": 16, "layers": 1, "hidden": 32, "heads": 2}


def job_spec(name: str, steps: int = 30, devices: int = 1, **plan) -> tpb.JobSpec:
    p = {"dp": 1, "tp": 1, "pp": 1, "micro_batches": 1, **plan}
    return manifest.to_proto(manifest.validate({
        "apiVersion": "tessera/v1", "name": name, "tenant": "it",
        "workload": {"type": "gpt", "model": TINY, "steps": steps, "batch_size": 4, "learning_rate": 0.01,
                     "plan": p, "checkpoint_every": 10},
        "resources": {"devices": devices, "device_kind": "cpu"},
    }))


@pytest.fixture
async def cluster(controller, tmp_path):
    """The controller plus two agents (node-1, node-2), one CPU core set each."""
    stops, tasks, agents = [], [], []
    for i in (1, 2):
        cfg = AgentConfig(name=f"node-{i}", listen=f"127.0.0.1:{free_port()}", controller=controller.listen,
                          cpu_devices=1, state_dir=str(tmp_path / f"agent{i}"), stop_grace_s=3, report_interval_s=0.2)
        stop = asyncio.Event()
        stops.append(stop)
        agents.append(cfg)
        tasks.append(asyncio.create_task(agent_serve(cfg, stop)))
    ch = grpc.aio.insecure_channel(controller.listen)
    jobs, nodes = cgrpc.JobServiceStub(ch), cgrpc.NodeServiceStub(ch)
    for _ in range(400):
        try:
            ls = await nodes.ListNodes(cpb.ListNodesRequest())
            if len([n for n in ls.nodes if n.state == tpb.READY]) == 2:
                break
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("agents did not register")
    yield jobs, nodes, agents
    for s in stops:
        s.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await ch.close()


async def wait_phase(jobs, job_id: str, phases, timeout: float = 120.0) -> tpb.Job:
    """Follow the job's watch stream until it reaches one of ``phases``."""
    async with asyncio.timeout(timeout):
        async for ev in jobs.WatchJobs(cpb.WatchJobsRequest(job_id=job_id)):
            if ev.job.status.phase in phases:
                return ev.job
    raise AssertionError("watch ended")


async def test_job_runs_to_success_with_loss_falling(cluster):
    jobs, _, _ = cluster
    r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=job_spec("ok", steps=40)))
    job = await wait_phase(jobs, r.job.id, (tpb.SUCCEEDED, tpb.FAILED))
    assert job.status.phase == tpb.SUCCEEDED, job.status.reason
    phases = [h.phase for h in job.status.history]
    assert phases[:2] == [tpb.PENDING, tpb.SCHEDULED] and tpb.RUNNING in phases
    assert job.status.step == 40 and job.status.loss < job.status.first_loss
    assert job.status.placement and job.status.decision
    logs = await jobs.GetJobLogs(cpb.GetJobLogsRequest(job_id=r.job.id))
    assert "[rank 0]" in logs.text


async def test_two_rank_job_spans_both_agents(cluster):
    jobs, _, _ = cluster
    r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=job_spec("dp2", steps=20, devices=2, dp=2)))
    job = await wait_phase(jobs, r.job.id, (tpb.SUCCEEDED, tpb.FAILED))
    assert job.status.phase == tpb.SUCCEEDED, job.status.reason
    assert sorted(s.node for s in job.status.placement) == ["node-1", "node-2"]


async def test_cancel_stops_the_executor(cluster):
    jobs, _, agents = cluster
    r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=job_spec("long", steps=100000)))
    await wait_phase(jobs, r.job.id, (tpb.RUNNING,))
    c = await jobs.CancelJob(cpb.CancelJobRequest(job_id=r.job.id))
    assert c.status.phase == tpb.CANCELLED
    node = c.status.placement[0].node
    cfg = next(a for a in agents if a.name == node)
    async with grpc.aio.insecure_channel(cfg.listen) as ch:
        st = await agent_pb2_grpc.AgentServiceStub(ch).GetStatus(agent_pb2.GetStatusRequest())
    assert [e.running for e in st.executors if e.job_id == r.job.id] == [False]


async def test_agent_refuses_stale_token_and_oversubscription(cluster):
    jobs, nodes, agents = cluster
    r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=job_spec("hold", steps=100000)))
    job = await wait_phase(jobs, r.job.id, (tpb.RUNNING,))
    node = job.status.placement[0].node
    cfg = next(a for a in agents if a.name == node)
    ls = await nodes.ListNodes(cpb.ListNodesRequest())
    inc = next(n.incarnation for n in ls.nodes if n.name == node)
    async with grpc.aio.insecure_channel(cfg.listen) as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)
        req = agent_pb2.LaunchExecutorRequest(
            allocation_id="a-intruder", job_id="j-intruder", fencing_token=10**12, incarnation=inc, rank=0, world_size=1,
            device_ids=list(job.status.placement[0].device_ids), runtime_spec_json='{"workload": {"type": "gpt"}}')
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LaunchExecutor(req)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        req.fencing_token = 1  # older than the one just seen
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.LaunchExecutor(req)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await jobs.CancelJob(cpb.CancelJobRequest(job_id=r.job.id))
