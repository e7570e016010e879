"""Atomic, plan-independent checkpoints.

Contract: :func:`save` writes ``<dir>/checkpoint.pt`` so that a reader sees either the
previous complete checkpoint or the new complete one, never a torn file, even across a
crash or power loss (temp file in the same directory, fsync, ``os.replace``, fsync of the
directory). :func:`load` returns the latest checkpoint dict or None.

The GPT workload stores (see ``train.py``)::

    {"format": FORMAT, "step": completed steps, "plan": {...}, "model_config": {...},
     "model": {full param name: full tensor}, "optim": {name: {"step", "exp_avg", "exp_avg_sq"}},
     "optim_hparams": {...}, "data": {"seed", "next_step"}, "rng": {"torch": ByteTensor},
     "first_loss": float}

Tensors are full (unsharded) so that any plan can resume from any other.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tessera.fsutil import atomic_write

FORMAT = "tessera-gpt-ckpt/1"
FILENAME = "checkpoint.pt"


def path_in(directory: str) -> str:
    """Where the checkpoint of ``directory`` lives."""
    return os.path.join(directory, FILENAME)


def save(obj: dict[str, Any], directory: str) -> str:
    """Atomically replace the checkpoint in ``directory`` with ``obj``; returns its path."""
    final = path_in(directory)
    atomic_write(final, lambda f: torch.save(obj, f))
    return final


def load(directory: str | None) -> dict[str, Any] | None:
    """The checkpoint in ``directory``, or None when there is none (or no directory)."""
    if not directory:
        return None
    p = path_in(directory)
    if not os.path.exists(p):
        return None
    # weights_only: a checkpoint is data; never execute pickled code from disk.
    return torch.load(p, map_location="cpu", weights_only=True)
