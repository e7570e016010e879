"""Typed daemon configuration with precedence flag > environment > file > default.

Each daemon declares one frozen dataclass; ``load(cls, argv, env_prefix)`` builds an
argparse parser from its fields (``field(metadata={"help": ...})``), reads the YAML
file named by ``--config`` (or ``<PREFIX>CONFIG``), then the environment variables
``<PREFIX><FIELD>`` (upper case), then the flags. Unknown file keys and values of the
wrong type are errors naming the key, raised as ``SpecError``: a file value must already
have its field's type (YAML ``null``, a list or a mapping is no string, ``true`` no
number; a float field also takes a string float() parses, as PyYAML loads ``5e-1``), while
environment and flag strings are converted; so are a key repeated in the file
("duplicate key", naming it, as in manifests: ``tessera.yamlutil``), a config file that
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

from . import yamlutil
from .errors import SpecError

T = TypeVar("T")


def _finite_float_str(raw: Any) -> bool:
    """True when ``raw`` is a string that ``float()`` parses to a finite number."""
    if not isinstance(raw, str):
        return False
    try:
        return math.isfinite(float(raw))
    except (ValueError, OverflowError):
        return False


def _file_type_problem(typ: Any, raw: Any) -> str | None:
    """Why a value parsed from the YAML config file is not of field type ``typ``, or None:
    a file value must already be of its type (a str for str, an int but not a bool for
    int, an int or float but not a bool for float, a bool for bool); only the strings of
    the environment and flags are converted. One exception: for float, a string that
    ``float()`` parses to a finite number is accepted, because PyYAML (YAML 1.1) loads
    scientific notation without a dot (``5e-1``, ``1e3``) as a string. Null, booleans,
    lists and mappings are still refused."""
    if typ is bool:
        ok = isinstance(raw, bool)
    elif typ is int:
        ok = isinstance(raw, int) and not isinstance(raw, bool)
    elif typ is float:
        ok = (isinstance(raw, (int, float)) and not isinstance(raw, bool)) or _finite_float_str(raw)
    elif typ is str:
        ok = isinstance(raw, str)
    else:
        return None
    if ok:
        return None
    want = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string"}[typ]
    got = ("null" if raw is None else "a boolean" if isinstance(raw, bool) else "a list" if isinstance(raw, list)
           else "a mapping" if isinstance(raw, dict) else type(raw).__name__)
    return f"expected {want}, got {got} ({raw!r})"


def _coerce(name: str, typ: Any, raw: Any, from_file: bool = False) -> Any:
    """``raw`` as a value of field type ``typ``; SpecError naming ``name`` when it is none.
    ``from_file``: ``raw`` was parsed from the YAML file, and must already have the type
    (``_file_type_problem``); otherwise it is a string (environment, flag), converted."""
    if from_file:
        why = _file_type_problem(typ, raw)
        if why:
            raise SpecError(name, why)
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


def load(cls: type[T], argv: list[str] | None, env_prefix: str, description: str = "",
         sources: dict[str, str] | None = None) -> T:
    """Build ``cls`` from defaults, file, environment and flags (in rising precedence).
    ``sources``, when given, is filled with where each field's value came from, as a
    daemon's later range checks should name it: ``--flag-name``, ``<PREFIX>FIELD`` or the
    file's key (fields left at their default are absent)."""
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
            data = yamlutil.load_unique(Path(cfg_path).read_text(encoding="utf-8")) or {}
        except yamlutil.DuplicateKey as e:
            raise SpecError(e.path, f"duplicate key (line {e.line} of {cfg_path})") from None
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
            values[key] = _coerce(str(k), hints[key], v, from_file=True)
            if sources is not None:
                sources[key] = str(k)
    for f in fields:
        env = os.environ.get(env_prefix + f.name.upper())
        if env is not None:
            values[f.name] = _coerce(env_prefix + f.name.upper(), hints[f.name], env)
            if sources is not None:
                sources[f.name] = env_prefix + f.name.upper()
        flag_val = getattr(ns, f.name)
        if flag_val is not None:
            values[f.name] = _coerce("--" + f.name.replace("_", "-"), hints[f.name], flag_val)
            if sources is not None:
                sources[f.name] = "--" + f.name.replace("_", "-")
    return cls(**values)
