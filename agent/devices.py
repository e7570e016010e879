"""Device discovery: NVIDIA GPUs through NVML, else CPU core sets.

``discover`` returns ``LocalDevice`` values; NVML is injected (``nvml`` argument, the
``pynvml`` module by default) so the GPU path is testable with a double behind the
same interface.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LocalDevice:
    """A schedulable device of this node. ``cores`` is set for CPU core sets (physical
    core ids); ``units_per_core`` > 1 declares each of them that many schedulable units
    (``capacity`` = cores x units_per_core; see ``agent.partitions.cpuset``); ``index``
    is the NVML index of a GPU (what CUDA_VISIBLE_DEVICES takes, by UUID preferred)."""

    id: str
    kind: str
    model: str
    memory_bytes: int
    capacity: int
    cores: tuple[int, ...] = ()
    uuid: str = ""
    index: int = -1
    units_per_core: int = 1


def split_cores(cores: list[int], n: int) -> list[tuple[int, ...]]:
    """Split ``cores`` into ``n`` contiguous, near-equal sets. With fewer cores than
    sets, cores are shared round-robin (each set gets at least one core)."""
    if n <= 0:
        raise ValueError(f"cpu_devices must be positive, got {n}")
    cores = sorted(cores)
    if len(cores) < n:
        return [(cores[i % len(cores)],) for i in range(n)]
    q, r = divmod(len(cores), n)
    out, i = [], 0
    for k in range(n):
        size = q + (1 if k < r else 0)
        out.append(tuple(cores[i: i + size]))
        i += size
    return out


def _cpu_model(path: str = "/proc/cpuinfo", default: str = "cpu") -> str:
    """The first ``model name`` in ``path`` (cpuinfo format), ``default`` when it has
    none or cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default


def _mem_total() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_devices(n: int, units_per_core: int = 1) -> list[LocalDevice]:
    """``n`` core sets of this process's cores; each core counts ``units_per_core`` units."""
    if units_per_core < 1:
        raise ValueError(f"cpu_units_per_core must be >= 1, got {units_per_core}")
    cores = sorted(os.sched_getaffinity(0))
    model, mem = _cpu_model(), _mem_total()
    return [
        LocalDevice(id=f"cpu{i}", kind="cpu", model=model, memory_bytes=mem // n, capacity=len(cs) * units_per_core,
                    cores=cs, units_per_core=units_per_core)
        for i, cs in enumerate(split_cores(cores, n))
    ]


def gpu_devices(nvml) -> list[LocalDevice]:
    """GPUs seen by NVML; [] when NVML is absent or finds none."""
    try:
        nvml.nvmlInit()
    except Exception:
        return []
    out = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            uuid = nvml.nvmlDeviceGetUUID(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h).total
            out.append(LocalDevice(id=f"gpu{i}", kind="gpu", model=name.decode() if isinstance(name, bytes) else name,
                                   memory_bytes=int(mem), capacity=100,
                                   uuid=uuid.decode() if isinstance(uuid, bytes) else uuid, index=i))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return out


def discover(cpu_sets: int, use_nvml: bool = True, nvml=None, units_per_core: int = 1) -> list[LocalDevice]:
    """GPUs when NVML finds any (and ``use_nvml``), else ``cpu_sets`` CPU core sets
    (``units_per_core`` units per core)."""
    if use_nvml:
        if nvml is None:
            try:
                import pynvml as nvml  # noqa: PLW0127 - the real NVML binding
            except ImportError:
                nvml = None
        if nvml is not None:
            gpus = gpu_devices(nvml)
            if gpus:
                return gpus
    return cpu_devices(cpu_sets, units_per_core)
