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
