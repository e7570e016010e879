"""tessera-agent refuses settings out of range before serving (exit 2, naming the setting as
it was given: flag, environment variable or file key). Before the fix a negative
--stop-grace-s (every stop an immediate SIGKILL), a negative --report-interval-s and a
--fault-poll-s of 0 (the MPS fault watcher spinning) started the agent, and a value from
the environment was reported under the flag's name."""

from __future__ import annotations

import pytest

import agent.main as agent_main


@pytest.fixture
def served(monkeypatch):
    """The configs agent.main.main would have served (nothing is served)."""
    seen: list = []

    async def fake_serve(cfg, stop):
        seen.append(cfg)

    monkeypatch.setattr(agent_main, "serve", fake_serve)
    monkeypatch.setattr(agent_main.log, "setup", lambda *a, **k: None)
    return seen


@pytest.mark.parametrize("argv, named", [
    (["--stop-grace-s", "-5"], "--stop-grace-s: must be >= 0"),
    (["--report-interval-s", "-1"], "--report-interval-s: must be >= 0"),
    (["--fault-poll-s", "0"], "--fault-poll-s: must be > 0"),
    (["--fault-poll-s", "-1"], "--fault-poll-s: must be > 0"),
    (["--cpu-devices", "0"], "--cpu-devices: must be >= 1"),
    (["--timeslice-slots", "0"], "--timeslice-slots: must be >= 1"),
    (["--stall-timeout-s", "-1"], "--stall-timeout-s: must be >= 0"),
])
def test_a_setting_out_of_range_is_refused_naming_it(served, capsys, argv, named):
    assert agent_main.main(argv) == 2
    assert named in capsys.readouterr().err
    assert served == []


def test_a_value_from_the_environment_or_file_is_named_as_given(served, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_AGENT_CPU_DEVICES", "0")
    assert agent_main.main([]) == 2
    assert "TESSERA_AGENT_CPU_DEVICES: must be >= 1" in capsys.readouterr().err
    monkeypatch.delenv("TESSERA_AGENT_CPU_DEVICES")
    f = tmp_path / "agent.yaml"
    f.write_text("stop_grace_s: -2\n")
    assert agent_main.main(["--config", str(f)]) == 2
    assert "stop_grace_s: must be >= 0" in capsys.readouterr().err
    assert served == []


def test_zero_grace_and_interval_are_accepted(served, tmp_path):
    assert agent_main.main(["--stop-grace-s", "0", "--report-interval-s", "0", "--fault-poll-s", "0.1",
                            "--state-dir", str(tmp_path)]) == 0
    assert len(served) == 1 and served[0].stop_grace_s == 0.0
    assert served[0].stall_timeout_s == 600.0  # stalls are watched by default


def test_stall_watch_can_be_turned_off(served, tmp_path):
    assert agent_main.main(["--stall-timeout-s", "0", "--state-dir", str(tmp_path)]) == 0
    assert served[0].stall_timeout_s == 0.0


def test_the_executor_zygote_is_on_by_default_and_can_be_turned_off(served, tmp_path, monkeypatch):
    assert agent_main.main(["--state-dir", str(tmp_path)]) == 0
    assert served[-1].executor_zygote is True
    assert agent_main.main(["--no-executor-zygote", "--state-dir", str(tmp_path)]) == 0
    assert served[-1].executor_zygote is False
    monkeypatch.setenv("TESSERA_AGENT_EXECUTOR_ZYGOTE", "false")
    assert agent_main.main(["--state-dir", str(tmp_path)]) == 0
    assert served[-1].executor_zygote is False
