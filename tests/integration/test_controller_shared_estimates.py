"""Jobs sharing a device are estimated as they run: the profiling loop counts the
executors on each RUNNING job's partition (controller.profiling.sharing_of) and writes an
estimate that prices the fitted interference and names the jobs beside it, or says that
interference is not counted. A real etcd and controller store; the estimator link is a
stand-in (``_live.ProfilesLink``) serving a fitted model; nothing is launched."""

from __future__ import annotations

from dataclasses import replace

import pytest

from _live import leading_controller, stand_in_profiling
from controller.config import ControllerConfig
from controller.policy import FirstFit
from controller.profiling import candidate, module_of
from tessera import manifest
from tessera.api.v1 import estimator_pb2
from tessera.api.v1 import types_pb2 as tpb
from tessera.perfmodel import PerfModel, fit_compute, fit_interference
from tests.unit.test_perfmodel_fit import samples

P = tpb.JobPhase
NOW = 1000.0
DOC = {"apiVersion": "tessera/v1", "tenant": "t",
       "workload": {"type": "gpt", "steps": 50, "batch_size": 16,
                    "model": {"layers": 4, "hidden": 128, "heads": 4, "vocab": 256, "seq_len": 64}},
       "resources": {"devices": 1, "device_kind": "cpu"}}
SPLIT = [{"mode": "split", "colocated": 2, "oversubscription": 1.0, "alone_s": 1.0, "together_s": 1.2}]


@pytest.fixture
async def setup(etcd_server, request):
    ctl, store, c = await leading_controller(etcd_server, f"/share-{request.node.name[:40]}",
                                             ControllerConfig(grace_s=1e9), FirstFit(), clock=lambda: NOW)
    n = tpb.Node(name="n1", state=tpb.READY, incarnation="inc1", agent_address="127.0.0.1:1")
    n.devices.add(id="cpu0", kind="cpu", model="x", capacity=4, cores=list(range(4)))
    n.devices.add(id="cpu1", kind="cpu", model="x", capacity=4, cores=list(range(4, 8)))
    for d in ("cpu0", "cpu1"):
        n.partitions.add(id=d, kind="cpuset", device_id=d, capacity_units=4, unit="cores")
    await store.put_node(n, None)
    prof = await stand_in_profiling(ctl, lambda: NOW)
    prof.link.model = PerfModel(version=4, compute={"cpu": fit_compute("cpu", samples(noise=0.01))},
                                interference={"cpu": fit_interference(SPLIT)})
    doc = manifest.validate({**DOC, "name": "x"})
    prof.link.known = [estimator_pb2.ProfileEntry(module=module_of(doc), device_type="cpu", rows=16,
                                                  micro_batches=1, quota=2.0, steps=5, median_step_time_s=0.1)]
    yield store, prof
    await c.close()


async def _running(store, job_id: str, device: str, units: int) -> None:
    j = tpb.Job(id=job_id, spec=manifest.to_proto(manifest.validate({**DOC, "name": job_id})), created=NOW - 10)
    j.status.phase = P.RUNNING
    j.status.placement.add(node="n1", device_ids=[device], partition_ids=[device], units=units)
    await store.create_job(j, "")


async def _estimate(store, job_id: str) -> tpb.JobEstimate:
    return (await store.get_job(job_id)).value.status.estimate


async def test_jobs_sharing_a_partition_are_estimated_with_their_interference_and_a_lone_one_without(setup):
    store, prof = setup
    await _running(store, "j-00000000000a", "cpu0", 2)
    await _running(store, "j-00000000000b", "cpu0", 2)   # beside a, on the other two cores
    await _running(store, "j-00000000000c", "cpu1", 2)   # alone on the other device
    assert (await prof.once())["estimated"] == 3
    model = prof.link.model
    alone = model.estimate(candidate(manifest.validate({**DOC, "name": "x"}), "cpu", 2.0, 1))
    a, b, c = [await _estimate(store, f"j-00000000000{k}") for k in "abc"]
    assert c.status == "ok" and c.step_time_s == pytest.approx(alone.seconds) and c.reason == ""
    for e, other in ((a, "j-00000000000b"), (b, "j-00000000000a")):
        assert e.status == "ok" and e.step_time_s == pytest.approx(alone.seconds * 1.2), e
        assert f"shares n1/cpu0 with 1 other job ({other}): 2 executors" in e.reason, e.reason
        assert "split interference counted" in e.reason and e.rel_std > c.rel_std
    # The model loses its colocation fit: the shared jobs' estimates fall back to alone and
    # say that the interference is not counted (rewritten: their seconds moved).
    prof.link.model = replace(model, version=5, interference={})
    assert (await prof.once())["estimated"] == 2
    a = await _estimate(store, "j-00000000000a")
    assert a.step_time_s == pytest.approx(alone.seconds) and a.model_version == 5
    assert "interference not counted (no colocation (split) profile for device type 'cpu')" in a.reason, a.reason


async def test_a_packed_job_whose_module_was_profiled_at_another_quota_is_told_so(setup):
    """No fitted curve yet, and the module's only profile is at the whole partition (its
    profiling job's quota 4) while the job runs on 2 cores: no estimate, and the reason
    says that the quota is why."""
    store, prof = setup
    prof.link.model = PerfModel(version=1)
    for p in prof.link.known:
        p.quota = 4.0
    await _running(store, "j-00000000000d", "cpu0", 2)
    assert (await prof.once())["estimated"] == 1
    e = await _estimate(store, "j-00000000000d")
    assert e.status == "insufficient_data", e
    assert "its module was profiled at quota 4; it runs at 2" in e.reason, e.reason
