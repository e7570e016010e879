"""Validation of a job manifest's ``workload.peft`` section (multi-task LoRA).

Contract: ``validate_peft(section, path, defaults=None) -> dict`` is pure (no I/O, no
torch): it returns a new dict with every default filled in, or raises ``SpecError``
whose ``field`` is the exact dotted path at fault (``workload.peft.tasks[2].rank``).
Unknown fields are errors, so a typo never silently becomes a default. The function is
idempotent: its output validates to itself.

Section (defaults in brackets)::

    mode: spatial | temporal                 [spatial]
    chunk_size: int >= 2 | null              [null = model.seq_len]  tokens per packed chunk
    micro_batch_tokens: int >= 1             [512]  tokens per forward/backward within a step
                                             (whole chunks, at least one; bounds activation memory)
    tasks: non-empty list of at most MAX_TASKS (256), unique names, each:
      name: str (lower-case, digits, '-', '_'), required; not ``j-<12 hex>_...``
                                             (reserved: a task fused in from job j-... is
                                             named ``<job id>_<task>`` in the host's executor)
      rank: int >= 1, <= the model's hidden size when known   [8]
      alpha: number > 0                      [2 * rank]
      target_modules: non-empty list of qkv|proj|fc|out, no repeats   [[qkv, proj]]
      learning_rate: number > 0 | null       [null = workload.learning_rate]
      batch_size: 1..MAX_BATCH_SIZE (65536) | null   [null = workload.batch_size]  sequences per step
      steps: int >= 1 | null                 [null = workload.steps]
      dataset: {kind: synthetic | jsonl | text [synthetic],
                seed: int >= 0 | null [null = workload.seed + task index],
                min_len: int >= 2 [8], max_len: int >= 2 | null [null = chunk_size],
                distribution: uniform | longtail [uniform],
                path: absolute path (jsonl/text only), field: str [text] (jsonl only)}

``defaults`` (optional: ``{"learning_rate", "batch_size", "steps", "seed"}``, the
workload-level values) resolves the inheritable ``null`` fields; without it they stay
``null`` for the executor to resolve. ``hidden`` (optional: ``workload.model.hidden``)
bounds each task's rank: a LoRA factor of rank r on a linear of width ``hidden`` is only
meaningful for r <= hidden (the adapter banks of a larger rank could only fail to
allocate in the executor); without it the rank is checked against ``INT_MAX`` only.
"""

from __future__ import annotations

import re
from typing import Any

from tessera.errors import SpecError, finite_number

MODES = ("spatial", "temporal")
TARGETS = ("qkv", "proj", "fc", "out")
KINDS = ("synthetic", "jsonl", "text")
DISTRIBUTIONS = ("uniform", "longtail")
# Matched with ``fullmatch``: ``$`` alone would also accept a name ending in "\n".
NAME_RE = re.compile(r"^[a-z0-9]([-_a-z0-9]*[a-z0-9])?$")
# ``<job id>_<task>``: the name of a task fused into another job's executor (the
# controller's LoRA fusion, controller/fusion.py ``_FUSED_RE``). A job's own task named
# this way would be taken for a stray guest task and cancelled, so specs may not use it.
FUSED_PREFIX_RE = re.compile(r"^j-[0-9a-f]{12}_")

# Most tasks one job may carry: the whole spec is one etcd value, which etcd caps at
# about 1.5 MiB ("request is too large"); 256 tasks stay far below that.
MAX_TASKS = 256

_TOP = ("mode", "chunk_size", "micro_batch_tokens", "tasks")
MICRO_BATCH_TOKENS = 512  # the default of micro_batch_tokens
_TASK = ("name", "rank", "alpha", "target_modules", "learning_rate", "batch_size", "steps", "dataset")
_DATASET = ("kind", "seed", "min_len", "max_len", "distribution", "path", "field")


def _unknown(d: dict, known: tuple[str, ...], path: str) -> None:
    for key in d:
        if not isinstance(key, str) or key not in known:
            raise SpecError(f"{path}.{key}", f"unknown field (known: {', '.join(sorted(known))})")


def _mapping(v: Any, path: str) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise SpecError(path, f"must be a mapping, got {type(v).__name__}")
    return v


INT_MAX = 2**31 - 1  # every integer of a task (rank, batch size, steps, lengths, seeds)
# Sequences per task step: the whole batch is materialised and packed every step, so a
# larger one can only exhaust the executor's memory (or take forever) after placement.
MAX_BATCH_SIZE = 65536


def _int(v: Any, path: str, minimum: int, nullable: bool = False, maximum: int = INT_MAX) -> int | None:
    if v is None and nullable:
        return None
    # bool is an int subclass in Python: reject it so `rank: true` is not rank 1.
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(path, f"must be an integer, got {type(v).__name__}")
    if v < minimum:
        raise SpecError(path, f"must be >= {minimum}, got {v}")
    if v > maximum:
        raise SpecError(path, f"must be <= {maximum}, got {v}")
    return v


def _pos_float(v: Any, path: str, nullable: bool = False) -> float | None:
    if v is None and nullable:
        return None
    f = finite_number(v, path)
    if not f > 0:
        raise SpecError(path, f"must be a positive finite number, got {v}")
    return f


def _choice(v: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in choices:
        raise SpecError(path, f"must be one of {', '.join(choices)}, got {v!r}")
    return v


def _dataset(d: dict, path: str, seed: int | None) -> dict:
    _unknown(d, _DATASET, path)
    kind = _choice(d.get("kind", "synthetic"), f"{path}.kind", KINDS)
    out: dict[str, Any] = {
        "kind": kind,
        "seed": _int(d["seed"] if d.get("seed") is not None else seed, f"{path}.seed", 0, nullable=True),
        "min_len": _int(d.get("min_len", 8), f"{path}.min_len", 2),
        "max_len": _int(d.get("max_len"), f"{path}.max_len", 2, nullable=True),
        "distribution": _choice(d.get("distribution", "uniform"), f"{path}.distribution", DISTRIBUTIONS),
    }
    if out["max_len"] is not None and out["max_len"] < out["min_len"]:
        raise SpecError(f"{path}.max_len", f"must be >= min_len ({out['min_len']}), got {out['max_len']}")
    if kind == "synthetic":
        for f in ("path", "field"):
            if d.get(f) is not None:
                raise SpecError(f"{path}.{f}", "only allowed when kind is jsonl or text")
        out["path"] = None
        out["field"] = None
    else:
        p = d.get("path")
        if p is None:
            raise SpecError(f"{path}.path", f"is required when kind is {kind}")
        if not isinstance(p, str) or not p.startswith("/"):
            raise SpecError(f"{path}.path", f"must be an absolute path, got {p!r}")
        out["path"] = p
        if kind == "jsonl":
            field = d.get("field", "text")
            if not isinstance(field, str) or not field:
                raise SpecError(f"{path}.field", f"must be a non-empty string, got {field!r}")
            out["field"] = field
        else:
            if d.get("field") is not None:
                raise SpecError(f"{path}.field", "only allowed when kind is jsonl")
            out["field"] = None
    return out


def validate_task(t: Any, path: str, index: int = 0, defaults: dict | None = None, fused: bool = False,
                  hidden: int | None = None) -> dict:
    """One task of the section (also used for tasks added at run time); see module doc.
    ``fused``: the task is another job's fused in by the controller, whose name has the
    reserved ``<job id>_`` prefix (allowed only then). ``hidden``: the model's hidden size,
    the largest rank allowed (unchecked when None)."""
    t = _mapping(t, path)
    _unknown(t, _TASK, path)
    dflt = defaults or {}
    if "name" not in t:
        raise SpecError(f"{path}.name", "is required")
    name = t["name"]
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or len(name) > 63:
        raise SpecError(f"{path}.name", f"must be 1-63 of a-z, 0-9, '-', '_' (alphanumeric at both ends), got {name!r}")
    if not fused and FUSED_PREFIX_RE.match(name):
        raise SpecError(f"{path}.name", f"the prefix 'j-<12 hex digits>_' is reserved for fused tasks "
                                         f"(<job id>_<task>), got {name!r}")
    rank = _int(t.get("rank", 8), f"{path}.rank", 1, maximum=INT_MAX if hidden is None else hidden)
    alpha = _pos_float(t.get("alpha", 2.0 * rank), f"{path}.alpha")
    tm = t.get("target_modules", ["qkv", "proj"])
    if not isinstance(tm, list) or not tm:
        raise SpecError(f"{path}.target_modules", f"must be a non-empty list, got {tm!r}")
    for i, m in enumerate(tm):
        _choice(m, f"{path}.target_modules[{i}]", TARGETS)
        if m in tm[:i]:
            raise SpecError(f"{path}.target_modules[{i}]", f"repeats {m!r}")
    seed = dflt.get("seed")

    def inherit(key: str) -> Any:
        # null means "the workload's value": an already-validated section (nulls kept)
        # re-validates with the defaults filled in.
        return t[key] if t.get(key) is not None else dflt.get(key)

    return {
        "name": name,
        "rank": rank,
        "alpha": alpha,
        "target_modules": list(tm),
        "learning_rate": _pos_float(inherit("learning_rate"), f"{path}.learning_rate", nullable=True),
        "batch_size": _int(inherit("batch_size"), f"{path}.batch_size", 1, nullable=True, maximum=MAX_BATCH_SIZE),
        "steps": _int(inherit("steps"), f"{path}.steps", 1, nullable=True),
        "dataset": _dataset(_mapping(t.get("dataset"), f"{path}.dataset"), f"{path}.dataset",
                            None if seed is None else seed + index),
    }


def validate_peft(section: Any, path: str = "workload.peft", defaults: dict | None = None,
                  hidden: int | None = None) -> dict:
    """Validated copy of ``section`` with defaults filled; ``SpecError`` names the bad field.
    ``hidden``: the model's hidden size when known (bounds every task's rank)."""
    s = _mapping(section, path)
    _unknown(s, _TOP, path)
    out: dict[str, Any] = {
        "mode": _choice(s.get("mode", "spatial"), f"{path}.mode", MODES),
        "chunk_size": _int(s.get("chunk_size"), f"{path}.chunk_size", 2, nullable=True),
        "micro_batch_tokens": _int(s.get("micro_batch_tokens", MICRO_BATCH_TOKENS), f"{path}.micro_batch_tokens", 1),
    }
    tasks = s.get("tasks")
    if tasks is None:
        raise SpecError(f"{path}.tasks", "is required (a non-empty list)")
    if not isinstance(tasks, list) or not tasks:
        raise SpecError(f"{path}.tasks", f"must be a non-empty list, got {tasks!r}")
    if len(tasks) > MAX_TASKS:
        raise SpecError(f"{path}.tasks", f"at most {MAX_TASKS} tasks per job, got {len(tasks)}")
    seen: set[str] = set()
    out["tasks"] = []
    for i, t in enumerate(tasks):
        vt = validate_task(t, f"{path}.tasks[{i}]", i, defaults, hidden=hidden)
        if vt["name"] in seen:
            raise SpecError(f"{path}.tasks[{i}].name", f"duplicate task name {vt['name']!r}")
        seen.add(vt["name"])
        cs = out["chunk_size"]
        if cs is not None and vt["dataset"]["min_len"] > cs:
            raise SpecError(f"{path}.tasks[{i}].dataset.min_len", f"must be <= chunk_size ({cs}), got {vt['dataset']['min_len']}")
        if cs is not None and vt["dataset"]["max_len"] is not None and vt["dataset"]["max_len"] > cs:
            raise SpecError(f"{path}.tasks[{i}].dataset.max_len", f"must be <= chunk_size ({cs}), got {vt['dataset']['max_len']}")
        out["tasks"].append(vt)
    return out
