"""User-facing docs state what the code does: the README's manifest, CLI options and limits,
and the shipped deploy configs (each loads through its daemon's config, policy the default)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from tessera import cli, config, manifest
from tessera.errors import SpecError
from tessera.spec import peft

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _defaults(name: str) -> dict[str, object]:
    return {opt: a.default for a in _subparser(name)._actions for opt in a.option_strings}


def test_readme_manifest_block_is_a_valid_manifest():
    block = README.split("### The manifest", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    # The workload-specific sections are placeholders ({...}) in the README.
    text = "\n".join(line for line in block.splitlines() if "{...}" not in line)
    doc = manifest.validate(yaml.safe_load(text))
    assert doc["resources"] == {"devices": 1, "device_kind": "cpu", "share": 0.5}


def test_readme_step_delay_range():
    assert "[0, 3600]" in README
    base = {"apiVersion": "tessera/v1", "name": "a", "workload": {"type": "gpt", "steps": 1}}
    for ok in (0, 3600):
        manifest.validate({**base, "workload": {**base["workload"], "step_delay_s": ok}})
    with pytest.raises(SpecError):
        manifest.validate({**base, "workload": {**base["workload"], "step_delay_s": 3600.5}})


@pytest.mark.parametrize("command,flag,default", [
    ("up", "--agents", 2), ("up", "--cpu-devices", 2), ("up", "--grace-s", 10.0), ("up", "--dir", ".tessera"),
    ("up", "--keep-state", False), ("up", "--start-timeout", 60.0), ("up", "--detach", False),
    ("demo", "--dir", ".tessera/demo"), ("demo", "--agents", 2), ("demo", "--cpu-devices", 2),
    ("demo", "--grace-s", 10.0), ("demo", "--timeout", 900.0), ("demo", "--keep", False),
    ("demo", "--examples", "examples"), ("list", "--tasks", False), ("cancel", "--reason", None),
])
def test_readme_cli_options_exist_with_their_stated_defaults(command, flag, default):
    assert flag in README
    d = _defaults(command)
    assert flag in d, f"tessera {command} has no {flag}"
    if default is not None:
        assert d[flag] == default


def test_readme_peft_limits_are_the_code_limits():
    assert peft.MAX_TASKS == 256 and peft.MAX_BATCH_SIZE == 65536
    assert "at most 256 tasks per job" in README and "1..65536" in README
    assert "at most 256 unfinished tasks" in README  # the fusion cap is the same constant
    from controller import fusion

    assert fusion.MAX_TASKS == peft.MAX_TASKS and fusion.MAX_TASK_NAME == 63


def test_readme_client_list_include_tasks_is_the_blocking_clients_only():
    import inspect

    from tessera.client import AsyncClient, Client

    assert "include_tasks" in inspect.signature(Client.list).parameters
    assert "include_tasks" not in inspect.signature(AsyncClient.list).parameters
    assert re.search(r"blocking `Client` also takes\s+`include_tasks=False`", README)


@pytest.mark.parametrize("daemon,module,cls,prefix", [
    ("controller", "controller.config", "ControllerConfig", "TESSERA_CONTROLLER_"),
    ("agent", "agent.config", "AgentConfig", "TESSERA_AGENT_"),
    ("profilerd", "profilerd.config", "ProfilerdConfig", "TESSERA_PROFILERD_"),
    ("estimator", "estimator.config", "EstimatorConfig", "TESSERA_ESTIMATOR_"),
])
def test_deploy_configs_load_and_their_keys_are_documented(daemon, module, cls, prefix, monkeypatch):
    import importlib

    for k in list(__import__("os").environ):
        if k.startswith(prefix):
            monkeypatch.delenv(k)
    path = ROOT / "deploy" / "config" / f"{daemon}.yaml"
    c = config.load(getattr(importlib.import_module(module), cls), ["--config", str(path)], prefix)
    keys = yaml.safe_load(path.read_text(encoding="utf-8"))
    deploy_readme = (ROOT / "deploy" / "README.md").read_text(encoding="utf-8")
    for key in keys:
        if key == "name":
            continue
        assert f"`{key}`" in deploy_readme, f"deploy/README.md does not explain {daemon}'s {key}"
    if daemon == "controller":
        assert c.policy == "tessera"  # the default, and what every doc describes
