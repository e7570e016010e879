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
