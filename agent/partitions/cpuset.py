"""CPU core-set partitions: a partition is a set of cores; a grant gets specific cores.

A grant of ``units`` cores gets that many *distinct* cores of the set (lowest free
first, contiguous when possible so that colocated grants do not interleave on shared
caches), CPU affinity to exactly them, and a torch/OpenMP thread count equal to their
number — more threads than cores only adds context switches.

With ``units_per_core`` k > 1 (agent ``--cpu-units-per-core``; 1 by default) each
physical core counts as k units: the partition's capacity is cores x k, a grant takes
``units`` distinct *units* (lowest free first, contiguous when possible), unit u lies on
core ``u // k`` (core c holds units c*k .. c*k + k - 1), and the grant's affinity is the physical cores of its units
(so two grants may share a core). The thread count stays ``units``. This declares a
core set larger than the machine, for testbeds on machines with few cores; with k = 1
(the default) a unit is a core and nothing changes.
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
        if device.units_per_core < 1:
            raise ValueError(f"device {device.id}: units_per_core must be >= 1, got {device.units_per_core}")
        super().__init__(device.id)
        self.device = device
        self.cores = tuple(sorted(set(device.cores)))
        self.per_core = device.units_per_core
        # Unit u lies on core u // per_core (per_core = 1: the units are the core ids).
        self.units = tuple(c * self.per_core + j for c in self.cores for j in range(self.per_core))
        self._units: dict[str, tuple[int, ...]] = {}  # grant id -> its units
        self.ledgers[device.id] = Ledger(device.id, self.kind, len(self.units), "cores", device.memory_bytes)
        self.log = log.get(component="partitions", backend=self.kind, device_id=device.id)

    def _attributes(self, partition_id: str) -> dict[str, str]:
        out = {"cores": ",".join(map(str, self.cores))}
        if self.per_core > 1:
            out["units_per_core"] = str(self.per_core)
        return out

    def _cores_of(self, units: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted({u // self.per_core for u in units}))

    def _used_units(self) -> set[int]:
        """Units of the grants held now (a grant being remade is already out of ``_grants``)."""
        return {u for gid in self._grants for u in self._units.get(gid, ())}

    # Core sets change live: the agent re-pins the running process (sched_setaffinity).
    live_regrant = True

    def _make_grant(self, grant_id: str, partition_id: str, units: int, memory_bytes: int) -> Grant:
        mine = pick_cores(self.units, self._used_units(), units)
        g = self._grant_of(grant_id, partition_id, units, memory_bytes, mine)
        self.log.info("cpuset granted", grant_id=grant_id, cores=list(g.cores), **self._unit_fields(mine))
        return g

    def _unit_fields(self, units: tuple[int, ...]) -> dict:
        return {"units": list(units)} if self.per_core > 1 else {}

    def _grant_of(self, grant_id: str, partition_id: str, units: int, memory_bytes: int,
                  mine: tuple[int, ...]) -> Grant:
        self._units[grant_id] = mine
        cores = self._cores_of(mine)
        return Grant(grant_id, partition_id, self.kind, self.device_id, units, memory_bytes,
                     env={"OMP_NUM_THREADS": str(units), "TESSERA_CPU_CORES": ",".join(map(str, cores)),
                          "CUDA_VISIBLE_DEVICES": ""},
                     threads=units, cores=cores)

    def _remake_grant(self, old: Grant, units: int) -> Grant:
        """Keep the grant's lowest cores (units) when it shrinks, add the lowest free ones
        when it grows: the running process keeps the caches it warmed. ``threads`` is the
        new core count, but a running process keeps the thread pool it started with."""
        have = self._units.get(old.grant_id, ())
        if units <= len(have):
            mine = tuple(sorted(have)[:units])
        else:
            used = self._used_units() | set(have)
            mine = tuple(sorted(set(have) | set(pick_cores(self.units, used, units - len(have)))))
        try:
            g = self._grant_of(old.grant_id, old.partition_id, units, old.memory_bytes, mine)
        except BaseException:
            self._units[old.grant_id] = have
            raise
        self.log.info("cpuset regranted", grant_id=old.grant_id, old_cores=list(old.cores), cores=list(g.cores),
                      **self._unit_fields(mine))
        return g

    def release(self, grant_id: str) -> Grant | None:
        g = super().release(grant_id)
        if g is not None:
            self._units.pop(grant_id, None)
        return g
