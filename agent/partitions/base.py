"""The partition interface shared by every backend, and its pure capacity ledger.

A *partition* is a share-able slice of one local device that the controller allocates
by id: a CPU core set, a GPU under MPS, a MIG instance, or a time-sliced device. Each
partition has ``capacity_units`` of one unit kind (cores, SM percent, MIG instance,
slots) and optionally a memory budget. A *grant* is one executor's share of one
partition: a number of units plus memory, turned by the backend into what the process
needs (environment variables, a thread count, CPU affinity).

Contract of every backend (:class:`PartitionBackend`):

- ``partitions()`` describes what can be granted (for registration with the controller).
- ``grant(grant_id, partition_id, units, memory_bytes)`` is idempotent per ``grant_id``
  (same id and amounts: same grant back) and refuses anything beyond the partition's
  free capacity with :class:`CapacityRefused` — the agent's second check after the
  controller's, so an allocation is never applied beyond capacity even if the
  controller's view was stale.
- ``release(grant_id)`` frees the units; unknown ids are ignored (release is retried).
- ``regrant(grant_id, units)`` changes a held grant's units in place when the backend is
  ``live_regrant`` (CPU core sets); same refusals as ``grant`` (the grant's own units count
  as free), :class:`NotLive` otherwise, and a refusal changes nothing.

The accounting (:class:`Ledger`) is pure: no I/O, no clock, so it is tested exhaustively
and every backend shares the same refusal rules and messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class PartitionError(Exception):
    """Base of every error raised by a partition backend."""


class CapacityRefused(PartitionError):
    """A grant asked for more than the partition has free. Carries the numbers so the
    agent can answer the controller precisely (RESOURCE_EXHAUSTED / FAILED_PRECONDITION)."""

    def __init__(self, partition_id: str, kind: str, resource: str, asked: int, free: int, capacity: int,
                 unit: str) -> None:
        self.partition_id, self.kind, self.resource = partition_id, kind, resource
        self.asked, self.free, self.capacity, self.unit = asked, free, capacity, unit
        super().__init__(
            f"partition {partition_id} ({kind}): asked {asked} {unit} of {resource} but only {free} of "
            f"{capacity} {unit} are free; refusing to oversubscribe it")


class UnknownPartition(PartitionError):
    """The partition id is not one of this backend's partitions."""


class BadGrant(PartitionError):
    """A malformed request: non-positive units, a grant id reused with other amounts."""


class NotLive(PartitionError):
    """The partition's mechanism cannot change a running grant's quota in place (MPS, MIG,
    time slices): the caller checkpoints and relaunches with the new quota instead."""


@dataclass(frozen=True)
class PartitionInfo:
    """What the agent reports to the controller for one partition.

    ``capacity_units`` counts ``unit`` (``cores`` | ``sm_percent`` | ``instance`` |
    ``slots``); ``memory_bytes`` is the memory budget (0: not accounted). ``free_*``
    are the amounts not granted right now.
    """

    id: str
    kind: str
    device_id: str
    capacity_units: int
    unit: str
    memory_bytes: int = 0
    free_units: int = 0
    free_memory_bytes: int = 0
    attributes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"id": self.id, "kind": self.kind, "device_id": self.device_id,
                "capacity_units": self.capacity_units, "unit": self.unit, "memory_bytes": self.memory_bytes,
                "free_units": self.free_units, "free_memory_bytes": self.free_memory_bytes,
                "attributes": dict(self.attributes)}


def _no_preexec() -> None:
    return None


@dataclass(frozen=True)
class Grant:
    """One executor's share of one partition and how to apply it to the process.

    ``env`` is merged into the executor's environment (it wins over inherited values);
    ``threads`` is the torch/OpenMP thread count (None: leave as is); ``cores`` is the CPU
    affinity (empty: leave as is). ``preexec`` applies the affinity in the child before
    exec; :meth:`pin` applies it to an already started pid, which is the safe choice in
    a process that runs gRPC threads (fork without exec may deadlock there).
    """

    grant_id: str
    partition_id: str
    kind: str
    device_id: str
    units: int
    memory_bytes: int = 0
    env: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    cores: tuple[int, ...] = ()

    @property
    def preexec(self) -> Callable[[], None]:
        """A ``preexec_fn`` for subprocess: pins the child to ``cores`` (no-op without)."""
        if not self.cores:
            return _no_preexec
        cores = set(self.cores)
        return lambda: os.sched_setaffinity(0, cores)

    def pin(self, pid: int) -> None:
        """Pin a started process (and the threads it creates later) to ``cores``."""
        if self.cores:
            os.sched_setaffinity(pid, set(self.cores))

    def apply_env(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with this grant's variables (and OMP_NUM_THREADS) applied; a copy."""
        out = dict(env)
        out.update(self.env)
        if self.threads is not None:
            out["OMP_NUM_THREADS"] = str(self.threads)
        return out


@runtime_checkable
class PartitionBackend(Protocol):
    """One device's partitions. See the module docstring for the contract."""

    kind: str
    device_id: str

    def partitions(self) -> list[PartitionInfo]:
        """Every partition of this device with its capacity and free amounts."""
        ...

    def grant(self, grant_id: str, partition_id: str, units: int, memory_bytes: int = 0) -> Grant:
        """Reserve ``units`` (+ ``memory_bytes``) of ``partition_id`` for ``grant_id``;
        raises CapacityRefused, UnknownPartition or BadGrant and then changes nothing."""
        ...

    def release(self, grant_id: str) -> Grant | None:
        """Free ``grant_id``'s share; returns it, or None if it was not held."""
        ...

    def grants(self) -> list[Grant]:
        """Grants held now."""
        ...

    def start(self) -> None:
        """Bring up what the partitions need (MPS daemon); a no-op for most backends."""
        ...

    def stop(self) -> None:
        """Tear down what ``start`` brought up; idempotent."""
        ...


@dataclass
class _Held:
    units: int
    memory_bytes: int


class Ledger:
    """Pure per-partition accounting: units and memory summed over grants, never above
    capacity. ``memory_bytes == 0`` on the partition means memory is not accounted."""

    def __init__(self, partition_id: str, kind: str, capacity_units: int, unit: str, memory_bytes: int = 0) -> None:
        if capacity_units <= 0:
            raise ValueError(f"partition {partition_id}: capacity must be positive, got {capacity_units}")
        self.partition_id, self.kind, self.unit = partition_id, kind, unit
        self.capacity_units, self.memory_bytes = capacity_units, memory_bytes
        self.held: dict[str, _Held] = {}

    @property
    def used_units(self) -> int:
        return sum(h.units for h in self.held.values())

    @property
    def used_memory(self) -> int:
        return sum(h.memory_bytes for h in self.held.values())

    @property
    def free_units(self) -> int:
        return self.capacity_units - self.used_units

    @property
    def free_memory(self) -> int:
        return self.memory_bytes - self.used_memory if self.memory_bytes else 0

    def check(self, grant_id: str, units: int, memory_bytes: int = 0) -> bool:
        """Raise unless ``grant_id`` may hold ``units`` + ``memory_bytes``. Returns True
        when ``grant_id`` already holds exactly that (an idempotent repeat)."""
        if units <= 0:
            raise BadGrant(f"partition {self.partition_id}: units must be positive, got {units}")
        if memory_bytes < 0:
            raise BadGrant(f"partition {self.partition_id}: memory_bytes must be >= 0, got {memory_bytes}")
        have = self.held.get(grant_id)
        if have is not None:
            if (have.units, have.memory_bytes) == (units, memory_bytes):
                return True
            raise BadGrant(f"partition {self.partition_id}: grant {grant_id} already holds {have.units} {self.unit}"
                           f" and {have.memory_bytes} bytes; release it before asking {units} and {memory_bytes}")
        if units > self.free_units:
            raise CapacityRefused(self.partition_id, self.kind, "compute", units, self.free_units,
                                  self.capacity_units, self.unit)
        if memory_bytes and self.memory_bytes and memory_bytes > self.free_memory:
            raise CapacityRefused(self.partition_id, self.kind, "memory", memory_bytes, self.free_memory,
                                  self.memory_bytes, "bytes")
        return False

    def take(self, grant_id: str, units: int, memory_bytes: int = 0) -> None:
        """Record the grant (after :meth:`check`)."""
        if not self.check(grant_id, units, memory_bytes):
            self.held[grant_id] = _Held(units, memory_bytes)

    def give(self, grant_id: str) -> bool:
        return self.held.pop(grant_id, None) is not None

    def info(self, device_id: str, attributes: dict[str, str] | None = None) -> PartitionInfo:
        return PartitionInfo(self.partition_id, self.kind, device_id, self.capacity_units, self.unit,
                             self.memory_bytes, self.free_units, self.free_memory, dict(attributes or {}))


class LedgerBackend:
    """Shared plumbing for backends whose partitions are :class:`Ledger` values: routing
    by partition id, idempotent grants, release. Subclasses build ``self.ledgers`` and
    implement :meth:`_make_grant` (what the process gets) and may override
    :meth:`_attributes`."""

    kind = "abstract"

    def __init__(self, device_id: str) -> None:
        self.device_id = device_id
        self.ledgers: dict[str, Ledger] = {}
        self._grants: dict[str, Grant] = {}

    def partitions(self) -> list[PartitionInfo]:
        return [led.info(self.device_id, self._attributes(pid)) for pid, led in self.ledgers.items()]

    def _attributes(self, partition_id: str) -> dict[str, str]:
        return {}

    def _ledger(self, partition_id: str) -> Ledger:
        try:
            return self.ledgers[partition_id]
        except KeyError:
            raise UnknownPartition(f"unknown partition {partition_id!r} on {self.device_id} "
                                   f"(has {', '.join(self.ledgers) or 'none'})") from None

    def grant(self, grant_id: str, partition_id: str, units: int, memory_bytes: int = 0) -> Grant:
        led = self._ledger(partition_id)
        old = self._grants.get(grant_id)
        if old is not None and old.partition_id != partition_id:
            raise BadGrant(f"grant {grant_id} already holds partition {old.partition_id}; release it first")
        if led.check(grant_id, units, memory_bytes):
            return self._grants[grant_id]
        g = self._make_grant(grant_id, partition_id, units, memory_bytes)
        led.take(grant_id, units, memory_bytes)
        self._grants[grant_id] = g
        return g

    def _make_grant(self, grant_id: str, partition_id: str, units: int, memory_bytes: int) -> Grant:
        raise NotImplementedError

    # Whether a held grant's units can change while its process runs (see ``regrant``).
    live_regrant = False

    def regrant(self, grant_id: str, units: int) -> Grant:
        """Change held grant ``grant_id`` to ``units`` (memory unchanged) and return the new
        grant. Raises KeyError when not held, :class:`NotLive` when this backend cannot do
        it in place, :class:`BadGrant` for units < 1, :class:`CapacityRefused` when the
        partition's free units plus the grant's own do not cover ``units``; any refusal
        leaves the ledger and the grant as they were."""
        old = self._grants.get(grant_id)
        if old is None:
            raise KeyError(f"grant {grant_id} is not held on {self.device_id}")
        if not self.live_regrant:
            raise NotLive(f"partition {old.partition_id} ({self.kind}) cannot change a running grant's quota in "
                          f"place; checkpoint and relaunch with the new quota")
        led = self.ledgers[old.partition_id]
        held = led.held.pop(grant_id)
        del self._grants[grant_id]
        try:
            led.check(grant_id, units, held.memory_bytes)
            g = self._remake_grant(old, units)
        except BaseException:
            led.held[grant_id] = held
            self._grants[grant_id] = old
            raise
        led.take(grant_id, units, held.memory_bytes)
        self._grants[grant_id] = g
        return g

    def _remake_grant(self, old: Grant, units: int) -> Grant:
        """The grant ``old`` becomes with ``units`` (``old`` is already out of the books)."""
        return self._make_grant(old.grant_id, old.partition_id, units, old.memory_bytes)

    def release(self, grant_id: str) -> Grant | None:
        g = self._grants.pop(grant_id, None)
        if g is not None:
            self.ledgers[g.partition_id].give(grant_id)
        return g

    def grants(self) -> list[Grant]:
        return list(self._grants.values())

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None
