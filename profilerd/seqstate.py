"""Seq numbers that survive a profilerd restart: the daemon reserves blocks of them in
``<state_dir>/seq`` (atomic write + fsync) and, after a restart, starts past the last
reserved block. Unused numbers of a block become gaps, which the estimator accepts."""

from __future__ import annotations

import os
from pathlib import Path


class SeqReservation:
    def __init__(self, state_dir: str | os.PathLike, block: int = 1000) -> None:
        self.path = Path(state_dir) / "seq"
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
        """Make sure ``next_seq`` is within a persisted reservation (cheap when it is)."""
        if next_seq <= self.reserved:
            return
        reserved = next_seq + self.block - 1
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(f"{reserved}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.reserved = reserved
