"""The estimator's typed configuration (flag > env TESSERA_ESTIMATOR_* > --config file)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessera.errors import SpecError

from .models import MIN_MEASURED


@dataclass(frozen=True)
class EstimatorConfig:
    listen: str = field(default="127.0.0.1:50071", metadata={"help": "EstimatorService listen address HOST:PORT"})
    state_dir: str = field(default=".tessera/estimator", metadata={"help": "directory of the measurement log"})
    grace_s: float = field(default=3.0, metadata={"help": "seconds in-flight RPCs get on SIGTERM"})
    min_refit_interval_s: float = field(default=1.0, metadata={"help": "at most one model refit per this many seconds"})
    step_window: int = field(default=4096, metadata={
        "help": "step samples kept per job, per model key and per (job, model key): the most recent ones"})
    run_steps: int = field(default=64, metadata={
        "help": "measured steps kept per single-device run (besides its warm-up steps): the latest ones"})
    row_window: int = field(default=256, metadata={
        "help": "comm rows kept per (link, op, bytes, world) and colocation rows per (device kind, mode, colocated)"})
    compact_bytes: int = field(default=64 << 20, metadata={
        "help": "rewrite the measurement log to what is retained once it exceeds this many bytes (0: never)"})
    key_ttl_s: float = field(default=7 * 86400.0, metadata={
        "help": "seconds without a measurement after which the keys of a gone job (job, (job, model key), its "
                "runs unless one is its configuration's latest profile) and of a gone source are forgotten; model "
                "keys, comm and colocation rows never expire (0: nothing expires)"})

    def __post_init__(self) -> None:
        if not self.listen:
            raise SpecError("listen", "required")
        if not self.state_dir:
            raise SpecError("state_dir", "required")
        if self.min_refit_interval_s < 0:
            raise SpecError("min_refit_interval_s", f"must be >= 0, got {self.min_refit_interval_s}")
        if self.grace_s < 0:
            raise SpecError("grace_s", f"must be >= 0, got {self.grace_s}")
        if self.step_window < 1:
            raise SpecError("step_window", f"must be >= 1, got {self.step_window}")
        if self.run_steps < MIN_MEASURED:  # fewer could never make a profile point
            raise SpecError("run_steps", f"must be >= {MIN_MEASURED}, got {self.run_steps}")
        if self.row_window < 1:
            raise SpecError("row_window", f"must be >= 1, got {self.row_window}")
        if self.compact_bytes < 0:
            raise SpecError("compact_bytes", f"must be >= 0 (0 disables compaction), got {self.compact_bytes}")
        if not (math.isfinite(self.key_ttl_s) and self.key_ttl_s >= 0):
            raise SpecError("key_ttl_s", f"must be a finite number >= 0 (0 disables expiry), got {self.key_ttl_s}")
