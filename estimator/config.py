"""The estimator's typed configuration (flag > env TESSERA_ESTIMATOR_* > --config file)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.errors import SpecError


@dataclass(frozen=True)
class EstimatorConfig:
    listen: str = field(default="127.0.0.1:50071", metadata={"help": "EstimatorService listen address HOST:PORT"})
    state_dir: str = field(default=".tessera/estimator", metadata={"help": "directory of the measurement log"})
    grace_s: float = field(default=3.0, metadata={"help": "seconds in-flight RPCs get on SIGTERM"})
    min_refit_interval_s: float = field(default=1.0, metadata={"help": "at most one model refit per this many seconds"})

    def __post_init__(self) -> None:
        if not self.listen:
            raise SpecError("listen", "required")
        if not self.state_dir:
            raise SpecError("state_dir", "required")
        if self.min_refit_interval_s < 0:
            raise SpecError("min_refit_interval_s", f"must be >= 0, got {self.min_refit_interval_s}")
        if self.grace_s < 0:
            raise SpecError("grace_s", f"must be >= 0, got {self.grace_s}")
