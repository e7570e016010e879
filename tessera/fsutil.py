"""Durable file writes shared by every daemon (pure I/O helpers, no service logic).

Contract: :func:`atomic_write` replaces ``path`` atomically and durably — ``write(f)``
fills a temp file in the same directory (created if missing), which is flushed, fsynced
and ``os.replace``d over ``path``; then the directory is fsynced (the rename is durable
only once the directory entry is). After a crash a reader finds the old file or the new
one, whole; a failed write leaves no temp file behind. :func:`fsync_dir` is that last
step alone, for writers with their own temp-file protocol.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory, making the renames and creations in it durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> None:
    """Replace ``path`` with what ``write(f)`` writes; see the module docstring."""
    path = os.fspath(path)
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
    fsync_dir(directory)
