"""Validation of a job manifest's ``workload.multimodal`` section.

Contract: ``validate_multimodal(section, path) -> dict`` is pure (no I/O, no torch): it
returns a new dict with every default filled in, or raises ``SpecError`` whose
``field`` is the exact dotted path at fault (``workload.multimodal.mix[1].image_prob``).
Unknown fields are errors, not ignored, so a typo never silently becomes a default.

Section (defaults in brackets)::

    mode: colocated | disaggregated          [colocated]
    micro_batches: int >= 1                   [4]   pipeline depth inside one step
    image:   {size [32], patch [8], channels [3], pool [4]}   pool: patches averaged per LLM token
    encoder: {layers [2], hidden [64], heads [4]}             ViT image encoder
    audio:   {enabled [false], frames [32], frame_dim [16], pool [4], layers [1], hidden [32], heads [2]}
    data:    {max_images [4], max_audio [1], min_text [8], max_text [40], keys [8]}
    mix:     [{step: int >= 0, image_prob: 0..1, audio_prob: 0..1 [0]}, ...]  steps strictly
             increasing, first at step 0; linear in between, constant after the last  [[{step 0, image_prob 0.5}]]
    colocated:     {encoder_quota: 0 < q < 1 [0.5], pin [true]}   encoder's share of the device;
                   CPU: pin = hard quota (core sets), false = soft (thread budgets only)
    disaggregated: {encoder_ranks: int >= 1 | "auto" ["auto"], adaptive [true], allow_shared [true]}
    reorder:       {enabled [true], group_batches: int >= 1 [4]}
"""

from __future__ import annotations

import copy
from typing import Any

from tessera.errors import SpecError, finite_number

_MODES = ("colocated", "disaggregated")

# name -> (kind, default, check) ; kind in {"int", "float", "bool"}; check returns an error or None.
_pos = lambda v: None if v >= 1 else "must be >= 1"  # noqa: E731
_nonneg = lambda v: None if v >= 0 else "must be >= 0"  # noqa: E731
_prob = lambda v: None if 0.0 <= v <= 1.0 else "must be between 0 and 1"  # noqa: E731
_open01 = lambda v: None if 0.0 < v < 1.0 else "must be strictly between 0 and 1"  # noqa: E731

_SUBSECTIONS: dict[str, dict[str, tuple[str, Any, Any]]] = {
    "image": {
        "size": ("int", 32, _pos),
        "patch": ("int", 8, _pos),
        "channels": ("int", 3, _pos),
        "pool": ("int", 4, _pos),
    },
    "encoder": {
        "layers": ("int", 2, _pos),
        "hidden": ("int", 64, _pos),
        "heads": ("int", 4, _pos),
    },
    "audio": {
        "enabled": ("bool", False, None),
        "frames": ("int", 32, _pos),
        "frame_dim": ("int", 16, _pos),
        "pool": ("int", 4, _pos),
        "layers": ("int", 1, _pos),
        "hidden": ("int", 32, _pos),
        "heads": ("int", 2, _pos),
    },
    "data": {
        "max_images": ("int", 4, _nonneg),
        "max_audio": ("int", 1, _nonneg),
        "min_text": ("int", 8, lambda v: None if v >= 2 else "must be >= 2 (one next-token target needs two tokens)"),
        "max_text": ("int", 40, _pos),
        "keys": ("int", 8, _pos),
    },
    "colocated": {
        "encoder_quota": ("float", 0.5, _open01),
        "pin": ("bool", True, None),
    },
    "disaggregated": {
        # encoder_ranks is checked by hand: int or "auto".
        "adaptive": ("bool", True, None),
        "allow_shared": ("bool", True, None),
    },
    "reorder": {
        "enabled": ("bool", True, None),
        "group_batches": ("int", 4, _pos),
    },
}

_TOP = {"mode", "micro_batches", "mix", *_SUBSECTIONS}


def _typed(value: Any, kind: str, field: str) -> Any:
    # bool is a subclass of int in Python: reject it explicitly where a number is wanted.
    if kind == "bool":
        if not isinstance(value, bool):
            raise SpecError(field, f"must be a boolean, got {type(value).__name__}")
        return value
    if isinstance(value, bool):
        raise SpecError(field, f"must be {'an integer' if kind == 'int' else 'a number'}, got bool")
    if kind == "int":
        if not isinstance(value, int):
            raise SpecError(field, f"must be an integer, got {type(value).__name__}")
        return value
    return finite_number(value, field)


def _mapping(value: Any, field: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(field, f"must be a mapping, got {type(value).__name__}")
    return value


def _fill(sub: dict, schema: dict, path: str, extra: tuple[str, ...] = ()) -> dict:
    for key in sub:
        if not isinstance(key, str) or (key not in schema and key not in extra):
            raise SpecError(f"{path}.{key}", f"unknown field (known: {', '.join(sorted([*schema, *extra]))})")
    out = {}
    for name, (kind, default, check) in schema.items():
        field = f"{path}.{name}"
        value = _typed(sub[name], kind, field) if name in sub else default
        if check is not None and (err := check(value)):
            raise SpecError(field, f"{err}, got {value!r}")
        out[name] = value
    return out


def _mix(value: Any, path: str) -> list[dict]:
    if value is None:
        return [{"step": 0, "image_prob": 0.5, "audio_prob": 0.0}]
    if not isinstance(value, list) or not value:
        raise SpecError(path, "must be a non-empty list of {step, image_prob, audio_prob}")
    schema = {"step": ("int", None, _nonneg), "image_prob": ("float", None, _prob), "audio_prob": ("float", 0.0, _prob)}
    out: list[dict] = []
    for i, point in enumerate(value):
        field = f"{path}[{i}]"
        point = _mapping(point, field)
        for req in ("step", "image_prob"):
            if req not in point:
                raise SpecError(f"{field}.{req}", "is required")
        entry = _fill(point, schema, field)
        if i == 0 and entry["step"] != 0:
            raise SpecError(f"{field}.step", f"the first mix point must be at step 0, got {entry['step']}")
        if out and entry["step"] <= out[-1]["step"]:
            raise SpecError(f"{field}.step", f"must be greater than the previous point's step ({out[-1]['step']})")
        out.append(entry)
    return out


def validate_multimodal(section: Any, path: str = "workload.multimodal") -> dict:
    """Return ``section`` with defaults filled in; raise SpecError naming the field at fault.

    Pure and idempotent: ``validate_multimodal(validate_multimodal(s)) == validate_multimodal(s)``.
    """
    section = copy.deepcopy(_mapping(section, path))
    for key in section:
        if key not in _TOP:
            raise SpecError(f"{path}.{key}", f"unknown field (known: {', '.join(sorted(_TOP))})")
    out: dict[str, Any] = {}

    mode = section.get("mode", "colocated")
    if mode not in _MODES:
        raise SpecError(f"{path}.mode", f"must be one of {', '.join(_MODES)}, got {mode!r}")
    out["mode"] = mode

    mb = _typed(section.get("micro_batches", 4), "int", f"{path}.micro_batches")
    if mb < 1:
        raise SpecError(f"{path}.micro_batches", f"must be >= 1, got {mb}")
    out["micro_batches"] = mb

    for name, schema in _SUBSECTIONS.items():
        field = f"{path}.{name}"
        extra = ("encoder_ranks",) if name == "disaggregated" else ()
        sub = _mapping(section.get(name), field)
        out[name] = _fill(sub, schema, field, extra)

    ranks = _mapping(section.get("disaggregated"), f"{path}.disaggregated").get("encoder_ranks", "auto")
    field = f"{path}.disaggregated.encoder_ranks"
    if ranks != "auto":
        if isinstance(ranks, bool) or not isinstance(ranks, int):
            raise SpecError(field, f"must be an integer or \"auto\", got {ranks!r}")
        if ranks < 1:
            raise SpecError(field, f"must be >= 1, got {ranks}")
    out["disaggregated"]["encoder_ranks"] = ranks

    out["mix"] = _mix(section.get("mix"), f"{path}.mix")

    # Cross-field shape checks, each blamed on the field a user would change.
    img, enc, aud, data = out["image"], out["encoder"], out["audio"], out["data"]
    if img["size"] % img["patch"]:
        raise SpecError(f"{path}.image.patch", f"must divide image.size ({img['size']}), got {img['patch']}")
    patches = (img["size"] // img["patch"]) ** 2
    if patches % img["pool"]:
        raise SpecError(f"{path}.image.pool", f"must divide the patch count ({patches}), got {img['pool']}")
    if enc["hidden"] % enc["heads"]:
        raise SpecError(f"{path}.encoder.heads", f"must divide encoder.hidden ({enc['hidden']}), got {enc['heads']}")
    if aud["hidden"] % aud["heads"]:
        raise SpecError(f"{path}.audio.heads", f"must divide audio.hidden ({aud['hidden']}), got {aud['heads']}")
    if aud["frames"] % aud["pool"]:
        raise SpecError(f"{path}.audio.pool", f"must divide audio.frames ({aud['frames']}), got {aud['pool']}")
    if data["min_text"] > data["max_text"]:
        raise SpecError(f"{path}.data.min_text", f"must be <= data.max_text ({data['max_text']}), got {data['min_text']}")
    return out


def media_tokens_max(section: dict) -> int:
    """Largest number of LLM positions a sample's media can take, for a validated section."""
    img, aud, data = section["image"], section["audio"], section["data"]
    per_image = (img["size"] // img["patch"]) ** 2 // img["pool"]
    per_audio = aud["frames"] // aud["pool"] if aud["enabled"] else 0
    return data["max_images"] * per_image + (data["max_audio"] * per_audio if aud["enabled"] else 0)


def mix_at(mix: list[dict], step: int) -> tuple[float, float]:
    """(image_prob, audio_prob) at ``step`` of a validated ``mix``: linear between schedule
    points, constant after the last (the runtime's data source and the controller's
    profiling both read the schedule through this one function)."""
    if step <= mix[0]["step"]:
        return mix[0]["image_prob"], mix[0].get("audio_prob", 0.0)
    for a, b in zip(mix, mix[1:]):
        if a["step"] <= step < b["step"]:
            f = (step - a["step"]) / (b["step"] - a["step"])
            lerp = lambda x, y: x + f * (y - x)  # noqa: E731
            return lerp(a["image_prob"], b["image_prob"]), lerp(a.get("audio_prob", 0.0), b.get("audio_prob", 0.0))
    return mix[-1]["image_prob"], mix[-1].get("audio_prob", 0.0)


def mean_mix(mix: list[dict], steps: int) -> tuple[float, float]:
    """(image_prob, audio_prob) averaged over the steps ``0 .. steps-1`` of a run of a
    validated ``mix`` (``mix_at`` at every step): the constant mix whose expected media
    per sample (linear in the probabilities) equals the run's. Closed form, one
    arithmetic series per schedule segment: exact, and O(len(mix)) however long the run
    (``steps`` < 1 counts as 1)."""
    n = max(1, int(steps))
    keys = ("image_prob", "audio_prob")
    val = [lambda p, k=k: float(p.get(k, 0.0)) for k in keys]
    tot = [0.0, 0.0]
    first = mix[0]["step"]
    done = min(first + 1, n)                # s <= first step: the first point's values
    for j in range(2):
        tot[j] += done * val[j](mix[0])
    for a, b in zip(mix, mix[1:]):          # a.step <= s < b.step: linear between a and b
        lo, hi = max(a["step"], done), min(b["step"], n)
        if hi <= lo:
            continue
        cnt, span = hi - lo, b["step"] - a["step"]
        off = cnt * (lo - a["step"]) + cnt * (cnt - 1) / 2   # sum of (s - a.step) over [lo, hi)
        for j in range(2):
            tot[j] += cnt * val[j](a) + (val[j](b) - val[j](a)) * off / span
        done = max(done, hi)
    if n > done:                            # after the last point: its values
        for j in range(2):
            tot[j] += (n - done) * val[j](mix[-1])
    return tot[0] / n, tot[1] / n
