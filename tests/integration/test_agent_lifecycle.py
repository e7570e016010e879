"""The agent's own lifecycle against a real controller (real etcd, loopback gRPC, real
executor processes): executors it stops on its own decision (shutdown, self-fencing)
are reported ``stopped_by_agent`` and their job is requeued, not failed; the last exit
report reaches the controller before shutdown ends; a stop before registration is
honoured; a heartbeat error is not the end of heartbeats; a dead background task stops
the daemon (fail-stop); the self-fence ends within the controller's grace period."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import pytest

import agent.main as amain
from _live import eventually, wait_nodes_ready
from agent.config import AgentConfig
from agent.devices import discover
from agent.executors import ExecutorManager
from agent.main import fence_grace, heartbeat_timeout
from agent.main import serve as agent_serve
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import controller_pb2_grpc as cgrpc
from tessera.api.v1 import types_pb2 as tpb
from tessera.etcdproc import free_port
from test_agent_executors import job_spec


def agent_cfg(tmp_path: Path, controller: str, name: str = "node-1") -> AgentConfig:
    return AgentConfig(name=name, listen=f"127.0.0.1:{free_port()}", controller=controller, cpu_devices=1,
                       state_dir=str(tmp_path / name), stop_grace_s=3, report_interval_s=0.2)


# -- self-fence timing ----------------------------------------------------------------
def test_fence_ends_within_the_controllers_grace():
    # Silent for half the grace period: what is left of it, less the margin, caps the delay.
    assert fence_grace(10.0, 10.0, 5.0) == pytest.approx(10.0 - 5.0 - amain.FENCE_MARGIN_S)
    assert fence_grace(2.0, 30.0, 15.0) == 2.0          # stop_grace_s when it fits
    assert fence_grace(10.0, 3.0, 2.9) == 1.0            # never below 1 s
    for grace in (3.0, 5.0, 10.0, 60.0):
        silent = grace / 2 + 0.1
        assert silent + fence_grace(10.0, grace, silent) <= max(grace, silent + 1.0)


def test_heartbeat_timeout_is_a_quarter_of_the_grace():
    assert heartbeat_timeout(10.0) == 2.5
    assert heartbeat_timeout(2.0) == 1.0


# -- stopped_by_agent on the executors' exits -----------------------------------------
FAKE = """#!{python}
import time
print("ready", flush=True)
time.sleep(300)
"""


async def test_agent_stops_are_marked_controller_stops_are_not(tmp_path):
    rt = tmp_path / "fake-python"
    rt.write_text(FAKE.format(python=sys.executable))
    rt.chmod(0o755)
    exits: dict[str, dict] = {}

    async def on_report(ex, r):
        if r["kind"] == "EXITED":
            exits[ex.allocation_id] = r

    mgr = ExecutorManager(tmp_path / "st", discover(1, use_nvml=False), on_report, python=str(rt))
    launch = dict(job_id="j", rank=0, world_size=1, master_addr="127.0.0.1", master_port=1,
                  runtime_spec={"workload": {"type": "gpt"}}, checkpoint_dir="", device_ids=["cpu0"])
    await mgr.launch(allocation_id="a-ctl", **launch)
    await mgr.stop("a-ctl", 2.0)  # what StopExecutor (the controller) does
    await mgr.launch(allocation_id="a-agent", **{**launch, "job_id": "j2"})
    await mgr.stop_all(2.0)       # the agent's shutdown / self-fence
    await eventually(lambda: len(exits) == 2, 10, "both exits reported")
    assert exits["a-ctl"]["exit_code"] == 143 and not exits["a-ctl"]["stopped_by_agent"]
    assert exits["a-agent"]["exit_code"] == 143 and exits["a-agent"]["stopped_by_agent"]


# -- live ---------------------------------------------------------------------------
async def test_graceful_shutdown_requeues_the_job_with_its_exit_delivered(controller, tmp_path):
    cfg = agent_cfg(tmp_path, controller.listen)
    stop = asyncio.Event()
    task = asyncio.create_task(agent_serve(cfg, stop))
    async with grpc.aio.insecure_channel(controller.listen) as ch:
        jobs, nodes = cgrpc.JobServiceStub(ch), cgrpc.NodeServiceStub(ch)
        await wait_nodes_ready(nodes, 1)
        jid = (await jobs.SubmitJob(cpb.SubmitJobRequest(spec=job_spec("long", steps=100000)))).job.id

        async def running():
            j = await jobs.GetJob(cpb.GetJobRequest(job_id=jid))
            return j.status.phase == tpb.RUNNING and j.status.step > 2

        await eventually(running, 180, "job running")
        stop.set()
        await asyncio.wait_for(task, 30)
        # The exit report was delivered before serve returned (the drain): the controller
        # has requeued the job already, as the agent's stop, long before it would find the
        # node lost (grace 3 s) -- and not FAILED (exit 143 of a crash).
        j = await jobs.GetJob(cpb.GetJobRequest(job_id=jid))
        assert j.status.phase == tpb.PENDING, (tpb.JobPhase.Name(j.status.phase), j.status.reason)
        assert "stopped by the agent" in j.status.reason
        assert j.status.preemptions == 1


async def test_stop_before_registration_is_honoured(tmp_path):
    cfg = agent_cfg(tmp_path, f"127.0.0.1:{free_port()}")  # nobody listens there
    stop = asyncio.Event()
    task = asyncio.create_task(agent_serve(cfg, stop))
    await asyncio.sleep(1.0)
    stop.set()
    try:
        await asyncio.wait_for(task, 8)
    finally:
        task.cancel()


async def test_heartbeat_error_does_not_end_heartbeats(controller, tmp_path, monkeypatch):
    real, real_register, calls, registered = amain.partitions_proto, amain.Agent.register, [], []

    async def register(self):
        await real_register(self)
        registered.append(1)

    def flaky(parts):
        if registered:
            calls.append(1)
            if len(calls) == 1:  # the first heartbeat round fails
                raise RuntimeError("injected")
        return real(parts)

    monkeypatch.setattr(amain.Agent, "register", register)
    monkeypatch.setattr(amain, "partitions_proto", flaky)
    cfg = agent_cfg(tmp_path, controller.listen)
    stop = asyncio.Event()
    task = asyncio.create_task(agent_serve(cfg, stop))
    try:
        async with grpc.aio.insecure_channel(controller.listen) as ch:
            nodes = cgrpc.NodeServiceStub(ch)
            await wait_nodes_ready(nodes, 1)
            await eventually(lambda: len(calls) >= 4, 10, "heartbeats go on after the error")
            await asyncio.sleep(controller.grace_s + 1)
            ls = await nodes.ListNodes(cpb.ListNodesRequest())
            assert [n.state for n in ls.nodes] == [tpb.READY]
            assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_dead_background_task_stops_the_agent(controller, tmp_path, monkeypatch):
    async def broken(self):
        await asyncio.sleep(0.2)
        raise RuntimeError("injected fault-watcher bug")

    monkeypatch.setattr(amain.Agent, "watch_faults", broken)
    cfg = agent_cfg(tmp_path, controller.listen)

    async def run():  # a SystemExit out of a task would end the event loop itself
        try:
            await agent_serve(cfg, asyncio.Event())
        except SystemExit as e:
            return e

    task = asyncio.create_task(run())
    try:
        e = await asyncio.wait_for(task, 20)
    finally:
        task.cancel()
    assert isinstance(e, SystemExit) and "fault watcher died" in str(e)
