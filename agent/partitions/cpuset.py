"""CPU core-set partitions: a partition is a set of cores; a grant gets specific cores.

A grant of ``units`` cores gets that many *distinct* cores of the set (lowest free
first, contiguous when possible so that colocated grants do not interleave on shared
caches), CPU affinity to exactly them, and a torch/OpenMP thread count equal to their
number — more threads than cores only adds context switches.
"""

from __future__ import annotations

from agent.devices import LocalDevice
from tessera import log

from .base import Grant, LedgerBackend, Ledger


def pick_cores(cores: tuple[int, ...], used: set[int], n: int) -> tuple[int, ...]:
    """``n`` free cores of ``cores``: the lowest contiguous run if one exists, else the
    lowest free ones. Pure; the caller has checked that ``n`` are free."""
    free = [c for c in sorted(cores) if c not in used]
    if n > len(free):
        raise ValueError(f"asked {n} cores, {len(free)} free")
    for i in range(len(free) - n + 1):
        run = free[i:i + n]
        if run[-1] - run[0] == n - 1:
            return tuple(run)
    return tuple(free[:n])


class CpusetBackend(LedgerBackend):
    """One CPU core-set device = one partition (id = the device id), capacity = its cores.

    Memory is accounted only when a grant asks for some (``memory_bytes`` > 0) against the
    device's share of RAM; nothing enforces it at run time (no cgroup here).
    """

    kind = "cpuset"

    def __init__(self, device: LocalDevice) -> None:
        if not device.cores:
            raise ValueError(f"device {device.id} has no cores; a cpuset partition needs a core set")
        super().__init__(device.id)
        self.device = device
        self.cores = tuple(sorted(set(device.cores)))
        self.ledgers[device.id] = Ledger(device.id, self.kind, len(self.cores), "cores", device.memory_bytes)
        self.log = log.get(component="partitions", backend=self.kind, device_id=device.id)

    def _attributes(self, partition_id: str) -> dict[str, str]:
        return {"cores": ",".join(map(str, self.cores))}

    # Core sets change live: the agent re-pins the running process (sched_setaffinity).
    live_regrant = True

    def _make_grant(self, grant_id: str, partition_id: str, units: int, memory_bytes: int) -> Grant:
        used = {c for g in self._grants.values() for c in g.cores}
        cores = pick_cores(self.cores, used, units)
        self.log.info("cpuset granted", grant_id=grant_id, cores=list(cores))
        return self._grant_of(grant_id, partition_id, units, memory_bytes, cores)

    def _grant_of(self, grant_id: str, partition_id: str, units: int, memory_bytes: int,
                  cores: tuple[int, ...]) -> Grant:
        return Grant(grant_id, partition_id, self.kind, self.device_id, units, memory_bytes,
                     env={"OMP_NUM_THREADS": str(units), "TESSERA_CPU_CORES": ",".join(map(str, cores)),
                          "CUDA_VISIBLE_DEVICES": ""},
                     threads=units, cores=cores)

    def _remake_grant(self, old: Grant, units: int) -> Grant:
        """Keep the grant's lowest cores when it shrinks, add the lowest free ones when it
        grows: the running process keeps the caches it warmed. ``threads`` is the new core
        count, but a running process keeps the thread pool it started with."""
        if units <= len(old.cores):
            cores = tuple(sorted(old.cores)[:units])
        else:
            used = {c for g in self._grants.values() for c in g.cores} | set(old.cores)
            cores = tuple(sorted(set(old.cores) | set(pick_cores(self.cores, used, units - len(old.cores)))))
        self.log.info("cpuset regranted", grant_id=old.grant_id, old_cores=list(old.cores), cores=list(cores))
        return self._grant_of(old.grant_id, old.partition_id, units, old.memory_bytes, cores)
