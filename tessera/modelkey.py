"""The key under which measurements of a workload are filed (agent, profilerd and
estimator agree on it through this one function)."""

from __future__ import annotations


def model_key(workload: dict) -> str:
    """E.g. ``gpt:l2-h64-s32-v256:b8`` for a normalised manifest workload section."""
    m = workload.get("model", {})
    return (f"{workload.get('type', 'gpt')}:l{m.get('layers')}-h{m.get('hidden')}-s{m.get('seq_len')}-v{m.get('vocab')}"
            f":b{workload.get('batch_size')}")
