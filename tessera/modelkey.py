"""The key under which measurements of a workload are filed (agent, profilerd and
estimator agree on it through this one function)."""

from __future__ import annotations


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


# Labels a step measurement carries so that the estimator can turn a run into a profile.
PROFILE_LABELS = ("module", "workload_type", "layers", "hidden", "heads", "vocab", "seq_len", "batch", "dp", "tp",
                  "pp", "micro_batches", "threads", "world_size", "device_kind")


def profile_labels(runtime_spec: dict, device_kind: str) -> dict[str, str]:
    """String labels (PROFILE_LABELS) describing one executor's run, from the runtime spec
    the agent launches it with (normalised manifest ``workload`` plus ``threads`` and
    ``dist``). Missing values come out as "0"."""
    w = runtime_spec.get("workload", {}) or {}
    m = w.get("model", {}) or {}
    plan = w.get("plan", {}) or {}
    dist = runtime_spec.get("dist", {}) or {}
    vals = {"module": arch_key(w), "workload_type": w.get("type", "gpt"), "layers": m.get("layers"),
            "hidden": m.get("hidden"), "heads": m.get("heads"), "vocab": m.get("vocab"), "seq_len": m.get("seq_len"),
            "batch": w.get("batch_size"), "dp": plan.get("dp", 1), "tp": plan.get("tp", 1), "pp": plan.get("pp", 1),
            "micro_batches": plan.get("micro_batches", 1), "threads": runtime_spec.get("threads", 1),
            "world_size": dist.get("world_size", 1), "device_kind": device_kind}
    return {k: str(0 if v is None else v) for k, v in vals.items()}
