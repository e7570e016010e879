"""Errors shared by every Tessera process."""

from __future__ import annotations

import math


class SpecError(ValueError):
    """A user-supplied document is invalid at ``field`` (a dotted path, e.g.
    ``workload.steps`` or ``workload.peft.tasks[2].rank``). Maps to INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def finite_number(v: object, field: str) -> float:
    """``v`` as a float when it is an int or float (not a bool) with a finite value, else
    SpecError(field): "must be a number, got <type>" or "must be a finite number, got <v>"
    (an int too large for a double included). The one rule of every spec's number fields."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SpecError(field, f"must be a number, got {type(v).__name__}")
    try:
        f = float(v)
    except OverflowError:  # an int too large for a double
        raise SpecError(field, f"must be a finite number, got {v}") from None
    if not math.isfinite(f):
        raise SpecError(field, f"must be a finite number, got {v}")
    return f
