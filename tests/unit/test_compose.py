"""compose/ and deploy/ without Docker or systemd: the compose file is valid against the
vendored Compose Specification schema; every command it (or a systemd unit) runs is a
console script of pyproject.toml (or etcd) and its flags are accepted by that daemon's
typed config; the example configs load."""

from __future__ import annotations

import configparser
import importlib
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml

from tessera import config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
SCHEMA = ROOT / "compose" / "compose-spec.json"

# console script -> (config class, env prefix)
DAEMONS = {
    "tessera-controller": ("controller.config:ControllerConfig", "TESSERA_CONTROLLER_"),
    "tessera-agent": ("agent.config:AgentConfig", "TESSERA_AGENT_"),
    "tessera-profilerd": ("profilerd.config:ProfilerdConfig", "TESSERA_PROFILERD_"),
    "tessera-estimator": ("estimator.config:EstimatorConfig", "TESSERA_ESTIMATOR_"),
}


def scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def config_class(script: str):
    path, prefix = DAEMONS[script]
    mod, cls = path.split(":")
    try:
        return getattr(importlib.import_module(mod), cls), prefix
    except (ImportError, AttributeError) as e:
        pytest.skip(f"{script}'s config is not available yet: {e}")


@pytest.fixture(autouse=True)
def _no_tessera_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("TESSERA_"):
            monkeypatch.delenv(k)


def test_compose_file_is_valid_against_the_vendored_schema():
    schema = json.loads(SCHEMA.read_text())
    assert "draft-07" in schema["$schema"]
    jsonschema.Draft7Validator.check_schema(schema)
    v = jsonschema.Draft7Validator(schema)
    errors = sorted(v.iter_errors(compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # and the check is not vacuous: a typo in a service key is caught
    broken = compose()
    broken["services"]["controller"]["comand"] = ["x"]
    assert list(v.iter_errors(broken))


def test_schema_origin_is_noted():
    readme = (ROOT / "compose" / "README.md").read_text()
    assert "compose-spec/compose-spec" in readme and "170098ba07d9f53c383a41bfd4c5166b0a4529a6" in readme


def test_compose_has_the_testbed_services():
    svcs = compose()["services"]
    cmds = {name: s["command"][0] for name, s in svcs.items()}
    assert sorted(cmds.values()).count("tessera-agent") == 2
    assert sorted(cmds.values()).count("tessera-profilerd") == 2
    for daemon in ("etcd", "tessera-controller", "tessera-estimator"):
        assert daemon in cmds.values()
    agents = [s for s in svcs.values() if s["command"][0] == "tessera-agent"]
    assert all("--cpu-devices=2" in s["command"] for s in agents)


def _as_argv(cmd: list[str]) -> list[str]:
    return list(cmd[1:])


def test_compose_commands_are_console_scripts_with_accepted_flags():
    declared = scripts()
    for name, svc in compose()["services"].items():
        cmd = svc.get("command")
        assert isinstance(cmd, list) and cmd, f"{name}: command must be an exec-form list"
        if cmd[0] == "etcd":
            continue
        assert cmd[0] in declared, f"{name}: {cmd[0]} is not a console script of pyproject.toml"
        cls, prefix = config_class(cmd[0])
        try:
            config.load(cls, _as_argv(cmd), prefix)
        except SystemExit:
            pytest.fail(f"{name}: {cmd[0]} refuses its flags {cmd[1:]}")


def test_compose_addresses_point_at_services():
    svcs = compose()["services"]
    for name, svc in svcs.items():
        for arg in svc["command"]:
            m = re.match(r"--(controller|etcd|estimator|advertise)=([\w-]+):\d+$", arg)
            if m and m.group(2) not in ("127.0.0.1", "localhost"):
                assert m.group(2) in svcs, f"{name}: {arg} names no service"


def test_dockerfile_pins_the_same_torch_and_copies_existing_dirs():
    text = (ROOT / "compose" / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(d for d in deps if d.startswith("torch"))
    assert f"pip install {torch.replace(' ', '')} --index-url https://download.pytorch.org/whl/cpu" in text
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"


def test_every_volume_mount_point_is_made_in_the_image_for_the_daemon_user():
    """A named volume takes its mount point's owner from the image only when the image has
    that directory: each one a service mounts must be created (and chowned) before USER."""
    text = (ROOT / "compose" / "Dockerfile").read_text()
    made = text.split("USER tessera")[0]
    assert "chown -R tessera /var/lib/tessera" in made
    for name, svc in compose()["services"].items():
        for vol in svc.get("volumes", []):
            target = (vol.split(":")[1] if isinstance(vol, str) else vol["target"])
            if target.startswith("/var/lib/tessera/"):
                assert target in made, f"{name}: {target} is not created in the image"
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", ".tessera"} <= set(ignore)  # the build context stays small and local state stays out


def test_systemd_units_run_console_scripts():
    declared = scripts()
    units = sorted((ROOT / "deploy" / "systemd").glob("*.service"))
    assert {u.stem for u in units} == set(DAEMONS)
    for u in units:
        cp = configparser.ConfigParser(strict=False, interpolation=None)
        cp.optionxform = str
        cp.read(u)
        svc = cp["Service"]
        assert svc["Restart"] == "on-failure"
        assert svc["EnvironmentFile"].lstrip("-").startswith("/etc/tessera/")
        exe = Path(svc["ExecStart"].split()[0]).name
        assert exe == u.stem and exe in declared


@pytest.mark.parametrize("daemon", sorted(DAEMONS))
def test_deploy_example_configs_load(daemon):
    cls, prefix = config_class(daemon)
    path = ROOT / "deploy" / "config" / f"{daemon.removeprefix('tessera-')}.yaml"
    cfg = config.load(cls, ["--config", str(path)], prefix)
    assert cfg.listen
