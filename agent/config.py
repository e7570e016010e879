"""The agent's typed configuration (flag > env TESSERA_AGENT_* > --config file)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AgentConfig:
    name: str = field(default_factory=lambda: socket.gethostname().lower().split(".")[0],
                      metadata={"help": "node name, unique in the cluster (default: host name)"})
    listen: str = field(default="127.0.0.1:50061", metadata={"help": "AgentService listen address HOST:PORT"})
    advertise: str = field(default="", metadata={"help": "address the controller dials (default: --listen)"})
    controller: str = field(default="127.0.0.1:50051", metadata={"help": "controller address HOST:PORT"})
    cpu_devices: int = field(default=1, metadata={"help": "without NVIDIA GPUs: split this machine's cores into N core sets"})
    cpu_units_per_core: int = field(default=1, metadata={
        "help": "units (schedulable \"cores\") per physical core of a CPU core set; >1 declares core sets larger than "
                "the machine (each core counted that many times; a grant runs on the physical cores of its units), "
                "for testbeds on machines with few cores"})
    state_dir: str = field(default=".tessera/agent", metadata={"help": "spec files, logs and default checkpoints"})
    profilerd: str = field(default="", metadata={"help": "this node's profilerd HOST:PORT (optional)"})
    stop_grace_s: float = field(default=10.0, metadata={"help": "SIGTERM to SIGKILL delay when stopping executors"})
    report_interval_s: float = field(default=0.5, metadata={"help": "at most one progress report per executor this often"})
    disable_nvml: bool = field(default=False, metadata={"help": "ignore NVIDIA GPUs even if NVML finds some"})
    partition_mode: str = field(default="auto", metadata={
        "help": "partitions per device: auto (cpuset on CPUs; MIG if enabled, else MPS if installed, else "
                "time slicing on GPUs) | cpuset | mps | mig | timeslice; an explicit mode that cannot apply is an error"})
    timeslice_slots: int = field(default=4, metadata={"help": "executors per GPU under time slicing"})
    fault_poll_s: float = field(default=1.0, metadata={"help": "how often MPS server logs are polled for fatal faults"})
    executor_zygote: bool = field(default=True, metadata={
        "help": "fork CPU executors from a warm fork server that imported torch once (they start in milliseconds "
                "instead of seconds); off: every executor is a fresh Python process"})
    stall_timeout_s: float = field(default=600.0, metadata={
        "help": "kill an executor whose training made no progress for this long (or 20x its longest step, if "
                "longer) after its first step — a hung collective, a deadlock — after dumping its thread stacks "
                "into its log; 0: never"})
