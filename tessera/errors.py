"""Errors shared by every Tessera process."""

from __future__ import annotations


class SpecError(ValueError):
    """A user-supplied document is invalid at ``field`` (a dotted path, e.g.
    ``workload.steps`` or ``workload.peft.tasks[2].rank``). Maps to INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
