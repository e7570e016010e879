"""profilerd's typed configuration (flag > env TESSERA_PROFILERD_* > --config file)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from tessera.errors import SpecError

# Serialized; ReportStep refuses larger (profilerd.api), and buffer_bytes may not be
# smaller, so any measurement ReportStep accepts fits the buffer.
MAX_MEASUREMENT_BYTES = 256 << 10


@dataclass(frozen=True)
class ProfilerdConfig:
    node: str = field(default_factory=lambda: socket.gethostname().lower().split(".")[0],
                      metadata={"help": "node name (default: host name); the stream's source is profilerd/NODE"})
    listen: str = field(default="127.0.0.1:50062", metadata={"help": "ProfilerService listen address HOST:PORT"})
    estimator: str = field(default="", metadata={"help": "estimator HOST:PORT; empty: buffer only"})
    sample_interval_s: float = field(default=1.0, metadata={"help": "device sampling period, seconds (0: no sampling)"})
    buffer_size: int = field(default=10000, metadata={"help": "measurements kept until acknowledged; beyond, the oldest is dropped"})
    buffer_bytes: int = field(default=64 << 20, metadata={"help": "serialized bytes of the measurements kept until acknowledged (default 64 MiB); beyond, the oldest are dropped"})
    state_dir: str = field(default=".tessera/profilerd", metadata={"help": "state directory (seq reservation)"})
    flush_interval_s: float = field(default=0.5, metadata={"help": "at most one ReportMeasurements call this often"})
    batch_size: int = field(default=256, metadata={"help": "measurements per MeasurementBatch message"})
    reconnect_max_s: float = field(default=5.0, metadata={"help": "cap of the exponential reconnect backoff"})
    grace_s: float = field(default=3.0, metadata={"help": "seconds in-flight RPCs and the last flush get on SIGTERM"})
    disable_nvml: bool = field(default=False, metadata={"help": "do not sample NVIDIA GPUs even if NVML is present"})
    comm_benchmark: bool = field(default=False, metadata={"help": "run the gloo loopback communication micro-benchmark once at start and report its table (kind comm)"})
    comm_link: str = field(default="loopback-gloo", metadata={"help": "link type the micro-benchmark's rows are filed under"})
    colocation_benchmark: bool = field(default=False, metadata={"help": "run the colocation micro-benchmark (a GPT module alone and beside its twin on another core and on its own core, then as one job's 2-stage pipeline on the two cores: python -m profilerd.colobench) once at start, after the comm benchmark, and report its pairs (kind colocation, device kind cpu) and the pipeline (kind ranks, under comm_link)"})

    def __post_init__(self) -> None:
        for name in ("node", "listen", "state_dir"):
            if not getattr(self, name):
                raise SpecError(name, "required")
        if self.buffer_size <= 0:
            raise SpecError("buffer_size", f"must be positive, got {self.buffer_size}")
        if self.buffer_bytes < MAX_MEASUREMENT_BYTES:
            raise SpecError("buffer_bytes", f"must be at least {MAX_MEASUREMENT_BYTES} (the largest measurement "
                                            f"ReportStep accepts), got {self.buffer_bytes}")
        if self.batch_size <= 0:
            raise SpecError("batch_size", f"must be positive, got {self.batch_size}")
        for name in ("sample_interval_s", "flush_interval_s", "grace_s"):
            if getattr(self, name) < 0:
                raise SpecError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.reconnect_max_s <= 0:
            raise SpecError("reconnect_max_s", f"must be positive, got {self.reconnect_max_s}")
