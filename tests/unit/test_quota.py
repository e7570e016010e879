"""One quota rule for the controller's estimates and the agent's step labels
(``tessera.quota.quota_of``): cores of a CPU, the SM share of a GPU. Before it the agent
labelled its executors' steps with their CPU threads, so an MPS grant of 30 % and the
whole GPU were one profile point, and a core set of 2 units per core filed 2-unit grants
under 2 where the controller estimated them at 1 core."""

from __future__ import annotations

import pytest

from agent.devices import LocalDevice
from agent.executors import ExecutorManager
from agent.partitions.base import Grant, PartitionInfo
from controller.profiling import Profiling
from estimator.models import run_key
from tessera.api.v1 import profiler_pb2, types_pb2
from tessera.quota import quota_of


@pytest.mark.parametrize("args, q", [
    (("cpu", 4, "cpuset", "cores", 4, 2), 2.0),              # 2 cores of a 4-core set
    (("cpu", 8, "cpuset", "cores", 8, 2, 2), 1.0),           # 2 units at 2 per core: 1 core
    (("cpu", 4, "timeslice", "slots", 4, 1), 4.0),           # time slicing: the whole CPU
    (("gpu", 100, "timeslice", "slots", 4, 1), 1.0),         # ... the whole GPU
    (("gpu", 100, "mps", "sm_percent", 100, 30), 0.3),       # MPS: the SM percentage
    (("gpu", 100, "mps", "sm_percent", 100, 150), 1.0),      # at most the GPU
    (("gpu", 100, "mig", "instance", 1, 1), 1.0),            # a MIG instance: the partition's share
    (("gpu", 100, "device", "slices", 4, 2), 0.5),
    (("gpu", 100), 1.0),                                     # no partition: the whole device
    (("cpu", 4), 4.0),
    (("gpu", 0), None),                                      # nothing known: the caller's fallback
    (("gpu", 0, "mig", "instance", 1, 1, 1, 0.5), None),
    (("gpu", 0, "mps", "sm_percent", 100, 30), 0.3),         # the grant alone says it
])
def test_quota_of(args, q):
    assert quota_of(*args) == (None if q is None else pytest.approx(q))


class _Parts:
    def __init__(self, infos):
        self.infos = infos

    def describe(self):
        return self.infos


def _mgr(tmp_path, devices, infos) -> ExecutorManager:
    async def on_report(*_):
        return None

    return ExecutorManager(tmp_path, devices, on_report, parts=_Parts(infos))


@pytest.mark.parametrize("dev, info, units", [
    (LocalDevice(id="gpu0", kind="gpu", model="H200", memory_bytes=0, capacity=100, uuid="GPU-a", index=0),
     PartitionInfo(id="gpu0", kind="mps", device_id="gpu0", capacity_units=100, unit="sm_percent"), 30),
    (LocalDevice(id="gpu0", kind="gpu", model="H200", memory_bytes=0, capacity=100, uuid="GPU-a", index=0),
     PartitionInfo(id="gpu0", kind="timeslice", device_id="gpu0", capacity_units=4, unit="slots"), 1),
    (LocalDevice(id="cpu0", kind="cpu", model="x", memory_bytes=0, capacity=8, cores=(0, 1, 2, 3)),
     PartitionInfo(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=8, unit="cores",
                   attributes={"units_per_core": "2"}), 2),
    (LocalDevice(id="cpu0", kind="cpu", model="x", memory_bytes=0, capacity=4, cores=(0, 1, 2, 3)),
     PartitionInfo(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=4, unit="cores"), 3),
])
def test_the_agents_step_label_is_the_quota_the_controller_estimates_the_job_at(tmp_path, dev, info, units):
    """The agent's ``quota`` label of an executor on a grant equals the controller's quota
    of a job placed on that grant (the node as the agent reports it), and the estimator
    files the steps under it."""
    mgr = _mgr(tmp_path, [dev], [info])
    label = mgr._quota_label(dev, Grant("a/0", info.id, info.kind, dev.id, units))
    node = types_pb2.Node(name="n1")
    node.devices.add(id=dev.id, kind=dev.kind, capacity=dev.capacity)
    node.partitions.add(id=info.id, kind=info.kind, device_id=dev.id, capacity_units=info.capacity_units,
                        unit=info.unit, attributes=info.attributes)
    job = types_pb2.Job()
    job.status.placement.add(node="n1", device_ids=[dev.id], partition_ids=[info.id], units=units)
    q, _ = Profiling._quota(job, {"n1": node}, [])
    assert float(label) == pytest.approx(q)
    labels = {"module": "gpt:l2-h64-a4-s32-v256", "workload_type": "gpt", "layers": "2", "hidden": "64",
              "heads": "4", "vocab": "256", "seq_len": "32", "batch": "8", "micro_batches": "1", "threads": "7",
              "world_size": "1", "device_kind": dev.kind, "quota": label}
    key = run_key(profiler_pb2.Measurement(kind="step", job_id="j", step=3, step_time_s=0.01, labels=labels))
    assert key[-1] == pytest.approx(q)  # not the executor's 7 CPU threads


def test_without_a_grant_the_whole_device_and_an_older_agents_threads_still_count(tmp_path):
    gpu = LocalDevice(id="gpu0", kind="gpu", model="H200", memory_bytes=0, capacity=100, uuid="GPU-a", index=0)
    assert _mgr(tmp_path, [gpu], [])._quota_label(gpu, None) == "1"
    labels = {"module": "gpt:x", "workload_type": "gpt", "layers": "2", "hidden": "64", "heads": "4",
              "vocab": "256", "seq_len": "32", "batch": "8", "micro_batches": "1", "threads": "2",
              "world_size": "1", "device_kind": "cpu"}
    key = run_key(profiler_pb2.Measurement(kind="step", job_id="j", step=3, step_time_s=0.01, labels=labels))
    assert key[-1] == 2.0
    bad = profiler_pb2.Measurement(kind="step", job_id="j", step=3, step_time_s=0.01, labels={**labels, "quota": "0"})
    assert run_key(bad) is None


async def test_a_live_repartition_relabels_the_steps_with_the_new_quota(tmp_path):
    """UpdateGrant moves a running executor to another quota: its later steps are another
    profile point, filed under the new quota (2 units at 2 per core: 1 core; 4: 2 cores)."""
    import asyncio
    import os

    from agent.executors import Executor
    from agent.partitions import Partitions

    cores = tuple(sorted(os.sched_getaffinity(0)))[:2]
    cpu = LocalDevice(id="cpu0", kind="cpu", model="x", memory_bytes=0, capacity=2 * len(cores), cores=cores,
                      units_per_core=2)
    parts = Partitions.for_devices([cpu], "auto", state_dir=tmp_path / "parts")

    async def on_report(*_):
        return None

    mgr = ExecutorManager(tmp_path, [cpu], on_report, parts=parts)
    g = parts.grant("a/r0", "cpu0", 2)  # agent.executors.grant_id("a", 0)
    proc = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        ex = Executor("a", "j-a", 0, ["cpu0"], tmp_path / "a.log", proc=proc, grant=g,
                      labels={"threads": "2", "quota": mgr._quota_label(cpu, g)})
        mgr.executors[("a", 0)] = ex
        assert ex.labels["quota"] == "1"
        if len(cores) > 1:
            mgr.update_grant("a", 0, 4)
            assert (ex.labels["threads"], ex.labels["quota"]) == ("4", "2")
    finally:
        proc.kill()
        await proc.wait()


def test_a_mig_instance_is_priced_at_its_share_of_the_gpus_sms_by_agent_controller_and_policy(tmp_path):
    """A MIG instance reports ``sm_share`` (its profile's SMs over the GPU's, from NVML —
    here the test double's H200 profiles: 1g 16, 3g 60, 7g 132 SMs); the agent's step
    label, the controller's estimate and the policy's device class all take it as the
    quota. Before, the controller priced an instance as the whole GPU (1.0) and the
    policy as 1 % of it (capacity 1 instance / 100)."""
    from agent.partitions import MigBackend, MigManager
    from agent.partitions.fake_nvml import FakeNvml
    from controller import adapter

    gpu = LocalDevice(id="gpu0", kind="gpu", model="H200", memory_bytes=0, capacity=100, uuid="GPU-x", index=0)
    b = MigBackend(gpu, MigManager(FakeNvml(), allow_changes=True))
    one, three = b.create_instance("1g.18gb"), b.create_instance("3g.71gb")
    infos = {p.id: p for p in b.partitions()}
    assert float(infos[one].attributes["sm_share"]) == pytest.approx(16 / 132, rel=1e-3)
    assert float(infos[three].attributes["sm_share"]) == pytest.approx(60 / 132, rel=1e-3)
    mgr = _mgr(tmp_path, [gpu], list(infos.values()))
    node = types_pb2.Node(name="n1", state=types_pb2.READY)
    node.devices.add(id="gpu0", kind="gpu", capacity=100, model="H200")
    for pid in (one, three):
        info = infos[pid]
        node.partitions.add(id=pid, kind=info.kind, device_id="gpu0", capacity_units=1, unit=info.unit,
                            attributes=info.attributes)
    for pid, share in ((one, 16 / 132), (three, 60 / 132)):
        label = mgr._quota_label(gpu, Grant(f"{pid}/r0", pid, "mig", "gpu0", 1))
        job = types_pb2.Job()
        job.status.placement.add(node="n1", device_ids=["gpu0"], partition_ids=[pid], units=1)
        q, _ = Profiling._quota(job, {"n1": node}, [])
        assert float(label) == pytest.approx(share, rel=1e-3) and q == pytest.approx(share, rel=1e-3)
    (cls,) = adapter.device_classes([node]).values()
    assert cls.kind == "gpu" and cls.quota == pytest.approx(16 / 132, rel=1e-3)  # the smallest partition


def test_the_policys_device_class_is_a_whole_partitions_quota():
    from controller import adapter

    node = types_pb2.Node(name="n1", state=types_pb2.READY)
    node.devices.add(id="cpu0", kind="cpu", capacity=8)
    node.partitions.add(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=8, unit="cores",
                        attributes={"units_per_core": "2"})
    assert adapter.device_classes([node])["cpu"].quota == 4.0  # 8 units at 2 per core: 4 cores (was 8)
    gnode = types_pb2.Node(name="n2", state=types_pb2.READY)
    gnode.devices.add(id="gpu0", kind="gpu", capacity=100, model="H200")
    gnode.partitions.add(id="gpu0", kind="timeslice", device_id="gpu0", capacity_units=4, unit="slots")
    (cls,) = adapter.device_classes([gnode]).values()
    assert cls.quota == 1.0  # each time-sliced executor runs on the whole GPU (was 4 slots / 100)
