"""Values from a --config YAML file must already have their field's type (tessera.config):
before the fix ``null`` became the string "None", a list or mapping its repr, and a boolean
the number 1 or 0. Environment and flag strings are still converted."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tessera import config
from tessera.errors import SpecError


@dataclass(frozen=True)
class Cfg:
    name: str = "n"
    count: int = 1
    grace_s: float = 1.0
    debug: bool = False


@pytest.mark.parametrize("line, key", [
    ("name: null", "name"),
    ("name: [a, b]", "name"),
    ("name: {x: 1}", "name"),
    ("name: 123", "name"),
    ("count: true", "count"),
    ("count: '3'", "count"),
    ("count: 1.5", "count"),
    ("count: 4.0", "count"),
    ("count: null", "count"),
    ("grace_s: false", "grace_s"),
    ("grace_s: 'abc'", "grace_s"),
    ("grace_s: '1e999'", "grace_s"),
    ("grace_s: [1]", "grace_s"),
    ("debug: 1", "debug"),
    ("debug: 'yes'", "debug"),
    ("debug: null", "debug"),
])
def test_a_file_value_of_the_wrong_type_is_refused_naming_the_key(tmp_path, line, key):
    f = tmp_path / "c.yaml"
    f.write_text(line + "\n")
    with pytest.raises(SpecError) as e:
        config.load(Cfg, ["--config", str(f)], "T_")
    assert e.value.field == key and e.value.message.startswith("expected "), str(e.value)


def test_file_values_of_the_right_type_load(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: x\ncount: 3\ngrace_s: 2\ndebug: true\n")
    assert config.load(Cfg, ["--config", str(f)], "T_") == Cfg(name="x", count=3, grace_s=2.0, debug=True)
    f.write_text("grace_s: 2.5\n")
    assert config.load(Cfg, ["--config", str(f)], "T_").grace_s == 2.5


def test_environment_and_flag_strings_are_still_converted(tmp_path, monkeypatch):
    monkeypatch.setenv("T_COUNT", "7")
    monkeypatch.setenv("T_DEBUG", "yes")
    cfg = config.load(Cfg, ["--grace-s", "0.5", "--name", "123"], "T_")
    assert cfg == Cfg(name="123", count=7, grace_s=0.5, debug=True)


def test_sources_say_where_each_value_came_from(tmp_path, monkeypatch):
    f = tmp_path / "c.yaml"
    f.write_text("name: x\ncount: 2\n")
    monkeypatch.setenv("T_COUNT", "3")
    src: dict[str, str] = {}
    config.load(Cfg, ["--config", str(f), "--grace-s", "2"], "T_", sources=src)
    assert src == {"name": "name", "count": "T_COUNT", "grace_s": "--grace-s"}


@pytest.mark.parametrize("text, value", [("5e-1", 0.5), ("1e3", 1000.0), ("6e5", 600000.0), ("-2E-2", -0.02)])
def test_a_float_in_scientific_notation_without_a_dot_loads(tmp_path, text, value):
    """PyYAML (YAML 1.1) loads ``5e-1`` as the string "5e-1"; a float field accepts a file
    string that float() parses to a finite number (refusing it was a regression)."""
    f = tmp_path / "c.yaml"
    f.write_text(f"grace_s: {text}\n")
    assert config.load(Cfg, ["--config", str(f)], "T_").grace_s == value


def test_controller_config_file_accepts_scientific_notation(tmp_path):
    from controller.config import ControllerConfig

    f = tmp_path / "c.yaml"
    f.write_text("heartbeat_interval_s: 5e-1\nfinished_job_ttl_s: 6e5\n")
    cfg = config.load(ControllerConfig, ["--config", str(f)], "TESSERA_CONTROLLER_X_")
    assert (cfg.heartbeat_interval_s, cfg.finished_job_ttl_s) == (0.5, 600000.0)


@pytest.mark.parametrize("text, key", [("count: 5\ncount: 500\n", "count"), ("name: a\ndebug: true\nname: b\n", "name")])
def test_a_key_repeated_in_the_config_file_is_refused_naming_it(tmp_path, text, key):
    """As in manifests (tessera.yamlutil): never silently last-wins."""
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(SpecError) as e:
        config.load(Cfg, ["--config", str(f)], "T_")
    assert e.value.field == key and "duplicate key" in e.value.message and str(f) in e.value.message
