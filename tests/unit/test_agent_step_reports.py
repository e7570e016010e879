"""The agent's step measurements to profilerd are best effort but never silent: with
profilerd unreachable they are counted and the outage is logged once (not per step);
once profilerd takes them again the agent logs how many were lost. Real gRPC over
loopback: first a port nobody listens on, then a real profilerd servicer there."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from agent.config import AgentConfig
from agent.executors import Executor
from agent.main import Agent
from profilerd.config import ProfilerdConfig
from profilerd.main import SERVICE, Profilerd
from tessera import grpcserver
from tessera.etcdproc import free_port


async def test_steps_profilerd_does_not_take_are_counted_and_the_outage_logged_once(tmp_path):
    port = free_port()
    agent = Agent(AgentConfig(name="n1", state_dir=str(tmp_path / "agent"), profilerd=f"127.0.0.1:{port}",
                              disable_nvml=True))
    ex = Executor("a1", "j1", 0, [], tmp_path / "j.log")
    ex.labels = {"module": "gpt:x", "threads": "1"}
    step = {"event": "progress", "step": 1, "step_time_s": 0.01}
    try:
        with capture_logs() as logs:
            for i in range(3):
                await agent._on_step(ex, {**step, "step": i + 1})
        assert agent.steps_unreported == 3
        down = [e for e in logs if e["event"].startswith("step measurements not reaching profilerd")]
        assert len(down) == 1 and down[0]["job_id"] == "j1", logs

        core = Profilerd(ProfilerdConfig(node="n1", state_dir=str(tmp_path / "prof"), sample_interval_s=0),
                         samplers=[])
        running = await grpcserver.start(core.servicers(), [SERVICE], f"127.0.0.1:{port}")
        try:
            # The channel reconnects with gRPC's backoff: wait for it (a condition, bounded).
            await asyncio.wait_for(agent.prof_channel.channel_ready(), 30)
            with capture_logs() as logs:
                await agent._on_step(ex, {**step, "step": 4})
            assert agent.steps_unreported == 3 and len(core.buffer) == 1
            assert core.buffer.pending()[0].labels["colocated"] == "1"  # alone on its devices
            (back,) = [e for e in logs if e["event"] == "step measurements reach profilerd again"]
            assert back["lost"] == 3 and back["lost_total"] == 3
        finally:
            await running.stop(0)
    finally:
        await agent.prof_channel.close()
        await agent.channel.close()


async def test_an_agent_without_profilerd_counts_nothing(tmp_path):
    agent = Agent(AgentConfig(name="n1", state_dir=str(tmp_path / "agent"), disable_nvml=True))
    try:
        await agent._on_step(Executor("a1", "j1", 0, [], tmp_path / "j.log"),
                             {"event": "progress", "step": 1, "step_time_s": 0.01})
        assert agent.prof is None and agent.steps_unreported == 0
    finally:
        await agent.channel.close()


async def test_a_step_says_how_many_allocations_share_its_partition(tmp_path):
    """The ``colocated`` label of a step: allocations with a running executor on the
    executor's partition (its own ranks one allocation), or on its devices without a grant."""
    from agent.partitions.base import Grant

    agent = Agent(AgentConfig(name="n1", state_dir=str(tmp_path / "agent"), disable_nvml=True))
    mgr = agent.mgr

    def ex(alloc, rank, part, device="cpu0", exit_code=None):
        e = Executor(alloc, f"j-{alloc}", rank, [device], tmp_path / f"{alloc}.log", exit_code=exit_code)
        e.grant = Grant(f"{alloc}/{rank}", part, "cpuset", device, 1) if part else None
        mgr.executors[(alloc, rank)] = e
        return e

    a0, a1 = ex("a", 0, "cpu0"), ex("a", 1, "cpu0")        # one job's two ranks on one core set
    assert mgr.sharing(a0) == mgr.sharing(a1) == 1
    b = ex("b", 0, "cpu0")
    ex("c", 0, "cpu0", exit_code=0)                          # ended: no neighbour
    other = ex("d", 0, "cpu1", device="cpu1")                # another partition
    assert mgr.sharing(a0) == mgr.sharing(b) == 2 and mgr.sharing(other) == 1
    bare = ex("e", 0, "", device="cpu1")                    # no grant: whoever holds its device
    assert mgr.sharing(bare) == 2
    await agent.channel.close()
