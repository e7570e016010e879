"""The controller's deprecated ``state_dir``: accepted (old configs and command lines still
load), ignored with a warning, and no longer set by the testbed, compose or the examples."""

from __future__ import annotations

from pathlib import Path

import yaml

from controller.config import ControllerConfig
from tessera import config

ROOT = Path(__file__).resolve().parents[2]


def test_state_dir_still_loads_from_a_flag_and_defaults_to_unset():
    assert ControllerConfig().state_dir == ""
    cfg = config.load(ControllerConfig, ["--state-dir", "/var/lib/tessera/controller"], "TESSERA_CONTROLLER_", "")
    assert cfg.state_dir == "/var/lib/tessera/controller"


def test_no_shipped_configuration_sets_it():
    compose = yaml.safe_load((ROOT / "compose/docker-compose.yml").read_text())
    assert not any("state-dir" in str(a) for a in compose["services"]["controller"]["command"])
    assert "controller-state" not in (compose.get("volumes") or {})
    assert "state_dir" not in yaml.safe_load((ROOT / "deploy/config/controller.yaml").read_text())
    assert '"--state-dir", self._state("controller")' not in (ROOT / "tessera/testbed.py").read_text()
