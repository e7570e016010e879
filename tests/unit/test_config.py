"""Typed daemon config: flag > env > file > default, errors name the key."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tessera import config
from tessera.errors import SpecError


@dataclass(frozen=True)
class Cfg:
    listen: str = field(default="a:1", metadata={"help": "x"})
    grace_s: float = 10.0
    n: int = 1
    flag: bool = False


def test_precedence(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("listen: file:1\ngrace_s: 3\nn: 7\n")
    assert config.load(Cfg, ["--config", str(f)], "T_").listen == "file:1"
    monkeypatch.setenv("T_LISTEN", "env:1")
    monkeypatch.setenv("T_FLAG", "true")
    c = config.load(Cfg, ["--config", str(f)], "T_")
    assert (c.listen, c.grace_s, c.n, c.flag) == ("env:1", 3.0, 7, True)
    c = config.load(Cfg, ["--config", str(f), "--listen", "flag:1", "--n", "9"], "T_")
    assert (c.listen, c.n) == ("flag:1", 9)


def test_errors_name_the_key(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("nope: 1\n")
    with pytest.raises(SpecError) as e:
        config.load(Cfg, ["--config", str(f)], "T_")
    assert e.value.field == "nope"
    monkeypatch.setenv("T_N", "many")
    with pytest.raises(SpecError) as e:
        config.load(Cfg, [], "T_")
    assert e.value.field == "T_N"


def test_unreadable_or_invalid_config_file_is_a_spec_error_naming_it(tmp_path):
    missing = str(tmp_path / "nonexistent.yaml")
    with pytest.raises(SpecError) as e:
        config.load(Cfg, ["--config", missing], "T_")
    assert e.value.field == missing and "cannot read" in e.value.message
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [unclosed\n")
    with pytest.raises(SpecError) as e:
        config.load(Cfg, ["--config", str(bad)], "T_")
    assert e.value.field == str(bad) and "YAML" in e.value.message
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"listen: \xff\xfe\n")
    with pytest.raises(SpecError) as e:
        config.load(Cfg, ["--config", str(binary)], "T_")
    assert e.value.field == str(binary)
    d = tmp_path / "adir"
    d.mkdir()
    with pytest.raises(SpecError) as e:
        config.load(Cfg, ["--config", str(d)], "T_")
    assert e.value.field == str(d)


@pytest.mark.parametrize("src", ["file", "env", "flag"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", ".inf", ".nan"])
def test_float_fields_must_be_finite(tmp_path, monkeypatch, src, value):
    argv: list[str] = []
    if src == "file":
        f = tmp_path / "c.yaml"
        f.write_text(f"grace_s: {value}\n")
        argv = ["--config", str(f)]
    elif src == "env":
        monkeypatch.setenv("T_GRACE_S", value)
    else:
        argv = [f"--grace-s={value}"]
    if value.startswith(".") and src != "file":
        return  # YAML spellings: only the file parses them
    with pytest.raises(SpecError) as e:
        config.load(Cfg, argv, "T_")
    assert "finite" in e.value.message


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), float("-inf"), -1.0, "60", True])
def test_controller_finished_job_ttl_must_be_a_finite_number_at_least_zero(ttl):
    """Also for a config built in code (the loader's own finite check is not the only
    way in): NaN compared false against every age, i.e. kept finished jobs forever."""
    from controller.config import ControllerConfig

    with pytest.raises(SpecError) as e:
        ControllerConfig(finished_job_ttl_s=ttl)
    assert e.value.field == "finished_job_ttl_s" and "finite" in e.value.message
    assert ControllerConfig(finished_job_ttl_s=0).finished_job_ttl_s == 0
    assert ControllerConfig(finished_job_ttl_s=60).finished_job_ttl_s == 60


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_controller_finished_job_ttl_non_finite_is_refused_from_every_source(tmp_path, monkeypatch, value):
    from controller.config import ControllerConfig

    f = tmp_path / "c.yaml"
    f.write_text(f"finished_job_ttl_s: .{value}\n")
    for argv in (["--config", str(f)], [f"--finished-job-ttl-s={value}"]):
        with pytest.raises(SpecError) as e:
            config.load(ControllerConfig, argv, "TESSERA_CONTROLLER_")
        assert "finished" in e.value.field and "finite" in e.value.message
