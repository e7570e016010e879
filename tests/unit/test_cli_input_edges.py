"""CLI and controller-config input edges: `tessera up`/`demo` counts and grace period as
usage errors (exit 2, nothing started), the controller's durations and counts, and the
unspecified job phase refused by `tessera list --phase`."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from controller.config import ControllerConfig
from tessera.api.v1 import types_pb2
from tessera.cli import build_parser, main
from tessera.client import parse_phase
from tessera.errors import SpecError


# --- (testbed usage) -----------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["up", "demo"])
@pytest.mark.parametrize("flag,value", [
    ("--agents", "0"), ("--agents", "-1"), ("--agents", "x"),
    ("--cpu-devices", "0"), ("--cpu-devices", "1.5"),
    ("--grace-s", "-5"), ("--grace-s", "0"), ("--grace-s", "nan"), ("--grace-s", "inf"),
])
def test_up_and_demo_refuse_bad_counts_and_grace_as_usage_errors(cmd, flag, value, capsys):
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args([cmd, flag, value])
    assert ei.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["up", "demo"])
def test_up_and_demo_take_good_counts_and_grace(cmd):
    a = build_parser().parse_args([cmd, "--agents", "3", "--cpu-devices", "1", "--grace-s", "2.5"])
    assert (a.agents, a.cpu_devices, a.grace_s) == (3, 1, 2.5)


def test_tessera_up_agents_0_exits_2_starting_nothing(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tessera.cli", "up", "--dir", str(tmp_path / "tb"), "--agents", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "--agents" in r.stderr
    assert not (tmp_path / "tb").exists()


def test_testbed_up_refuses_a_bad_grace_before_starting(tmp_path):
    from tessera.testbed import Testbed, TestbedError
    for g in (0, -5.0, math.nan, math.inf):
        with pytest.raises(TestbedError, match="--grace-s"):
            Testbed(tmp_path / "tb").up(grace_s=g)
    assert not (tmp_path / "tb" / "testbed.json").exists()


@pytest.mark.parametrize("name", ["grace_s", "heartbeat_interval_s", "reconcile_interval_s"])
@pytest.mark.parametrize("value", [0, -5.0, math.nan, math.inf, True, "1"])
def test_controller_config_refuses_non_positive_durations(name, value):
    with pytest.raises(SpecError) as ei:
        ControllerConfig(**{name: value})
    assert ei.value.field == name


@pytest.mark.parametrize("name", ["lease_ttl_s", "max_attempts"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3"])
def test_controller_config_refuses_counts_below_1(name, value):
    with pytest.raises(SpecError) as ei:
        ControllerConfig(**{name: value})
    assert ei.value.field == name


def test_controller_config_defaults_and_small_positive_values_pass():
    ControllerConfig()
    ControllerConfig(grace_s=0.5, heartbeat_interval_s=0.1, reconcile_interval_s=0.1, lease_ttl_s=1, max_attempts=1)


# --- (phase) -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["job_phase_unspecified", "JOB_PHASE_UNSPECIFIED"])
def test_parse_phase_refuses_the_unspecified_phase(name):
    with pytest.raises(ValueError, match="unknown phase"):
        parse_phase(name)


def test_parse_phase_still_takes_every_real_phase():
    for n, v in types_pb2.JobPhase.items():
        if v:
            assert parse_phase(n.lower()) == v


def test_cli_list_with_the_unspecified_phase_is_a_usage_error(capsys):
    def no_client(addr):  # pragma: no cover - must not be reached
        raise AssertionError("a server was contacted")
    rc = main(["list", "--phase", "job_phase_unspecified", "--controller", "127.0.0.1:1"], client_factory=no_client)
    assert rc == 2
    assert "--phase" in capsys.readouterr().err
