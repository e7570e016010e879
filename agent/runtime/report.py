"""How an executor tells the agent what it is doing.

Contract: every event is one line on stdout, ``TESSERA_EVENT <json>``, flushed at
once; the agent parses these lines (everything else on stdout/stderr is log text).
Events: ``start``, ``progress`` (step, total, loss, step_time_s, phases{forward,
backward, communication, optimizer} seconds, module), ``checkpoint`` (path, step),
``task`` (multi-task workloads: task, phase, ...), ``done`` (final_loss), ``error``
(message). Only rank 0 of a distributed job reports progress unless told otherwise.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

PREFIX = "TESSERA_EVENT "


class Reporter:
    """Writes events; ``enabled=False`` makes every call a no-op (non-zero ranks)."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self._stream = stream or sys.stdout
        self.enabled = enabled

    def event(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        self._stream.write(PREFIX + json.dumps({"event": kind, **fields}, default=float) + "\n")
        self._stream.flush()


def parse_line(line: str) -> dict | None:
    """Return the event dict of a ``TESSERA_EVENT`` line, else None (plain log text)."""
    if not line.startswith(PREFIX):
        return None
    try:
        ev = json.loads(line[len(PREFIX):])
    except json.JSONDecodeError:
        return None
    return ev if isinstance(ev, dict) and "event" in ev else None
