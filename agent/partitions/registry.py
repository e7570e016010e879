"""Backend selection per device, and :class:`Partitions`: the one object the agent holds.

``select_kind(device, mode, ...)`` is the pure rule; ``make_backend`` builds the backend;
``Partitions`` routes grants by partition id, reports every partition's capacity, and
starts/stops what the backends need (MPS daemons).

Mode ``auto``: a CPU core set -> ``cpuset``; a GPU with MIG enabled -> ``mig`` (MIG
already partitions it in hardware; MPS and time slicing would ignore the instances);
a GPU where the MPS control binary is installed -> ``mps``; any other GPU ->
``timeslice``. An explicit mode that cannot apply (``mps`` or ``mig`` on a CPU,
``cpuset`` on a GPU, ``mig`` with MIG off) is an error, not a silent fallback: the
operator asked for quotas that would not exist.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from agent.devices import LocalDevice
from tessera import log

from .base import BadGrant, Grant, PartitionBackend, PartitionError, PartitionInfo, UnknownPartition
from .cpuset import CpusetBackend
from .mig import MigBackend, MigManager
from .mps import MPS_CONTROL, MpsBackend
from .timeslice import TimeSliceBackend

MODES = ("auto", "cpuset", "mps", "mig", "timeslice")


def select_kind(device: LocalDevice, mode: str = "auto", *, mig_enabled: bool = False, mps_available: bool = False) -> str:
    """The backend kind for ``device`` under ``mode`` (see the module docstring). Pure:
    the caller says whether MIG is enabled on the GPU and whether MPS is installed."""
    if mode not in MODES:
        raise ValueError(f"partition mode must be one of {', '.join(MODES)}, got {mode!r}")
    gpu = device.kind == "gpu"
    if mode == "auto":
        if not gpu:
            return "cpuset"
        return "mig" if mig_enabled else "mps" if mps_available else "timeslice"
    if mode == "cpuset" and gpu:
        raise ValueError(f"device {device.id}: cpuset partitions need a CPU core set, not a GPU")
    if mode in ("mps", "mig") and not gpu:
        raise ValueError(f"device {device.id}: {mode} partitions need an NVIDIA GPU")
    if mode == "mig" and not mig_enabled:
        raise ValueError(f"device {device.id}: MIG mode is not enabled on this GPU (Tessera never enables it)")
    return mode


def make_backend(device: LocalDevice, mode: str = "auto", *, state_dir: str | Path = ".tessera/agent",
                 nvml=None, mig_allow_changes: bool = False, mps_binary: str = MPS_CONTROL,
                 timeslice_slots: int = 4) -> PartitionBackend:
    """Build the backend for one device. ``nvml`` (pynvml by default) is only touched
    for GPUs, to read MIG mode; nothing here changes device state."""
    mig_mgr = None
    mig_enabled = False
    if device.kind == "gpu" and mode in ("auto", "mig"):
        if nvml is None:
            import pynvml as nvml  # noqa: PLW0127 - the real binding
        mig_mgr = MigManager(nvml, allow_changes=mig_allow_changes)
        try:
            mig_enabled = mig_mgr.state(device.index).enabled
        except Exception as e:  # NVML missing or failing: not MIG, say why
            log.get(component="partitions").warning("cannot read MIG mode", device_id=device.id, error=str(e))
    mps_available = shutil.which(mps_binary) is not None
    kind = select_kind(device, mode, mig_enabled=mig_enabled, mps_available=mps_available)
    if kind == "cpuset":
        return CpusetBackend(device)
    if kind == "timeslice":
        return TimeSliceBackend(device, timeslice_slots)
    if kind == "mps":
        return MpsBackend(device, Path(state_dir), mps_binary)
    assert mig_mgr is not None
    return MigBackend(device, mig_mgr)


class Partitions:
    """Every partition of this node, across its devices' backends.

    - ``describe()``: PartitionInfo for each partition (register/heartbeat payload).
    - ``grant(grant_id, partition_id, units, memory_bytes)``: the agent's second capacity
      check; raises CapacityRefused / UnknownPartition / BadGrant and changes nothing.
    - ``release(grant_id)``: idempotent.
    - ``start()``/``stop()``: bring backends up/down (MPS daemons); stop is idempotent.
    """

    def __init__(self, backends: list[PartitionBackend]) -> None:
        self.backends = {b.device_id: b for b in backends}
        self.log = log.get(component="partitions")

    @classmethod
    def for_devices(cls, devices: list[LocalDevice], mode: str = "auto", **kw) -> Partitions:
        """One backend per device via :func:`make_backend` (same keyword arguments)."""
        return cls([make_backend(d, mode, **kw) for d in devices])

    def backend_of(self, partition_id: str) -> PartitionBackend:
        for b in self.backends.values():
            if any(p.id == partition_id for p in b.partitions()):
                return b
        known = [p.id for b in self.backends.values() for p in b.partitions()]
        raise UnknownPartition(f"unknown partition {partition_id!r} (this node has {', '.join(known) or 'none'})")

    def describe(self) -> list[PartitionInfo]:
        return [p for b in self.backends.values() for p in b.partitions()]

    def grant(self, grant_id: str, partition_id: str, units: int, memory_bytes: int = 0) -> Grant:
        holder = self.find(grant_id)
        if holder is not None and holder.partition_id != partition_id:
            raise BadGrant(f"grant {grant_id} already holds partition {holder.partition_id}; release it first")
        g = self.backend_of(partition_id).grant(grant_id, partition_id, units, memory_bytes)
        self.log.info("partition granted", grant_id=grant_id, partition_id=partition_id, kind=g.kind,
                      units=units, memory_bytes=memory_bytes)
        return g

    def release(self, grant_id: str) -> Grant | None:
        for b in self.backends.values():
            g = b.release(grant_id)
            if g is not None:
                self.log.info("partition released", grant_id=grant_id, partition_id=g.partition_id)
                return g
        return None

    def regrant(self, grant_id: str, units: int) -> Grant:
        """Change held grant ``grant_id`` to ``units`` in place (see ``LedgerBackend.regrant``:
        KeyError when not held, NotLive, BadGrant, CapacityRefused; a refusal changes nothing)."""
        for b in self.backends.values():
            if any(g.grant_id == grant_id for g in b.grants()):
                old = self.find(grant_id)
                g = b.regrant(grant_id, units)
                self.log.info("partition regranted", grant_id=grant_id, partition_id=g.partition_id, kind=g.kind,
                              old_units=old.units if old else 0, units=units)
                return g
        raise KeyError(f"grant {grant_id} is not held on this node")

    def find(self, grant_id: str) -> Grant | None:
        for b in self.backends.values():
            for g in b.grants():
                if g.grant_id == grant_id:
                    return g
        return None

    def grants(self) -> list[Grant]:
        return [g for b in self.backends.values() for g in b.grants()]

    def start(self) -> None:
        """Start every backend; when one fails, stop it (what it may have left half started,
        e.g. an MPS daemon whose pipe never appeared) and those started before it, then raise."""
        touched = []
        try:
            for b in self.backends.values():
                touched.append(b)
                b.start()
        except Exception:
            for b in reversed(touched):
                try:
                    b.stop()
                except PartitionError as e:
                    self.log.warning("partition backend stop failed", device_id=b.device_id, error=str(e))
            raise

    def stop(self) -> None:
        for b in self.backends.values():
            try:
                b.stop()
            except PartitionError as e:
                # Keep stopping the others: a daemon left behind is worse than a log line.
                self.log.warning("partition backend stop failed", device_id=b.device_id, error=str(e))
