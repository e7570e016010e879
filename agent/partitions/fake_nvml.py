"""TEST DOUBLE of the ``pynvml`` module for MIG (and device discovery) — never used in
production; tests inject it where the agent takes ``nvml=``.

It behaves like the documented NVML API for the calls Tessera makes, on an
H100/H200-class GPU (7 compute slices, 8 memory slices):

- the same function names and argument order as ``pynvml``; results are real pynvml
  ctypes structs where callers read fields (profile infos, placements) and opaque
  handles elsewhere;
- errors are raised as ``pynvml.NVMLError(code)``, which pynvml maps to the same
  subclasses it raises (``NVMLError_NotSupported``, ``..._InsufficientResources``, ...):
  NOT_SUPPORTED for MIG calls while MIG mode is off or for a profile the GPU lacks,
  INVALID_ARGUMENT for an unknown profile id or a placement the profile cannot take,
  INSUFFICIENT_RESOURCES when a profile does not fit (occupied memory slices, no compute
  slices left, instance count reached), INSUFFICIENT_SIZE for a too-small placement
  array, NOT_FOUND for a missing instance or MIG device, IN_USE when destroying a GPU
  instance that still has compute instances.
- Profiles (H200 141 GB, memory approximate): 1g.18gb (id 19, x7), 1g.18gb+me (id 20, x1),
  1g.35gb (id 15, x4), 2g.35gb (id 14, x3), 3g.71gb (id 9, x2), 4g.71gb (id 5, x1),
  7g.141gb (id 0, x1), with NVML's placements ({0..6}:1, {0,2,4,6}:2, {0,2,4}:2, {0,4}:4,
  {0}:4, {0}:8).

Not modelled: GPU instances are listed only through their compute instances (the
agent never creates one without the other), MIG mode changes need no reset here.
"""

from __future__ import annotations

import uuid as _uuid
from ctypes import c_uint
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml as _p

NVMLError = _p.NVMLError
# Re-export the constants callers read from the module they were given.
for _k in dir(_p):
    if _k.startswith(("NVML_", "NVMLError_", "c_nvml")):
        globals()[_k] = getattr(_p, _k)

MEMORY_SLOTS = 8
COMPUTE_SLICES = 7
MIB = 1024 * 1024


@dataclass(frozen=True)
class _GiProfile:
    enum: int
    id: int
    name: str
    slices: int
    count: int
    memory_mb: int
    sms: int
    starts: tuple[int, ...]
    size: int


H200_PROFILES = (
    _GiProfile(_p.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, "1g.18gb", 1, 7, 16384, 16, (0, 1, 2, 3, 4, 5, 6), 1),
    _GiProfile(_p.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, "1g.18gb+me", 1, 1, 16384, 16, (0, 1, 2, 3, 4, 5, 6), 1),
    _GiProfile(_p.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, "1g.35gb", 1, 4, 32768, 26, (0, 2, 4, 6), 2),
    _GiProfile(_p.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, "2g.35gb", 2, 3, 32768, 32, (0, 2, 4), 2),
    _GiProfile(_p.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, "3g.71gb", 3, 2, 69632, 60, (0, 4), 4),
    _GiProfile(_p.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, "4g.71gb", 4, 1, 69632, 64, (0,), 4),
    _GiProfile(_p.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, "7g.141gb", 7, 1, 143360, 132, (0,), 8),
)
# Compute-instance profile enum by slice count (its id equals the enum on these GPUs).
_CI_BY_SLICES = {1: _p.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 2: _p.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
                 3: _p.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 4: _p.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
                 7: _p.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE}
_SLICES_BY_CI = {v: k for k, v in _CI_BY_SLICES.items()}


def _err(code: int):
    return _p.NVMLError(code)


@dataclass
class _Ci:
    id: int
    profile_id: int
    slices: int
    uuid: str


@dataclass
class _Gi:
    id: int
    profile: _GiProfile
    start: int
    cis: dict[int, _Ci] = field(default_factory=dict)


@dataclass
class FakeGpu:
    """One GPU of the double. ``mig_capable`` False models a GPU without MIG (then
    nvmlDeviceGetMigMode raises NOT_SUPPORTED)."""

    index: int
    name: str = "NVIDIA H200"
    uuid: str = ""
    memory_bytes: int = 143771 * MIB
    mig_capable: bool = True
    mig_mode: int = 0
    gis: dict[int, _Gi] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.uuid:
            self.uuid = f"GPU-{_uuid.uuid5(_uuid.NAMESPACE_OID, f'fake-gpu-{self.index}')}"


@dataclass(frozen=True)
class _Dev:
    gpu: FakeGpu
    mig: tuple[int, int] | None = None  # (gi, ci) for a MIG device handle


@dataclass(frozen=True)
class _GiH:
    gpu: FakeGpu
    gi_id: int


@dataclass(frozen=True)
class _CiH:
    gpu: FakeGpu
    gi_id: int
    ci_id: int


class FakeNvml:
    """An object with pynvml's function names, over ``gpus``. Counts calls that change
    state in ``mutations`` so tests can assert a read-only path made none."""

    NVMLError = _p.NVMLError

    def __init__(self, gpus: list[FakeGpu] | None = None, profiles: tuple[_GiProfile, ...] = H200_PROFILES) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu(0, mig_mode=1)]
        self.profiles = profiles
        self.init_count = 0
        self.mutations: list[str] = []

    def __getattr__(self, name: str):
        # Constants (NVML_*, NVMLError_*, c_nvml*) read as from pynvml.
        if name.startswith(("NVML_", "NVMLError_", "c_nvml")):
            return getattr(_p, name)
        raise AttributeError(name)

    # -- library -----------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        if self.init_count <= 0:
            raise _err(_p.NVML_ERROR_UNINITIALIZED)
        self.init_count -= 1

    def _need_init(self) -> None:
        if self.init_count <= 0:
            raise _err(_p.NVML_ERROR_UNINITIALIZED)

    # -- devices -----------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:
        self._need_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Dev:
        self._need_init()
        if not 0 <= index < len(self.gpus):
            raise _err(_p.NVML_ERROR_INVALID_ARGUMENT)
        return _Dev(self.gpus[index])

    def nvmlDeviceGetName(self, h: _Dev) -> str:
        return h.gpu.name if h.mig is None else f"{h.gpu.name} MIG {self._gi(h.gpu, h.mig[0]).profile.name}"

    def nvmlDeviceGetUUID(self, h: _Dev) -> str:
        return h.gpu.uuid if h.mig is None else self._ci(h.gpu, *h.mig).uuid

    def nvmlDeviceGetMemoryInfo(self, h: _Dev):
        total = h.gpu.memory_bytes if h.mig is None else self._gi(h.gpu, h.mig[0]).profile.memory_mb * MIB
        return SimpleNamespace(total=total, free=total, used=0)

    # -- MIG mode ----------------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, h: _Dev) -> list[int]:
        self._need_init()
        if not h.gpu.mig_capable or h.mig is not None:
            raise _err(_p.NVML_ERROR_NOT_SUPPORTED)
        return [h.gpu.mig_mode, h.gpu.mig_mode]

    def nvmlDeviceIsMigDeviceHandle(self, h: _Dev) -> int:
        return int(h.mig is not None)

    def _mig_on(self, gpu: FakeGpu) -> None:
        self._need_init()
        if not gpu.mig_capable or gpu.mig_mode != 1:
            raise _err(_p.NVML_ERROR_NOT_SUPPORTED)

    # -- GPU instance profiles and placements ------------------------------------------
    def _profile_by_enum(self, enum: int) -> _GiProfile:
        if not 0 <= enum < _p.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise _err(_p.NVML_ERROR_INVALID_ARGUMENT)
        for p in self.profiles:
            if p.enum == enum:
                return p
        raise _err(_p.NVML_ERROR_NOT_SUPPORTED)

    def _profile_by_id(self, pid: int) -> _GiProfile:
        for p in self.profiles:
            if p.id == pid:
                return p
        raise _err(_p.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: _Dev, profile: int, version: int = 2):
        self._mig_on(h.gpu)
        p = self._profile_by_enum(profile)
        if version == 2:
            info = _p.c_nvmlGpuInstanceProfileInfo_v2_t()
            info.name = p.name.encode()
        else:
            info = _p.c_nvmlGpuInstanceProfileInfo_t()
        info.id, info.isP2pSupported, info.sliceCount, info.instanceCount = p.id, 0, p.slices, p.count
        info.multiprocessorCount, info.copyEngineCount, info.memorySizeMB = p.sms, max(1, p.slices), p.memory_mb
        return info

    nvmlDeviceGetGpuInstanceProfileInfoV = nvmlDeviceGetGpuInstanceProfileInfo

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, h: _Dev, profileId: int, placementsRef, countRef) -> int:
        """All placements of the profile, occupied or not (as NVML documents); fills
        ``placementsRef`` (an array of c_nvmlGpuInstancePlacement_t) and ``countRef``
        (byref(c_uint) holding the array size in, the number of placements out)."""
        self._mig_on(h.gpu)
        p = self._profile_by_id(profileId)
        count = _deref(countRef)
        if placementsRef is None:
            count.value = len(p.starts)
            return _p.NVML_SUCCESS
        if count.value < len(p.starts):
            count.value = len(p.starts)
            raise _err(_p.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, s in enumerate(p.starts):
            placementsRef[i].start, placementsRef[i].size = s, p.size
        count.value = len(p.starts)
        return _p.NVML_SUCCESS

    def _occupied(self, gpu: FakeGpu) -> set[int]:
        return {s for gi in gpu.gis.values() for s in range(gi.start, gi.start + gi.profile.size)}

    def _fits(self, gpu: FakeGpu, p: _GiProfile, start: int) -> bool:
        used_slices = sum(gi.profile.slices for gi in gpu.gis.values())
        same = sum(1 for gi in gpu.gis.values() if gi.profile.id == p.id)
        return (not set(range(start, start + p.size)) & self._occupied(gpu)
                and used_slices + p.slices <= COMPUTE_SLICES and same < p.count)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, h: _Dev, profileId: int) -> int:
        self._mig_on(h.gpu)
        p = self._profile_by_id(profileId)
        # How many more could be created one after another, each at its first free placement.
        gpu = FakeGpu(h.gpu.index, mig_mode=1, gis=dict(h.gpu.gis))
        n = 0
        while True:
            start = next((s for s in p.starts if self._fits(gpu, p, s)), None)
            if start is None:
                return n
            gpu.gis[-1 - n] = _Gi(-1 - n, p, start)
            n += 1

    def _new_gi(self, gpu: FakeGpu, p: _GiProfile, start: int) -> _GiH:
        gi_id = next(i for i in range(1, 64) if i not in gpu.gis)
        gpu.gis[gi_id] = _Gi(gi_id, p, start)
        self.mutations.append(f"create_gi:{gpu.index}:{gi_id}")
        return _GiH(gpu, gi_id)

    def nvmlDeviceCreateGpuInstance(self, h: _Dev, profileId: int) -> _GiH:
        self._mig_on(h.gpu)
        p = self._profile_by_id(profileId)
        start = next((s for s in p.starts if self._fits(h.gpu, p, s)), None)
        if start is None:
            raise _err(_p.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._new_gi(h.gpu, p, start)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h: _Dev, profileId: int, placement) -> _GiH:
        self._mig_on(h.gpu)
        p = self._profile_by_id(profileId)
        if placement.start not in p.starts or placement.size != p.size:
            raise _err(_p.NVML_ERROR_INVALID_ARGUMENT)
        if not self._fits(h.gpu, p, placement.start):
            raise _err(_p.NVML_ERROR_INSUFFICIENT_RESOURCES)
        return self._new_gi(h.gpu, p, placement.start)

    def _gi(self, gpu: FakeGpu, gi_id: int) -> _Gi:
        try:
            return gpu.gis[gi_id]
        except KeyError:
            raise _err(_p.NVML_ERROR_NOT_FOUND) from None

    def _ci(self, gpu: FakeGpu, gi_id: int, ci_id: int) -> _Ci:
        try:
            return self._gi(gpu, gi_id).cis[ci_id]
        except KeyError:
            raise _err(_p.NVML_ERROR_NOT_FOUND) from None

    def nvmlDeviceGetGpuInstanceById(self, h: _Dev, gpuInstanceId: int) -> _GiH:
        self._mig_on(h.gpu)
        self._gi(h.gpu, gpuInstanceId)
        return _GiH(h.gpu, gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gi: _GiH):
        g = self._gi(gi.gpu, gi.gi_id)
        pl = _p.c_nvmlGpuInstancePlacement_t()
        pl.start, pl.size = g.start, g.profile.size
        return SimpleNamespace(device=_Dev(gi.gpu), id=g.id, profileId=g.profile.id, placement=pl)

    def nvmlGpuInstanceDestroy(self, gi: _GiH) -> int:
        self._mig_on(gi.gpu)
        g = self._gi(gi.gpu, gi.gi_id)
        if g.cis:
            raise _err(_p.NVML_ERROR_IN_USE)
        del gi.gpu.gis[gi.gi_id]
        self.mutations.append(f"destroy_gi:{gi.gpu.index}:{gi.gi_id}")
        return _p.NVML_SUCCESS

    # -- compute instances -------------------------------------------------------------
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: _GiH, profile: int, engProfile: int, version: int = 2):
        g = self._gi(gi.gpu, gi.gi_id)
        if not 0 <= profile < _p.NVML_COMPUTE_INSTANCE_PROFILE_COUNT or \
                engProfile >= _p.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT:
            raise _err(_p.NVML_ERROR_INVALID_ARGUMENT)
        slices = _SLICES_BY_CI.get(profile)
        if slices is None or slices > g.profile.slices:
            raise _err(_p.NVML_ERROR_NOT_SUPPORTED)
        info = _p.c_nvmlComputeInstanceProfileInfo_v2_t() if version == 2 else _p.c_nvmlComputeInstanceProfileInfo_t()
        info.id, info.sliceCount, info.instanceCount = profile, slices, g.profile.slices // slices
        info.multiprocessorCount = g.profile.sms * slices // g.profile.slices
        if version == 2:
            info.name = f"{slices}c.{g.profile.name}".encode()
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gi: _GiH, profileId: int) -> _CiH:
        g = self._gi(gi.gpu, gi.gi_id)
        slices = _SLICES_BY_CI.get(profileId)
        if slices is None or slices > g.profile.slices:
            raise _err(_p.NVML_ERROR_INVALID_ARGUMENT)
        if sum(c.slices for c in g.cis.values()) + slices > g.profile.slices:
            raise _err(_p.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci_id = next(i for i in range(0, 16) if i not in g.cis)
        mig_uuid = f"MIG-{_uuid.uuid5(_uuid.NAMESPACE_OID, f'{gi.gpu.uuid}/{g.id}/{ci_id}/{len(self.mutations)}')}"
        g.cis[ci_id] = _Ci(ci_id, profileId, slices, mig_uuid)
        self.mutations.append(f"create_ci:{gi.gpu.index}:{g.id}:{ci_id}")
        return _CiH(gi.gpu, g.id, ci_id)

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: _GiH, computeInstanceId: int) -> _CiH:
        self._ci(gi.gpu, gi.gi_id, computeInstanceId)
        return _CiH(gi.gpu, gi.gi_id, computeInstanceId)

    def nvmlComputeInstanceGetInfo(self, ci: _CiH):
        c = self._ci(ci.gpu, ci.gi_id, ci.ci_id)
        return SimpleNamespace(device=_Dev(ci.gpu), gpuInstance=_GiH(ci.gpu, ci.gi_id), id=c.id, profileId=c.profile_id)

    def nvmlComputeInstanceDestroy(self, ci: _CiH) -> int:
        self._ci(ci.gpu, ci.gi_id, ci.ci_id)
        del ci.gpu.gis[ci.gi_id].cis[ci.ci_id]
        self.mutations.append(f"destroy_ci:{ci.gpu.index}:{ci.gi_id}:{ci.ci_id}")
        return _p.NVML_SUCCESS

    # -- MIG devices -------------------------------------------------------------------
    def nvmlDeviceGetMaxMigDeviceCount(self, h: _Dev) -> int:
        self._need_init()
        return COMPUTE_SLICES if h.gpu.mig_capable else 0

    def _mig_devices(self, gpu: FakeGpu) -> list[tuple[int, int]]:
        return sorted((g.id, c) for g in gpu.gis.values() for c in g.cis)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: _Dev, index: int) -> _Dev:
        self._need_init()
        devs = self._mig_devices(h.gpu) if h.gpu.mig_mode == 1 else []
        if not 0 <= index < len(devs):
            raise _err(_p.NVML_ERROR_NOT_FOUND)
        return _Dev(h.gpu, devs[index])

    def nvmlDeviceGetGpuInstanceId(self, h: _Dev) -> int:
        if h.mig is None:
            raise _err(_p.NVML_ERROR_INVALID_ARGUMENT)
        return h.mig[0]

    def nvmlDeviceGetComputeInstanceId(self, h: _Dev) -> int:
        if h.mig is None:
            raise _err(_p.NVML_ERROR_INVALID_ARGUMENT)
        return h.mig[1]

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: _Dev) -> _Dev:
        if h.mig is None:
            raise _err(_p.NVML_ERROR_INVALID_ARGUMENT)
        return _Dev(h.gpu)


def _deref(ref) -> c_uint:
    """The c_uint behind ``byref(x)`` (a CArgObject), ``pointer(x)`` or ``x`` itself."""
    if hasattr(ref, "_obj"):
        return ref._obj
    if hasattr(ref, "contents"):
        return ref.contents
    return ref
