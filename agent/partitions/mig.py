"""MIG partitions: list, create and destroy GPU/compute instances through NVML; an
executor addresses an instance by its MIG UUID (``CUDA_VISIBLE_DEVICES=MIG-...``).

:class:`MigManager` is **read-only by default**: ``state``/``profiles``/``instances``
only read; ``create``/``destroy`` raise :class:`MigReadOnly` unless it was built with
``allow_changes=True`` (an explicit operator choice: reconfiguring MIG kills whatever
runs in the instances destroyed). It never changes MIG mode and never resets a GPU.
NVML is injected (the ``pynvml`` module, or ``fake_nvml.FakeNvml`` in tests); each
public call brackets its work in nvmlInit/nvmlShutdown, which NVML reference-counts.

:class:`MigBackend` makes each existing MIG instance (GI + CI) of one GPU a partition of
capacity 1 instance, with the instance's memory: MIG isolates compute and memory in
hardware, so one executor per instance is the natural grant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from ctypes import byref, c_uint
from dataclasses import dataclass

from agent.devices import LocalDevice
from tessera import log

from .base import Grant, Ledger, LedgerBackend, PartitionError

MIB = 1024 * 1024
# Slice count -> the standard profile enum (GPU and compute instance tables share it).
_STD_ENUM_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


class MigError(PartitionError):
    """An NVML MIG call failed; ``code`` is the NVML return code (the NVMLError is the
    ``__cause__``)."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class MigReadOnly(MigError):
    """A create/destroy was asked of a read-only MigManager."""


@dataclass(frozen=True)
class MigProfile:
    """A GPU-instance profile: ``enum`` is the NVML_GPU_INSTANCE_PROFILE_* value passed to
    nvmlDeviceGetGpuInstanceProfileInfo, ``id`` the profile id passed to create calls."""

    enum: int
    id: int
    name: str
    slices: int
    instance_count: int
    memory_mb: int
    multiprocessors: int
    placements: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class MigInstance:
    """A usable MIG device: GPU instance ``gi_id`` with compute instance ``ci_id``."""

    uuid: str
    gpu_index: int
    gi_id: int
    ci_id: int
    profile_id: int
    profile_name: str
    slices: int
    memory_bytes: int
    placement: tuple[int, int]

    def to_dict(self) -> dict:
        return {"uuid": self.uuid, "gpu_index": self.gpu_index, "gi_id": self.gi_id, "ci_id": self.ci_id,
                "profile_id": self.profile_id, "profile": self.profile_name, "slices": self.slices,
                "memory_bytes": self.memory_bytes, "placement": list(self.placement)}


@dataclass(frozen=True)
class MigState:
    """MIG state of one GPU. ``supported`` False: the GPU has no MIG (modes are -1)."""

    gpu_index: int
    supported: bool
    current_mode: int
    pending_mode: int
    profiles: tuple[MigProfile, ...] = ()
    instances: tuple[MigInstance, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.current_mode == 1

    def to_dict(self) -> dict:
        return {"gpu_index": self.gpu_index, "supported": self.supported, "current_mode": self.current_mode,
                "pending_mode": self.pending_mode,
                "profiles": [{"id": p.id, "name": p.name, "slices": p.slices, "instance_count": p.instance_count,
                              "memory_mb": p.memory_mb, "placements": [list(x) for x in p.placements]}
                             for p in self.profiles],
                "instances": [i.to_dict() for i in self.instances]}


def free_placements(possible: tuple[tuple[int, int], ...], occupied: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Placements (start, size) of ``possible`` overlapping none of ``occupied``. Pure."""
    taken = {s for start, size in occupied for s in range(start, start + size)}
    return [(s, n) for s, n in possible if not taken & set(range(s, s + n))]


def nvml_error_name(code: int | None) -> str:
    """``NVML_ERROR_INSUFFICIENT_RESOURCES`` for 23: readable even where the library's
    own string is unavailable (the codes are NVML's, whichever binding raised them)."""
    import pynvml

    for k in dir(pynvml):
        if k.startswith("NVML_ERROR_") and getattr(pynvml, k) == code:
            return k
    return f"NVML error {code}"


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class MigManager:
    """MIG through an injected NVML. See the module docstring for the read-only rule."""

    def __init__(self, nvml, allow_changes: bool = False) -> None:
        self.nvml = nvml
        self.allow_changes = allow_changes
        self.log = log.get(component="partitions", backend="mig")

    @contextlib.contextmanager
    def _session(self) -> Iterator[None]:
        self.nvml.nvmlInit()
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()

    def _wrap(self, what: str, e: Exception) -> MigError:
        code = getattr(e, "value", None)
        return MigError(f"{what}: {nvml_error_name(code)} ({e})", code)

    # -- read --------------------------------------------------------------------------
    def state(self, gpu_index: int) -> MigState:
        """Mode, profiles (with placements) and instances of one GPU; read-only."""
        with self._session():
            h = self.nvml.nvmlDeviceGetHandleByIndex(gpu_index)
            try:
                cur, pending = self.nvml.nvmlDeviceGetMigMode(h)
            except self.nvml.NVMLError_NotSupported:
                return MigState(gpu_index, False, -1, -1)
            if cur != 1:
                return MigState(gpu_index, True, cur, pending)
            profiles = self._profiles(h)
            return MigState(gpu_index, True, cur, pending, tuple(profiles), tuple(self._instances(gpu_index, h, profiles)))

    def profiles(self, gpu_index: int) -> list[MigProfile]:
        return list(self.state(gpu_index).profiles)

    def instances(self, gpu_index: int) -> list[MigInstance]:
        return list(self.state(gpu_index).instances)

    def _profiles(self, h) -> list[MigProfile]:
        nv, out = self.nvml, []
        for enum in range(nv.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, enum)
            except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
                continue  # a profile this GPU does not offer
            out.append(MigProfile(enum, int(info.id), _s(info.name), int(info.sliceCount), int(info.instanceCount),
                                  int(info.memorySizeMB), int(info.multiprocessorCount), self._placements(h, info.id)))
        return out

    def _placements(self, h, profile_id: int) -> tuple[tuple[int, int], ...]:
        nv = self.nvml
        arr = (nv.c_nvmlGpuInstancePlacement_t * 16)()
        count = c_uint(16)
        try:
            nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, byref(count))
        except nv.NVMLError as e:
            self.log.warning("mig placements unavailable", profile_id=profile_id, error=str(e))
            return ()
        return tuple((int(arr[i].start), int(arr[i].size)) for i in range(count.value))

    def _instances(self, gpu_index: int, h, profiles: list[MigProfile]) -> list[MigInstance]:
        nv, out = self.nvml, []
        by_id = {p.id: p for p in profiles}
        for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                mh = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except nv.NVMLError_NotFound:
                continue
            gi_id, ci_id = nv.nvmlDeviceGetGpuInstanceId(mh), nv.nvmlDeviceGetComputeInstanceId(mh)
            ginfo = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceGetGpuInstanceById(h, gi_id))
            prof = by_id.get(int(ginfo.profileId))
            out.append(MigInstance(
                uuid=_s(nv.nvmlDeviceGetUUID(mh)), gpu_index=gpu_index, gi_id=int(gi_id), ci_id=int(ci_id),
                profile_id=int(ginfo.profileId), profile_name=prof.name if prof else str(ginfo.profileId),
                slices=prof.slices if prof else 0, memory_bytes=int(nv.nvmlDeviceGetMemoryInfo(mh).total),
                placement=(int(ginfo.placement.start), int(ginfo.placement.size))))
        return out

    # -- change (explicit opt-in) --------------------------------------------------------
    def _require_changes(self, what: str) -> None:
        if not self.allow_changes:
            raise MigReadOnly(f"{what}: MIG is read-only here (build MigManager with allow_changes=True to "
                              f"create or destroy instances)")

    @staticmethod
    def resolve_profile(profiles: list[MigProfile], profile: str | int) -> MigProfile:
        """A profile by id (int), full name ("3g.71gb") or slice shorthand ("3g": the
        standard profile of that many slices). Pure."""
        for p in profiles:
            if (isinstance(profile, int) and p.id == profile) or p.name == profile:
                return p
        if isinstance(profile, str) and profile.endswith("g") and profile[:-1].isdigit():
            enum = _STD_ENUM_BY_SLICES.get(int(profile[:-1]))
            for p in profiles:
                if p.enum == enum:
                    return p
        raise MigError(f"unknown MIG profile {profile!r} (have {', '.join(p.name for p in profiles) or 'none'})")

    def create(self, gpu_index: int, profile: str | int, placement_start: int | None = None) -> MigInstance:
        """Create a GPU instance of ``profile`` (at ``placement_start`` if given) and one
        compute instance spanning it; returns the new MIG device. On a compute-instance
        failure the GPU instance is destroyed again. Raises MigReadOnly, or MigError with
        NVML's code (NOT_SUPPORTED: MIG off; INSUFFICIENT_RESOURCES: does not fit)."""
        self._require_changes("create MIG instance")
        nv = self.nvml
        with self._session():
            h = nv.nvmlDeviceGetHandleByIndex(gpu_index)
            try:
                if nv.nvmlDeviceGetMigMode(h)[0] != 1:
                    # Say it plainly rather than "unknown profile": NVML lists no profile then.
                    raise MigError(f"GPU {gpu_index}: MIG mode is off; Tessera never enables it",
                                   nv.NVML_ERROR_NOT_SUPPORTED) from nv.NVMLError(nv.NVML_ERROR_NOT_SUPPORTED)
                prof = self.resolve_profile(self._profiles(h), profile)
                if placement_start is None:
                    gi = nv.nvmlDeviceCreateGpuInstance(h, prof.id)
                else:
                    pl = nv.c_nvmlGpuInstancePlacement_t()
                    pl.start, pl.size = placement_start, next((n for s, n in prof.placements if s == placement_start), 0)
                    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, prof.id, pl)
            except nv.NVMLError as e:
                raise self._wrap(f"GPU {gpu_index}: create GPU instance {profile!r}", e) from e
            gi_id = int(nv.nvmlGpuInstanceGetInfo(gi).id)
            try:
                ci_prof = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, _STD_ENUM_BY_SLICES[prof.slices], nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
                ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_prof.id)
                ci_id = int(nv.nvmlComputeInstanceGetInfo(ci).id)
            except nv.NVMLError as e:
                # Roll back: a GPU instance without a compute instance holds slices and
                # cannot run anything.
                with contextlib.suppress(nv.NVMLError):
                    nv.nvmlGpuInstanceDestroy(gi)
                raise self._wrap(f"GPU {gpu_index}: create compute instance in GI {gi_id}", e) from e
            inst = next(i for i in self._instances(gpu_index, h, [prof]) if (i.gi_id, i.ci_id) == (gi_id, ci_id))
        self.log.info("mig instance created", gpu_index=gpu_index, profile=prof.name, uuid=inst.uuid,
                      gi_id=gi_id, ci_id=ci_id, placement=list(inst.placement))
        return inst

    def destroy(self, gpu_index: int, uuid: str) -> None:
        """Destroy the compute instance of MIG device ``uuid`` and, when it was the last
        one, its GPU instance. Raises MigReadOnly, or MigError (NOT_FOUND, IN_USE)."""
        self._require_changes("destroy MIG instance")
        nv = self.nvml
        with self._session():
            h = nv.nvmlDeviceGetHandleByIndex(gpu_index)
            insts = self._instances(gpu_index, h, self._profiles(h))
            inst = next((i for i in insts if i.uuid == uuid), None)
            if inst is None:
                raise MigError(f"GPU {gpu_index}: no MIG device {uuid}", nv.NVML_ERROR_NOT_FOUND)
            try:
                gi = nv.nvmlDeviceGetGpuInstanceById(h, inst.gi_id)
                nv.nvmlComputeInstanceDestroy(nv.nvmlGpuInstanceGetComputeInstanceById(gi, inst.ci_id))
                if not any(i.gi_id == inst.gi_id and i.uuid != uuid for i in insts):
                    nv.nvmlGpuInstanceDestroy(gi)
            except nv.NVMLError as e:
                raise self._wrap(f"GPU {gpu_index}: destroy MIG device {uuid}", e) from e
        self.log.info("mig instance destroyed", gpu_index=gpu_index, uuid=uuid)


class MigBackend(LedgerBackend):
    """The MIG instances of one GPU as partitions (id ``<device>/mig-<gi>-<ci>``),
    capacity 1 instance each, memory = the instance's. ``refresh`` re-reads them;
    ``create_instance``/``destroy_instance`` go through the manager (read-only unless
    it allows changes) and refuse to destroy an instance that is granted."""

    kind = "mig"

    def __init__(self, device: LocalDevice, manager: MigManager) -> None:
        if device.kind != "gpu":
            raise ValueError(f"device {device.id} is {device.kind}; MIG needs a GPU")
        super().__init__(device.id)
        self.device, self.manager = device, manager
        self.instances: dict[str, MigInstance] = {}
        self._recreated: dict[str, MigInstance] = {}  # granted pid -> its instance's new UUID
        self._sm_share: dict[int, float] = {}  # GPU-instance profile id -> its SMs / the whole GPU's
        self.log = log.get(component="partitions", backend=self.kind, device_id=device.id)
        self.refresh()

    def partition_id(self, inst: MigInstance) -> str:
        return f"{self.device_id}/mig-{inst.gi_id}-{inst.ci_id}"

    def refresh(self) -> MigState:
        """Re-read MIG state; new instances become partitions, vanished ones are dropped
        unless granted (kept, and logged: something outside the agent changed MIG). An
        instance recreated outside the agent under the same GI/CI ids (a new UUID) while
        its partition is granted keeps the old ledger and instance (logged) until the
        grants are released — a fresh ledger would grant the partition a second time."""
        st = self.manager.state(self.device.index)
        whole = max((p.multiprocessors for p in st.profiles), default=0)
        self._sm_share = {p.id: p.multiprocessors / whole for p in st.profiles if whole > 0 and p.multiprocessors > 0}
        seen = {}
        for inst in st.instances:
            pid = self.partition_id(inst)
            old = self.instances.get(pid, inst)
            if pid in self.ledgers and old.uuid != inst.uuid and self.ledgers[pid].held:
                if self._recreated.get(pid, old).uuid != inst.uuid:
                    self.log.warning("granted MIG instance recreated under a new UUID; the partition stays "
                                     "granted until released", partition_id=pid, old_uuid=old.uuid,
                                     new_uuid=inst.uuid, held=sorted(self.ledgers[pid].held))
                self._recreated[pid] = inst
                continue
            self._recreated.pop(pid, None)
            seen[pid] = inst
            if pid not in self.ledgers or old.uuid != inst.uuid:
                self.ledgers[pid] = Ledger(pid, self.kind, 1, "instance", inst.memory_bytes)
        current = {self.partition_id(i) for i in st.instances}
        for pid in [p for p in self._recreated if p not in current]:
            del self._recreated[pid]  # gone again: handled as a vanished instance below
        for pid in list(self.ledgers):
            if pid not in seen and pid not in self._recreated:
                if self.ledgers[pid].held:
                    self.log.warning("granted MIG instance vanished", partition_id=pid)
                    continue
                del self.ledgers[pid]
                self.instances.pop(pid, None)
        self.instances.update(seen)
        return st

    def release(self, grant_id: str) -> Grant | None:
        g = super().release(grant_id)
        if g is not None and g.partition_id in self._recreated and not self.ledgers[g.partition_id].held:
            # The last grant of a recreated instance is gone: the partition is the new one now.
            inst = self._recreated.pop(g.partition_id)
            self.ledgers[g.partition_id] = Ledger(g.partition_id, self.kind, 1, "instance", inst.memory_bytes)
            self.instances[g.partition_id] = inst
            self.log.info("recreated MIG instance taken over", partition_id=g.partition_id, uuid=inst.uuid)
        return g

    def _attributes(self, partition_id: str) -> dict[str, str]:
        """The instance's UUID, profile, slices and GPU, and ``sm_share``: its profile's
        streaming multiprocessors over the GPU's (the largest profile's), the quota the
        performance model prices work on it at (``tessera.quota.quota_of``; absent when
        NVML reports no SM counts)."""
        i = self.instances[partition_id]
        out = {"uuid": i.uuid, "profile": i.profile_name, "slices": str(i.slices), "gpu_uuid": self.device.uuid}
        if i.profile_id in self._sm_share:
            out["sm_share"] = f"{self._sm_share[i.profile_id]:.4g}"
        return out

    def _make_grant(self, grant_id: str, partition_id: str, units: int, memory_bytes: int) -> Grant:
        uuid = self.instances[partition_id].uuid
        return Grant(grant_id, partition_id, self.kind, self.device_id, units, memory_bytes,
                     env={"CUDA_VISIBLE_DEVICES": uuid})

    def create_instance(self, profile: str | int, placement_start: int | None = None) -> str:
        """Create an instance (manager must allow changes); returns its partition id."""
        inst = self.manager.create(self.device.index, profile, placement_start)
        self.refresh()
        return self.partition_id(inst)

    def destroy_instance(self, partition_id: str) -> None:
        """Destroy an ungranted instance (manager must allow changes)."""
        led = self._ledger(partition_id)
        if led.held:
            raise MigError(f"partition {partition_id} is granted to {', '.join(led.held)}; release it first")
        self.manager.destroy(self.device.index, self.instances[partition_id].uuid)
        self.refresh()
