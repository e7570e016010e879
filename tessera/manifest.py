"""Job manifests: parsing, validation with defaults, and conversion to/from the API.

A manifest is YAML::

    apiVersion: tessera/v1
    kind: Job
    name: gpt-small            # [a-z0-9]([-a-z0-9]*[a-z0-9])?, <= 63 chars
    tenant: demo               # same rule; default "default"
    workload:
      type: gpt                # gpt | peft | multimodal
      model: {vocab: 256, seq_len: 32, layers: 2, hidden: 64, heads: 4}
      steps: 150               # > 0
      batch_size: 8            # > 0
      learning_rate: 0.003     # > 0
      seed: 0                  # >= 0
      data: {kind: synthetic}  # or {kind: file, path: /abs/file.jsonl}
      plan: {dp: 1, tp: 1, pp: 1, micro_batches: 1}
      checkpoint_every: 50
      peft: {...}              # type peft only (tessera/spec/peft.py)
      multimodal: {...}        # type multimodal only (tessera/spec/multimodal.py)
    resources: {devices: 1, device_kind: cpu}   # + share: (0, 1], optional; < 1 needs devices 1

``validate(doc)`` returns the normalised dict (defaults filled) or raises ``SpecError``
naming the dotted path of the first field at fault. The CLI and the controller run the
same function, so a manifest the CLI accepts is one the server accepts. A peft section is
also checked as its executor resolves it: each task with the workload values it inherits
(``batch_size`` <= 65536, ``steps`` and ``seed`` + task index <= 2**31 - 1; an inherited
value at fault is named by its workload field, e.g. ``workload.batch_size``) and
``chunk_size`` (null = ``model.seq_len``) <= ``model.seq_len`` and >= every task's
``dataset.min_len``/``max_len``; the section itself keeps its nulls.
"""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format, struct_pb2

from . import yamlutil
from .api.v1 import types_pb2
from .errors import SpecError, finite_number

API_VERSION = "tessera/v1"
# Matched with ``fullmatch``: ``$`` alone would also accept a name ending in "\n".
NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
WORKLOAD_TYPES = ("gpt", "peft", "multimodal")


def valid_name(s: Any) -> bool:
    """True when ``s`` is a string of at most 63 characters that matches NAME_RE as a
    whole (``fullmatch``: no trailing newline). The one check of a job, tenant or node
    name; callers raise their own SpecError naming the field."""
    return isinstance(s, str) and len(s) <= 63 and NAME_RE.fullmatch(s) is not None
DEVICE_KINDS = ("", "cpu", "gpu")

MODEL_DEFAULTS = {"vocab": 256, "seq_len": 64, "layers": 2, "hidden": 64, "heads": 4}
PLAN_DEFAULTS = {"dp": 1, "tp": 1, "pp": 1, "micro_batches": 1}
WORKLOAD_DEFAULTS = {
    "batch_size": 8,
    "learning_rate": 3e-3,
    "seed": 0,
    "checkpoint_every": 50,
}
# Largest values of the API's integer fields (proto/tessera/api/v1/types.proto): a larger
# one would validate here and then fail to fit the message.
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# Sane upper bounds of the model's dimensions (each also fits its int32 field): beyond
# them a job could only fail in its executor, after being queued and placed.
MODEL_MAX = {"vocab": 1 << 22, "seq_len": 1 << 20, "layers": 4096, "hidden": 1 << 16, "heads": 4096}
# Validators of the workload-specific sections: pure functions (section, path) -> dict.
SECTION_VALIDATORS = {
    "peft": ("tessera.spec.peft", "validate_peft"),
    "multimodal": ("tessera.spec.multimodal", "validate_multimodal"),
}


def _mapping(v: Any, path: str) -> dict:
    if not isinstance(v, dict):
        raise SpecError(path, f"must be a mapping, got {type(v).__name__}")
    return v


def _no_unknown(d: dict, allowed: set[str], path: str) -> None:
    for k in d:
        if k not in allowed:
            where = f"{path}.{k}" if path else str(k)
            raise SpecError(where, f"unknown field (allowed: {', '.join(sorted(allowed))})")


def _int(v: Any, path: str, minimum: int | None = None, maximum: int = INT32_MAX) -> int:
    """An integer in [minimum, maximum]; ``maximum`` defaults to the int32 limit (pass
    ``INT64_MAX`` for an int64 field) so that every validated value fits its proto field."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(path, f"must be an integer, got {type(v).__name__} {v!r}")
    if minimum is not None and v < minimum:
        raise SpecError(path, f"must be >= {minimum}, got {v}")
    if v > maximum:
        raise SpecError(path, f"must be <= {maximum}, got {v}")
    return v


def _float(v: Any, path: str, positive: bool = False) -> float:
    f = finite_number(v, path)
    if positive and not f > 0:
        raise SpecError(path, f"must be > 0, got {v}")
    return f


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str):
        raise SpecError(path, f"must be a string, got {type(v).__name__} {v!r}")
    return v


def _name(v: Any, path: str) -> str:
    s = _str(v, path)
    if not valid_name(s):
        raise SpecError(path, f"must match {NAME_RE.pattern} and be at most 63 characters, got {s!r}")
    return s


def validate(doc: Any) -> dict:
    """Validate a manifest document; return it normalised with every default filled."""
    doc = copy.deepcopy(_mapping(doc, "(manifest)"))
    _no_unknown(doc, {"apiVersion", "kind", "name", "tenant", "workload", "resources"}, "")
    if "apiVersion" not in doc:
        raise SpecError("apiVersion", f"is required (use {API_VERSION!r})")
    if _str(doc["apiVersion"], "apiVersion") != API_VERSION:
        raise SpecError("apiVersion", f"must be {API_VERSION!r}, got {doc['apiVersion']!r}")
    if _str(doc.get("kind", "Job"), "kind") != "Job":
        raise SpecError("kind", f"must be 'Job', got {doc.get('kind')!r}")
    if "name" not in doc:
        raise SpecError("name", "is required")
    out: dict = {
        "apiVersion": API_VERSION,
        "kind": "Job",
        "name": _name(doc["name"], "name"),
        "tenant": _name(doc.get("tenant", "default"), "tenant"),
    }
    if "workload" not in doc:
        raise SpecError("workload", "is required")
    out["workload"] = _workload(_mapping(doc["workload"], "workload"))
    out["resources"] = _resources(_mapping(doc.get("resources", {}), "resources"))
    w, r = out["workload"], out["resources"]
    if w["type"] == "gpt":
        p = w["plan"]
        world = p["dp"] * p["tp"] * p["pp"]
        if world != r["devices"]:
            raise SpecError(
                "resources.devices",
                f"must equal plan dp*tp*pp = {p['dp']}*{p['tp']}*{p['pp']} = {world}, got {r['devices']}",
            )
        if w["model"]["heads"] % p["tp"] or (4 * w["model"]["hidden"]) % p["tp"]:
            raise SpecError("workload.plan.tp", f"must divide model.heads ({w['model']['heads']})")
        if w["model"]["layers"] < p["pp"]:
            raise SpecError("workload.plan.pp", f"must be <= model.layers ({w['model']['layers']})")
        if w["batch_size"] % (p["dp"] * p["micro_batches"]):
            raise SpecError(
                "workload.batch_size",
                f"must be divisible by plan.dp*plan.micro_batches = {p['dp'] * p['micro_batches']}",
            )
        if w["data"]["kind"] == "file" and w["model"]["vocab"] < 256:
            # agent/runtime/data.py make_source refuses it the same way (byte tokens).
            raise SpecError("workload.model.vocab",
                            f"byte-level file data (data.kind 'file') needs vocab >= 256, got {w['model']['vocab']}")
    elif w["type"] == "peft" and r["devices"] != 1:
        # The peft runtime trains every task on one process (agent/runtime/peft/workload.py).
        raise SpecError("resources.devices",
                        f"a peft job runs on one device (its tasks share one backbone), got {r['devices']}")
    elif w["type"] == "multimodal":
        _check_multimodal_effective(w, r)
    return out


def _check_multimodal_effective(w: dict, r: dict) -> None:
    """What the multimodal executor (agent/runtime/multimodal/workload.py) refuses as a
    spec error, refused here with the field it names: colocated mode on more than one
    device (``resources.devices``) and a largest sample (media tokens + ``data.min_text``)
    longer than ``model.seq_len`` (``workload.multimodal.data.max_images``)."""
    mm = w.get("multimodal") or {}
    if mm.get("mode", "colocated") == "colocated" and r["devices"] != 1:
        raise SpecError("resources.devices",
                        f"colocated mode runs on one device (set multimodal.mode: disaggregated to use more), "
                        f"got {r['devices']}")
    try:
        from tessera.spec.multimodal import media_tokens_max
    except ImportError:  # validator not installed: the section was kept as given (see _section)
        return
    try:
        need = media_tokens_max(mm) + mm["data"]["min_text"]
    except (KeyError, TypeError):  # an unvalidated section: the executor checks it
        return
    seq_len = w["model"]["seq_len"]
    if need > seq_len:
        raise SpecError("workload.multimodal.data.max_images",
                        f"largest sample needs {need} positions (media + data.min_text) > model.seq_len {seq_len}")


def _workload(w: dict) -> dict:
    allowed = {"type", "model", "steps", "batch_size", "learning_rate", "seed", "data", "plan",
               "checkpoint_every", "step_delay_s", "peft", "multimodal"}
    _no_unknown(w, allowed, "workload")
    if "type" not in w:
        raise SpecError("workload.type", f"is required (one of {', '.join(WORKLOAD_TYPES)})")
    typ = _str(w["type"], "workload.type")
    if typ not in WORKLOAD_TYPES:
        raise SpecError("workload.type", f"must be one of {', '.join(WORKLOAD_TYPES)}, got {typ!r}")
    out: dict = {"type": typ}
    m = _mapping(w.get("model", {}), "workload.model")
    _no_unknown(m, set(MODEL_DEFAULTS), "workload.model")
    out["model"] = {k: _int(m.get(k, dv), f"workload.model.{k}", 1, MODEL_MAX[k]) for k, dv in MODEL_DEFAULTS.items()}
    if out["model"]["hidden"] % out["model"]["heads"]:
        raise SpecError("workload.model.heads", "must divide workload.model.hidden")
    if "steps" not in w:
        raise SpecError("workload.steps", "is required")
    out["steps"] = _int(w["steps"], "workload.steps", 1, INT64_MAX)
    out["batch_size"] = _int(w.get("batch_size", WORKLOAD_DEFAULTS["batch_size"]), "workload.batch_size", 1)
    out["learning_rate"] = _float(w.get("learning_rate", WORKLOAD_DEFAULTS["learning_rate"]), "workload.learning_rate", True)
    out["seed"] = _int(w.get("seed", 0), "workload.seed", 0, INT64_MAX)
    out["checkpoint_every"] = _int(w.get("checkpoint_every", WORKLOAD_DEFAULTS["checkpoint_every"]),
                                   "workload.checkpoint_every", 1, INT64_MAX)
    # Seconds each step waits for its input (gpt only; 0 = none): an input-bound job, e.g.
    # one fed by a slow loader, that leaves its cores mostly idle. Omitted when 0.
    if "step_delay_s" in w:
        delay = _float(w["step_delay_s"], "workload.step_delay_s")
        if not (0.0 <= delay <= 3600.0):
            raise SpecError("workload.step_delay_s", f"must be in [0, 3600], got {delay!r}")
        if delay and typ != "gpt":
            raise SpecError("workload.step_delay_s", f"only allowed when workload.type is 'gpt', got {typ!r}")
        if delay:
            out["step_delay_s"] = float(delay)
    d = _mapping(w.get("data", {"kind": "synthetic"}), "workload.data")
    _no_unknown(d, {"kind", "path"}, "workload.data")
    kind = _str(d.get("kind", "synthetic"), "workload.data.kind")
    if kind not in ("synthetic", "file"):
        raise SpecError("workload.data.kind", f"must be 'synthetic' or 'file', got {kind!r}")
    data = {"kind": kind}
    if kind == "file":
        if "path" not in d:
            raise SpecError("workload.data.path", "is required when data.kind is 'file'")
        data["path"] = _str(d["path"], "workload.data.path")
        if not Path(data["path"]).is_absolute():
            raise SpecError("workload.data.path", f"must be an absolute path, got {data['path']!r}")
    elif "path" in d:
        raise SpecError("workload.data.path", "only allowed when data.kind is 'file'")
    out["data"] = data
    p = _mapping(w.get("plan", {}), "workload.plan")
    _no_unknown(p, set(PLAN_DEFAULTS), "workload.plan")
    out["plan"] = {k: _int(p.get(k, dv), f"workload.plan.{k}", 1) for k, dv in PLAN_DEFAULTS.items()}
    for section, (mod, fn) in SECTION_VALIDATORS.items():
        if section in w:
            if typ != section:
                raise SpecError(f"workload.{section}", f"only allowed when workload.type is {section!r}")
            out[section] = _section(section, w[section], mod, fn, out)
        elif typ == section:
            out[section] = _section(section, {}, mod, fn, out)
    return out


def _section(section: str, value: Any, mod: str, fn: str, workload: dict) -> dict:
    """The validated section; the peft one is also checked as its executor will resolve it
    (:func:`_check_peft_effective`), so that a spec the executor would refuse is refused
    here, at submission."""
    path = f"workload.{section}"
    value = _mapping(value, path)
    try:
        validator = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError):
        # The workload's own validator is not installed: keep the section as given and
        # let the executor refuse it. Structure was still checked above.
        return value
    if section == "peft":
        out = validator(value, path, hidden=workload["model"]["hidden"])
        _check_peft_effective(validator, out, path, workload)
    else:
        out = validator(value, path)
    _struct_safe(out, path)
    return out


# A task field left null inherits this workload field (tessera/spec/peft.py); the dataset
# seed inherits workload.seed + the task's index.
_INHERITED = re.compile(r"\.tasks\[(\d+)\]\.(batch_size|steps|learning_rate|dataset\.seed)$")


def _check_peft_effective(validator: Any, sec: dict, path: str, workload: dict) -> None:
    """Check the peft section ``sec`` (validated, nulls kept) with what its executor fills
    in (agent/runtime/peft/workload.py ``parse``): each null task field takes the workload's
    value (a task's batch size must then be <= the peft cap, 65536; its steps and dataset
    seed fit the task's int32 fields), and a null ``chunk_size`` is ``model.seq_len``, which
    bounds ``chunk_size`` and each task's ``dataset.min_len``/``max_len``. A failure of an
    inherited value names the workload field (``workload.batch_size``), not the task's."""
    defaults = {k: workload[k] for k in ("learning_rate", "batch_size", "steps", "seed")}
    try:
        validator(sec, path, defaults=defaults, hidden=workload["model"]["hidden"])
    except SpecError as e:
        # ``sec`` itself is valid, so the failure is a value the task inherits.
        m = _INHERITED.search(e.field)
        if m is None:
            raise
        key = "seed" if m.group(2) == "dataset.seed" else m.group(2)
        what = f"{e.field} (workload.seed + task index {m.group(1)})" if key == "seed" else e.field
        raise SpecError(f"workload.{key}", f"{e.message} (inherited by {what})") from None
    seq_len = workload["model"]["seq_len"]
    cs = sec["chunk_size"]
    if cs is not None and cs > seq_len:
        raise SpecError(f"{path}.chunk_size", f"must be <= model.seq_len ({seq_len}), got {cs}")
    if cs is None:  # the chunk size is model.seq_len: each sequence must fit one chunk
        for i, t in enumerate(sec["tasks"]):
            ds = t["dataset"]
            for f in ("min_len", "max_len"):
                if ds[f] is not None and ds[f] > seq_len:
                    raise SpecError(f"{path}.tasks[{i}].dataset.{f}",
                                    f"must be <= chunk_size (null = model.seq_len = {seq_len}), got {ds[f]}")


# A section travels as a protobuf Struct, whose numbers are doubles: an integer beyond
# 2**53 would not come back as itself (and one beyond the double range not convert at all).
STRUCT_INT_MAX = 2**53


def _struct_safe(v: Any, path: str) -> None:
    if isinstance(v, dict):
        for k, x in v.items():
            _struct_safe(x, f"{path}.{k}")
    elif isinstance(v, list):
        for i, x in enumerate(v):
            _struct_safe(x, f"{path}[{i}]")
    elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > STRUCT_INT_MAX:
        raise SpecError(path, f"must be at most {STRUCT_INT_MAX} in magnitude, got {v}")


def _resources(r: dict) -> dict:
    _no_unknown(r, {"devices", "device_kind", "share"}, "resources")
    devices = _int(r.get("devices", 1), "resources.devices", 1)
    kind = _str(r.get("device_kind", ""), "resources.device_kind")
    if kind not in DEVICE_KINDS:
        raise SpecError("resources.device_kind", f"must be 'cpu', 'gpu' or empty, got {kind!r}")
    out = {"devices": devices, "device_kind": kind}
    if "share" in r:  # a share of one partition, for packing small jobs (single-device only)
        share = r["share"]
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise SpecError("resources.share", f"must be a number in (0, 1], got {share!r}")
        if share < 1 and devices != 1:
            raise SpecError("resources.share", f"a share below 1 needs resources.devices = 1, got {devices}")
        out["share"] = float(share)
    return out


def load_file(path: str | Path) -> dict:
    """Read and validate a manifest file. ``SpecError`` (naming the file) for YAML syntax
    errors and text that is not UTF-8 too; ``OSError`` when it cannot be read. A key
    repeated in any mapping is refused too (``SpecError`` naming its dotted path, e.g.
    ``workload.steps: duplicate key (line 7 of m.yaml)``), never resolved to one value."""
    p = Path(path)
    try:
        doc = yamlutil.load_unique(p.read_text(encoding="utf-8"))
    except yamlutil.DuplicateKey as e:
        raise SpecError(e.path, f"duplicate key (line {e.line} of {p})") from None
    except UnicodeDecodeError as e:
        raise SpecError(str(p), f"not UTF-8 text (byte {e.start}: {e.reason})") from None
    except yaml.YAMLError as e:
        raise SpecError(str(p), f"not valid YAML: {e}") from None
    return validate(doc)


# --- conversion -------------------------------------------------------------------------

def _struct(d: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


def _unstruct(v: Any) -> Any:
    # Struct carries every number as a double: give integral values back as ints so
    # the same validators accept what the client sent.
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, dict):
        return {k: _unstruct(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_unstruct(x) for x in v]
    return v


def to_proto(doc: dict) -> types_pb2.JobSpec:
    """Normalised manifest dict -> JobSpec message (lossless for validated documents)."""
    w = doc["workload"]
    wl = types_pb2.Workload(
        type=w["type"],
        model=types_pb2.ModelConfig(**w["model"]),
        steps=w["steps"],
        batch_size=w["batch_size"],
        learning_rate=w["learning_rate"],
        seed=w["seed"],
        data=types_pb2.DataSource(kind=w["data"]["kind"], path=w["data"].get("path", "")),
        plan=types_pb2.ParallelPlan(**w["plan"]),
        checkpoint_every=w["checkpoint_every"],
        step_delay_s=w.get("step_delay_s", 0.0),
    )
    for section in SECTION_VALIDATORS:
        if section in w:
            getattr(wl, section).CopyFrom(_struct(w[section]))
    return types_pb2.JobSpec(
        api_version=doc["apiVersion"],
        name=doc["name"],
        tenant=doc["tenant"],
        workload=wl,
        resources=types_pb2.Resources(**doc["resources"]),
    )


def from_proto(spec: types_pb2.JobSpec) -> dict:
    """JobSpec message -> manifest dict (not yet validated: unset fields are omitted so
    that ``validate`` reports required fields and fills defaults as for a YAML file)."""
    doc: dict = {"apiVersion": spec.api_version, "kind": "Job"}
    if spec.name:
        doc["name"] = spec.name
    if spec.tenant:
        doc["tenant"] = spec.tenant
    if spec.HasField("workload"):
        w = spec.workload
        wd: dict = {}
        if w.type:
            wd["type"] = w.type
        if w.HasField("model"):
            wd["model"] = {k: int(v) for k, v in json_format.MessageToDict(w.model, preserving_proto_field_name=True).items()}
        for k in ("steps", "batch_size", "seed", "checkpoint_every"):
            v = getattr(w, k)
            # proto3 scalars have no presence: 0 means "unset", except that steps is
            # required, so a 0 there is reported as the bad value it is.
            if v != 0 or k == "steps":
                wd[k] = int(v)
        if w.learning_rate:
            wd["learning_rate"] = w.learning_rate
        if w.step_delay_s:
            wd["step_delay_s"] = w.step_delay_s
        if w.HasField("data"):
            wd["data"] = {"kind": w.data.kind or "synthetic"}
            if w.data.path:
                wd["data"]["path"] = w.data.path
        if w.HasField("plan"):
            wd["plan"] = {k: int(v) for k, v in json_format.MessageToDict(w.plan, preserving_proto_field_name=True).items()}
        for section in SECTION_VALIDATORS:
            if w.HasField(section):
                wd[section] = _unstruct(json_format.MessageToDict(getattr(w, section)))
        doc["workload"] = wd
    if spec.HasField("resources"):
        r = spec.resources
        doc["resources"] = {"devices": int(r.devices)} if r.devices != 0 else {}
        if r.device_kind:
            doc["resources"]["device_kind"] = r.device_kind
        if r.share:
            doc["resources"]["share"] = r.share
    return doc
