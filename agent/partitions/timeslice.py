"""Time slicing: several executors share one device with no quota at all.

The device's own scheduler (CUDA time slicing on a GPU, the kernel on a core set)
interleaves them; nothing isolates memory or compute, so the only accounting is a
configured number of slots — the most executors the operator lets share the device.
"""

from __future__ import annotations

from agent.devices import LocalDevice

from .base import Grant, LedgerBackend, Ledger


class TimeSliceBackend(LedgerBackend):
    """One partition per device (id = the device id) of ``slots`` slots. A GPU grant
    gets CUDA_VISIBLE_DEVICES (by UUID); a CPU grant gets the whole core set's affinity
    and thread count (the slots share those cores)."""

    kind = "timeslice"

    def __init__(self, device: LocalDevice, slots: int = 4) -> None:
        super().__init__(device.id)
        if slots <= 0:
            raise ValueError(f"timeslice slots must be positive, got {slots}")
        self.device = device
        self.slots = slots
        self.ledgers[device.id] = Ledger(device.id, self.kind, slots, "slots", device.memory_bytes)

    def _attributes(self, partition_id: str) -> dict[str, str]:
        return {"device_kind": self.device.kind, "uuid": self.device.uuid}

    def _make_grant(self, grant_id: str, partition_id: str, units: int, memory_bytes: int) -> Grant:
        d = self.device
        if d.kind == "gpu":
            env = {"CUDA_VISIBLE_DEVICES": d.uuid or str(d.index)}
            return Grant(grant_id, partition_id, self.kind, d.id, units, memory_bytes, env=env)
        cores = tuple(sorted(d.cores))
        env = {"CUDA_VISIBLE_DEVICES": "", "TESSERA_CPU_CORES": ",".join(map(str, cores)),
               "OMP_NUM_THREADS": str(max(1, len(cores)))}
        return Grant(grant_id, partition_id, self.kind, d.id, units, memory_bytes, env=env,
                     threads=max(1, len(cores)), cores=cores)
