"""Seq numbers that survive a profilerd restart: the daemon reserves blocks of them in
``<state_dir>/seq`` and, after a restart, starts past the last reserved block. Unused
numbers of a block become gaps, which the estimator accepts.

The file is replaced with ``tessera.fsutil.atomic_write`` (temp file, fsync, rename,
directory fsync): after a crash it holds the old reservation or the new one, whole, and
a failed write leaves the old file, no temp file, and ``reserved`` unchanged (the caller
gets the error and must not hand out numbers past the old reservation)."""

from __future__ import annotations

import os
from pathlib import Path

from tessera.fsutil import atomic_write

SEQ_NAME = "seq"


class SeqReservation:
    """The persisted high-water mark of reserved seq numbers of one profilerd.

    ``reserved``: every seq up to it may have been handed out by this or an earlier run,
    so a new run starts past it. A file that is not an integer is an error (ValueError)
    rather than a silent restart at 1, which would reuse numbers."""

    def __init__(self, state_dir: str | os.PathLike, block: int = 1000) -> None:
        if block < 1:
            raise ValueError(f"block: must be >= 1, got {block}")
        self.path = Path(state_dir) / SEQ_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.block = block
        try:
            self.reserved = int(self.path.read_text().strip() or 0)
        except FileNotFoundError:
            self.reserved = 0

    def first_seq(self) -> int:
        """Where numbering starts for this run (reserves the first block)."""
        start = self.reserved + 1
        self.ensure(start)
        return start

    def ensure(self, next_seq: int) -> None:
        """Make sure ``next_seq`` is within a persisted reservation (cheap when it is).
        Durable when it returns; on an OSError nothing changed."""
        if next_seq <= self.reserved:
            return
        reserved = next_seq + self.block - 1
        atomic_write(self.path, lambda f: f.write(f"{reserved}\n".encode()))
        self.reserved = reserved
