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


class SeqStateError(ValueError):
    """The seq file exists but does not hold a non-negative integer (names the file and
    what to do; the daemon exits 2 with it, like a configuration error)."""


class SeqNotPersisted(OSError):
    """A reservation could not be written (disk full, read-only directory, ...): the
    measurement that needed the number is not buffered (``Profilerd.add``); its message
    starts "sequence state not persisted: " and names the OS error."""


class SeqReservation:
    """The persisted high-water mark of reserved seq numbers of one profilerd.

    ``reserved``: every seq up to it may have been handed out by this or an earlier run,
    so a new run starts past it. A file that is not an integer is an error (ValueError)
    (``SeqStateError``) rather than a silent restart at 1, which would reuse numbers."""

    def __init__(self, state_dir: str | os.PathLike, block: int = 1000) -> None:
        if block < 1:
            raise ValueError(f"block: must be >= 1, got {block}")
        self.path = Path(state_dir) / SEQ_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.block = block
        try:
            text = self.path.read_text(errors="replace").strip()
        except FileNotFoundError:
            text = ""
        try:
            self.reserved = int(text or 0)
            if self.reserved < 0:
                raise ValueError("negative")
        except ValueError:
            raise SeqStateError(
                f"{self.path}: corrupt seq state {text[:40]!r} (must be an integer >= 0). Restarting at 1 could reuse "
                f"numbers the estimator already holds: write a number at least the estimator's watermark for this "
                f"source (GetWatermark) into it, or remove the file (profilerd then renumbers past the watermark it "
                f"reads on connect)") from None

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
