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
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

FORMAT = "tessera-gpt-ckpt/1"
FILENAME = "checkpoint.pt"


def path_in(directory: str) -> str:
    """Where the checkpoint of ``directory`` lives."""
    return os.path.join(directory, FILENAME)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[BinaryIO], Any]) -> None:
    """Replace ``path`` atomically and durably: ``write(f)`` fills a temp file in the same
    directory (created if missing), which is flushed, fsynced and ``os.replace``d over
    ``path``; then the directory is fsynced (the rename is durable only once the directory
    entry is). After a crash a reader finds the old file or the new one, whole; a failed
    write leaves no temp file behind. Every checkpoint-like file of the runtime goes
    through here."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


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
