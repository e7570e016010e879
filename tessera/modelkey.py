"""The key under which measurements of a workload are filed (agent, profilerd and
estimator agree on it through this one function)."""

from __future__ import annotations

import hashlib
import json

from tessera.spec.multimodal import mean_mix


def model_key(workload: dict) -> str:
    """E.g. ``gpt:l2-h64-s32-v256:b8`` for a normalised manifest workload section."""
    m = workload.get("model", {})
    return (f"{workload.get('type', 'gpt')}:l{m.get('layers')}-h{m.get('hidden')}-s{m.get('seq_len')}-v{m.get('vocab')}"
            f":b{workload.get('batch_size')}")


def arch_key(workload: dict) -> str:
    """The module key of a workload's model, independent of batch and plan, e.g.
    ``gpt:l2-h64-a4-s32-v256``: profiles of one module at any batch share it."""
    m = workload.get("model", {})
    return (f"{workload.get('type', 'gpt')}:l{m.get('layers')}-h{m.get('hidden')}-a{m.get('heads')}"
            f"-s{m.get('seq_len')}-v{m.get('vocab')}")


# Fields of a workload that change what a run computes per step but are not its model:
# everything else except these (they change how long a run is, or its numbers, not the
# cost of one step) enters a non-gpt workload's shape key.
_RUN_ONLY = ("steps", "checkpoint_every", "learning_rate", "seed")
_TASK_RUN_ONLY = ("name", "steps", "learning_rate", "alpha")


def _shape(workload: dict, world: int) -> dict:
    """What determines the cost of one step of a non-gpt workload (see ``shape_key``)."""
    w = {k: v for k, v in workload.items() if k not in _RUN_ONLY}
    if w.get("type") == "peft" and isinstance(w.get("peft"), dict):
        pf = dict(w["peft"])
        tasks = []
        for t in pf.get("tasks") or ():
            t = {k: v for k, v in t.items() if k not in _TASK_RUN_ONLY}
            if t.get("batch_size") is None:
                t["batch_size"] = workload.get("batch_size")
            ds = {k: v for k, v in (t.get("dataset") or {}).items() if k != "seed"}
            if ds.get("max_len") is None:
                ds["max_len"] = pf.get("chunk_size") or (workload.get("model") or {}).get("seq_len")
            t["dataset"] = ds
            tasks.append(t)
        pf["tasks"] = sorted(tasks, key=lambda t: json.dumps(t, sort_keys=True))
        w["peft"] = pf
    if w.get("type") == "multimodal" and isinstance(w.get("multimodal"), dict) and w["multimodal"].get("mix"):
        mm = dict(w["multimodal"])
        img, aud = mean_mix(mm["mix"], int(workload.get("steps") or 1))
        mm["mix"] = [{"step": 0, "image_prob": round(img, 4), "audio_prob": round(aud, 4)}]
        w["multimodal"] = mm
    w["world"] = int(world)
    return w


def shape_key(workload: dict, world: int = 1) -> str:
    """The module key under which measurements of one *step shape* are filed.

    ``gpt``: ``arch_key`` (the performance model composes batch, plan and quota itself).
    Other workloads (``peft``, ``multimodal``): ``arch_key`` + ``:w<12 hex>``, a digest of
    everything that sets the cost of one step, for ``world`` ranks: the workload section
    without its run length, learning rates, seeds, task names and alphas (a peft task's
    inherited batch size and maximum length resolved, tasks in a canonical order), a
    multimodal modality schedule replaced by its mean over the run (``mean_mix``, rounded
    to 1e-4). Two workloads that differ only in those fields share a key: a short
    profiling run of a job measures the job's own step. Pure and deterministic.
    """
    if workload.get("type", "gpt") == "gpt":
        return arch_key(workload)
    blob = json.dumps(_shape(workload, world), sort_keys=True, separators=(",", ":"), default=str)
    return f"{arch_key(workload)}:w{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


# Labels a step measurement carries so that the estimator can turn a run into a profile.
PROFILE_LABELS = ("module", "workload_type", "layers", "hidden", "heads", "vocab", "seq_len", "batch", "dp", "tp",
                  "pp", "micro_batches", "threads", "world_size", "device_kind")


def profile_labels(runtime_spec: dict, device_kind: str) -> dict[str, str]:
    """String labels (PROFILE_LABELS) describing one executor's run, from the runtime spec
    the agent launches it with (normalised manifest ``workload`` plus ``threads`` and
    ``dist``); ``module`` is the workload's ``shape_key`` over ``dist.world_size`` ranks —
    for a non-gpt workload only in the run of a profiling job (``"profiling": true`` in the
    spec, set by the controller): a peft job's own later steps run fewer tasks as tasks
    end, a multimodal job's follow its modality schedule, so neither is its shape's step
    (``module`` is "" then: no profile); nor is an input-bound gpt job's
    (``workload.step_delay_s`` > 0: its steps wait for their input, not the model's
    compute — its profiling job runs without the delay). Missing values come out as "0"."""
    w = runtime_spec.get("workload", {}) or {}
    m = w.get("model", {}) or {}
    plan = w.get("plan", {}) or {}
    dist = runtime_spec.get("dist", {}) or {}
    gpt = w.get("type", "gpt") == "gpt"
    module = shape_key(w, dist.get("world_size", 1) or 1) if gpt or runtime_spec.get("profiling") else ""
    if gpt and float(w.get("step_delay_s") or 0.0) > 0:
        module = ""
    vals = {"module": module, "workload_type": w.get("type", "gpt"), "layers": m.get("layers"),
            "hidden": m.get("hidden"), "heads": m.get("heads"), "vocab": m.get("vocab"), "seq_len": m.get("seq_len"),
            "batch": w.get("batch_size"), "dp": plan.get("dp", 1), "tp": plan.get("tp", 1), "pp": plan.get("pp", 1),
            "micro_batches": plan.get("micro_batches", 1), "threads": runtime_spec.get("threads", 1),
            "world_size": dist.get("world_size", 1), "device_kind": device_kind}
    return {k: str(0 if v is None else v) for k, v in vals.items()}
