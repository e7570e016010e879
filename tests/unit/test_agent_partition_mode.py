"""The agent's partition_mode setting: validated at start, precedence flag > env > file,
and an explicit mode that cannot apply to a device is an error naming the flag."""

from __future__ import annotations

import asyncio

import pytest

from agent.config import AgentConfig
from agent.main import Agent, main, serve
from tessera import config


def test_unknown_mode_is_refused(capsys):
    assert main(["--partition-mode", "bogus"]) == 2
    assert "--partition-mode" in capsys.readouterr().err


def test_precedence_flag_env_file(tmp_path, monkeypatch):
    f = tmp_path / "agent.yaml"
    f.write_text("partition_mode: timeslice\n")
    assert config.load(AgentConfig, ["--config", str(f)], "TESSERA_AGENT_").partition_mode == "timeslice"
    monkeypatch.setenv("TESSERA_AGENT_PARTITION_MODE", "cpuset")
    assert config.load(AgentConfig, ["--config", str(f)], "TESSERA_AGENT_").partition_mode == "cpuset"
    assert config.load(AgentConfig, ["--config", str(f), "--partition-mode", "auto"],
                       "TESSERA_AGENT_").partition_mode == "auto"


async def test_auto_on_cpu_is_cpuset(tmp_path):
    a = Agent(AgentConfig(name="n", cpu_devices=2, disable_nvml=True, state_dir=str(tmp_path)))
    assert [(p.kind, p.unit) for p in a.parts.describe()] == [("cpuset", "cores"), ("cpuset", "cores")]
    await a.channel.close()


def test_explicit_mode_that_cannot_apply_stops_the_agent(tmp_path):
    cfg = AgentConfig(name="n", cpu_devices=1, disable_nvml=True, partition_mode="mps", state_dir=str(tmp_path))
    with pytest.raises(SystemExit, match="--partition-mode: .*cpu0: mps partitions need an NVIDIA GPU"):
        asyncio.run(serve(cfg, asyncio.Event()))
