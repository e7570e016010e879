"""Device samplers: each ``sample()`` returns "device" measurements (unnumbered).

- ``CpuSampler``: per-core utilisation from /proc/stat (busy share of the jiffies since
  the previous sample) and memory from /proc/meminfo. Memory is the MACHINE's used memory
  (MemTotal - MemAvailable), reported as ``mem_used_bytes`` with ``mem_total_bytes``:
  on a shared host it includes other nodes' processes.
- ``NvmlSampler``: per GPU, SM utilisation, memory used, SM clock and power through an
  injected NVML module (``pynvml`` by default); a figure NVML does not support is left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from tessera.api.v1 import profiler_pb2


class Sampler(Protocol):
    def sample(self) -> list[profiler_pb2.Measurement]: ...


def parse_proc_stat(text: str) -> dict[str, tuple[int, int]]:
    """``{"cpu": (busy, total), "cpu0": ..., ...}`` in jiffies since boot. Busy is
    everything but idle and iowait; guest time is already inside user/nice."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        parts = line.split()
        nums = [int(x) for x in parts[1:9]]
        nums += [0] * (8 - len(nums))
        total = sum(nums)
        idle = nums[3] + nums[4]
        out[parts[0]] = (total - idle, total)
    return out


def utilisation(prev: dict[str, tuple[int, int]], cur: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Busy share (0..1) per cpu line between two ``parse_proc_stat`` readings; lines
    absent from ``prev`` or without elapsed time are left out."""
    out = {}
    for name, (busy, total) in cur.items():
        if name not in prev:
            continue
        db, dt = busy - prev[name][0], total - prev[name][1]
        if dt > 0:
            out[name] = min(1.0, max(0.0, db / dt))
    return out


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes per key."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key] = int(fields[0]) * (1024 if len(fields) > 1 and fields[1] == "kB" else 1)
    return out


class CpuSampler:
    def __init__(self, node: str, proc: str | Path = "/proc") -> None:
        self.node = node
        self.proc = Path(proc)
        self._prev = parse_proc_stat((self.proc / "stat").read_text())

    def sample(self) -> list[profiler_pb2.Measurement]:
        cur = parse_proc_stat((self.proc / "stat").read_text())
        util = utilisation(self._prev, cur)
        self._prev = cur
        m = profiler_pb2.Measurement(node=self.node, kind="device", device_id="cpu")
        if "cpu" in util:
            m.values["cpu_util"] = util["cpu"]
        for name, u in util.items():
            if name != "cpu":
                m.values[f"{name}_util"] = u  # e.g. cpu3_util
        mem = parse_meminfo((self.proc / "meminfo").read_text())
        if "MemTotal" in mem and "MemAvailable" in mem:
            m.values["mem_used_bytes"] = float(mem["MemTotal"] - mem["MemAvailable"])
            m.values["mem_total_bytes"] = float(mem["MemTotal"])
        m.labels["cores"] = str(sum(1 for n in cur if n != "cpu"))
        return [m]


class NvmlSampler:
    """Use ``NvmlSampler.create(node, nvml)``: None when NVML is absent or sees no GPU."""

    def __init__(self, node: str, nvml: Any, handles: list[Any]) -> None:
        self.node = node
        self.nvml = nvml
        self.handles = handles

    @classmethod
    def create(cls, node: str, nvml: Any = None) -> "NvmlSampler | None":
        try:
            if nvml is None:
                import pynvml as nvml  # noqa: N813
            nvml.nvmlInit()
            n = nvml.nvmlDeviceGetCount()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        except Exception:
            return None
        return cls(node, nvml, handles) if handles else None

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except Exception:
            return None

    def sample(self) -> list[profiler_pb2.Measurement]:
        nv = self.nvml
        out = []
        for i, h in enumerate(self.handles):
            m = profiler_pb2.Measurement(node=self.node, kind="device", device_id=f"gpu{i}")
            util = self._try(nv.nvmlDeviceGetUtilizationRates, h)
            if util is not None:
                m.values["sm_util"] = util.gpu / 100.0
                m.values["mem_util"] = util.memory / 100.0
            mem = self._try(nv.nvmlDeviceGetMemoryInfo, h)
            if mem is not None:
                m.values["mem_used_bytes"] = float(mem.used)
                m.values["mem_total_bytes"] = float(mem.total)
            clock = self._try(nv.nvmlDeviceGetClockInfo, h, getattr(nv, "NVML_CLOCK_SM", 1))
            if clock is not None:
                m.values["sm_clock_mhz"] = float(clock)
            power = self._try(nv.nvmlDeviceGetPowerUsage, h)
            if power is not None:
                m.values["power_w"] = power / 1000.0
            uuid = self._try(nv.nvmlDeviceGetUUID, h)
            if uuid is not None:
                m.labels["uuid"] = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            out.append(m)
        return out

    def close(self) -> None:
        self._try(self.nvml.nvmlShutdown)
