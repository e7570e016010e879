"""Partial results for benchmarks run under a time limit (bench/gpu/run.sh).

:func:`write_json` writes the results so far after every completed row/phase, with
``"complete": false`` until the last write (``True``), atomically (temp file +
rename), so a step killed at its timeout still leaves a readable JSON with every
figure measured before the kill.
"""

from __future__ import annotations

import json
import os


def write_json(path: str | None, out: dict, complete: bool, **dump) -> None:
    """Write ``out`` plus ``"complete"`` to ``path`` (no-op without a path)."""
    if not path:
        return
    doc = {**out, "complete": bool(complete)}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, **({"indent": 1} | dump))
    os.replace(tmp, path)


def cuda_missing(timeout_s: float = 120.0) -> bool:
    """True when torch sees no CUDA GPU (checked in a child process, so that the
    caller never touches the CUDA driver before it spawns workers), or when the probe
    does not answer within ``timeout_s`` (a hung driver is no usable GPU)."""
    import subprocess
    import sys

    try:
        probe = subprocess.run([sys.executable, "-c",
                                "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                               capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return True
    return probe.returncode != 0


NO_CUDA = "--device cuda: no CUDA GPU here"
