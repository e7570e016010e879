"""MIG manager and backend against the NVML test double (H200-class profiles)."""

from __future__ import annotations

from ctypes import byref, c_uint

import pynvml
import pytest

from agent.devices import LocalDevice
from agent.partitions import CapacityRefused, MigBackend, MigError, MigManager, MigReadOnly, make_backend
from agent.partitions.fake_nvml import FakeGpu, FakeNvml
from agent.partitions.mig import free_placements

GPU = LocalDevice(id="gpu0", kind="gpu", model="H200", memory_bytes=0, capacity=100, uuid="GPU-x", index=0)


def test_double_raises_pynvml_subclasses():
    nv = FakeNvml([FakeGpu(0, mig_mode=0), FakeGpu(1, mig_capable=False)])
    nv.nvmlInit()
    h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetGpuInstanceProfileInfo(h0, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceCreateGpuInstance(h0, 19)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nv.nvmlDeviceGetMigMode(h1)
    nv.gpus[0].mig_mode = 1
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nv.nvmlDeviceCreateGpuInstance(h0, 12345)
    arr, count = (pynvml.c_nvmlGpuInstancePlacement_t * 2)(), c_uint(2)
    with pytest.raises(pynvml.NVMLError_InsufficientSize):
        nv.nvmlDeviceGetGpuInstancePossiblePlacements(h0, 19, arr, byref(count))
    assert count.value == 7
    gi = nv.nvmlDeviceCreateGpuInstance(h0, 0)  # 7g.141gb takes the whole GPU
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nv.nvmlDeviceCreateGpuInstance(h0, 19)
    nv.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE)
    with pytest.raises(pynvml.NVMLError_InUse):
        nv.nvmlGpuInstanceDestroy(gi)


def test_read_only_lists_and_refuses_changes():
    nv = FakeNvml()
    m = MigManager(nv)
    st = m.state(0)
    assert st.enabled and st.instances == ()
    names = {p.name: (p.id, p.slices, p.placements) for p in st.profiles}
    assert names["1g.18gb"] == (19, 1, tuple((s, 1) for s in range(7)))
    assert names["3g.71gb"] == (9, 3, ((0, 4), (4, 4)))
    assert names["7g.141gb"] == (0, 7, ((0, 8),))
    with pytest.raises(MigReadOnly):
        m.create(0, "1g")
    with pytest.raises(MigReadOnly):
        m.destroy(0, "MIG-x")
    assert nv.mutations == [] and nv.init_count == 0


def test_mig_off_and_unsupported_states():
    nv = FakeNvml([FakeGpu(0, mig_mode=0), FakeGpu(1, mig_capable=False)])
    m = MigManager(nv, allow_changes=True)
    assert not m.state(0).enabled and m.state(0).supported
    assert not m.state(1).supported
    with pytest.raises(MigError) as e:
        m.create(0, 19)
    assert e.value.code == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert isinstance(e.value.__cause__, pynvml.NVMLError_NotSupported)


def test_create_place_destroy_and_no_fit():
    nv = FakeNvml()
    m = MigManager(nv, allow_changes=True)
    a = m.create(0, "3g", placement_start=4)
    assert a.placement == (4, 4) and a.uuid.startswith("MIG-") and a.profile_name == "3g.71gb"
    b = m.create(0, "2g.35gb")
    assert b.placement == (0, 2)
    with pytest.raises(MigError) as e:
        m.create(0, "4g")  # only placement {0}:4 overlaps the 2g at 0
    assert e.value.code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    with pytest.raises(MigError) as e:
        m.create(0, "3g", placement_start=1)
    assert e.value.code == pynvml.NVML_ERROR_INVALID_ARGUMENT
    assert {i.uuid for i in m.instances(0)} == {a.uuid, b.uuid}
    m.destroy(0, a.uuid)
    assert [i.uuid for i in m.instances(0)] == [b.uuid]
    with pytest.raises(MigError):
        m.destroy(0, a.uuid)
    assert nv.init_count == 0


def test_free_placements_pure():
    assert free_placements(((0, 2), (2, 2), (4, 2)), [(2, 1)]) == [(0, 2), (4, 2)]


def test_backend_partitions_grants_and_uuid_env():
    nv = FakeNvml()
    b = MigBackend(GPU, MigManager(nv, allow_changes=True))
    assert b.partitions() == []
    pid = b.create_instance("1g.35gb")
    info = {p.id: p for p in b.partitions()}[pid]
    assert (info.kind, info.capacity_units, info.unit) == ("mig", 1, "instance")
    assert info.memory_bytes == 32768 * 1024 * 1024 and info.attributes["uuid"].startswith("MIG-")
    g = b.grant("j/r0", pid, 1)
    assert g.env == {"CUDA_VISIBLE_DEVICES": info.attributes["uuid"]}
    with pytest.raises(CapacityRefused, match="asked 1 instance.*only 0 of 1"):
        b.grant("k/r0", pid, 1)
    with pytest.raises(MigError, match="granted"):
        b.destroy_instance(pid)
    b.release("j/r0")
    b.destroy_instance(pid)
    assert b.partitions() == []


def test_make_backend_auto_picks_mig_read_only():
    nv = FakeNvml()
    MigManager(nv, allow_changes=True).create(0, "7g")
    nv.mutations.clear()
    b = make_backend(GPU, "auto", nvml=nv)
    assert b.kind == "mig" and len(b.partitions()) == 1
    with pytest.raises(MigReadOnly):
        b.create_instance("1g")
    assert nv.mutations == []


def test_instance_recreated_under_new_uuid_while_granted_is_not_granted_twice():
    # Destroyed and recreated outside the agent with the same GI/CI ids: a new UUID.
    nv = FakeNvml([FakeGpu(0, mig_mode=1)])
    op = MigManager(nv, allow_changes=True)  # the operator's tool
    inst = op.create(0, "3g")
    be = MigBackend(GPU, MigManager(nv))     # the agent: read-only
    pid = be.partition_id(inst)
    g1 = be.grant("alloc1/r0", pid, 1)
    op.destroy(0, inst.uuid)
    inst2 = op.create(0, "3g")
    assert be.partition_id(inst2) == pid and inst2.uuid != inst.uuid
    be.refresh()
    be.refresh()  # a second look changes nothing either
    assert [g.grant_id for g in be.grants()] == ["alloc1/r0"]
    assert [p.free_units for p in be.partitions()] == [0]
    assert be.partitions()[0].attributes["uuid"] == inst.uuid  # what the running grant uses
    with pytest.raises(CapacityRefused):
        be.grant("alloc2/r0", pid, 1)
    assert be.grant("alloc1/r0", pid, 1) == g1  # an idempotent repeat still answers
    # Released: the partition is the recreated instance now, free and with its UUID.
    assert be.release("alloc1/r0") == g1
    assert [p.free_units for p in be.partitions()] == [1]
    assert be.partitions()[0].attributes["uuid"] == inst2.uuid
    g2 = be.grant("alloc2/r0", pid, 1)
    assert g2.env == {"CUDA_VISIBLE_DEVICES": inst2.uuid}
    be.refresh()
    assert [g.grant_id for g in be.grants()] == ["alloc2/r0"]
    assert [p.free_units for p in be.partitions()] == [0]
    # Not granted when recreated: the new instance replaces it at once.
    be.release("alloc2/r0")
    op.destroy(0, inst2.uuid)
    inst3 = op.create(0, "3g")
    be.refresh()
    assert be.partitions()[0].attributes["uuid"] == inst3.uuid and be.partitions()[0].free_units == 1
