"""Typed daemon configuration with precedence flag > environment > file > default.

Each daemon declares one frozen dataclass; ``load(cls, argv, env_prefix)`` builds an
argparse parser from its fields (``field(metadata={"help": ...})``), reads the YAML
file named by ``--config`` (or ``<PREFIX>CONFIG``), then the environment variables
``<PREFIX><FIELD>`` (upper case), then the flags. Unknown file keys and values of the
wrong type are errors naming the key, raised as ``SpecError``; so are a config file that
cannot be read or is not valid YAML (naming the file), and a float that is not finite
(``nan``, ``inf``) from any source.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from .errors import SpecError

T = TypeVar("T")


def _coerce(name: str, typ: Any, raw: Any) -> Any:
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        s = str(raw).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off", ""):
            return False
        raise SpecError(name, f"expected a boolean, got {raw!r}")
    if typ in (int, float, str):
        try:
            if typ is int and isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            v = typ(raw)
        except (TypeError, ValueError, OverflowError):
            raise SpecError(name, f"expected {typ.__name__}, got {raw!r}") from None
        if typ is float and not math.isfinite(v):
            raise SpecError(name, f"expected a finite number, got {raw!r}")
        return v
    return raw


def load(cls: type[T], argv: list[str] | None, env_prefix: str, description: str = "") -> T:
    """Build ``cls`` from defaults, file, environment and flags (in rising precedence)."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", help=f"YAML config file (env {env_prefix}CONFIG)")
    for f in fields:
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "") + f" (env {env_prefix}{f.name.upper()})"
        if hints[f.name] is bool:
            ap.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_)
        else:
            ap.add_argument(flag, dest=f.name, default=None, help=help_)
    ns = ap.parse_args(argv)

    values: dict[str, Any] = {}
    cfg_path = ns.config or os.environ.get(env_prefix + "CONFIG")
    if cfg_path:
        try:
            data = yaml.safe_load(Path(cfg_path).read_text(encoding="utf-8")) or {}
        except OSError as e:
            raise SpecError(cfg_path, f"cannot read config file: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise SpecError(cfg_path, "config file is not UTF-8 text") from None
        except yaml.YAMLError as e:
            raise SpecError(cfg_path, f"config file is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise SpecError(cfg_path, "config file must be a mapping")
        names = {f.name for f in fields}
        for k, v in data.items():
            key = str(k).replace("-", "_")
            if key not in names:
                raise SpecError(str(k), f"unknown config key in {cfg_path}")
            values[key] = _coerce(str(k), hints[key], v)
    for f in fields:
        env = os.environ.get(env_prefix + f.name.upper())
        if env is not None:
            values[f.name] = _coerce(env_prefix + f.name.upper(), hints[f.name], env)
        flag_val = getattr(ns, f.name)
        if flag_val is not None:
            values[f.name] = _coerce("--" + f.name.replace("_", "-"), hints[f.name], flag_val)
    return cls(**values)
