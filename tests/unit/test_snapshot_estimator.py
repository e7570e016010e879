"""controller/policy/snapshot_estimator.py and its use by the policy through the adapter:
estimates from a perf-model snapshot for the jobs' real model keys; unknown where the
snapshot has too little data (the policy then uses the requested shapes)."""

from __future__ import annotations

from controller import adapter
from controller.policy import TesseraPolicy
from controller.policy.snapshot_estimator import DeviceClass, JobShape, SnapshotEstimator, job_key, plan_for
from tessera.api.v1 import types_pb2 as tpb
from tessera.modelkey import arch_key
from tessera.perfmodel import PerfModel, ProfilePoint, fit_comm

P = tpb.JobPhase
SMALL = {"vocab": 64, "seq_len": 32, "layers": 2, "hidden": 64, "heads": 4}
MODULE = arch_key({"type": "gpt", "model": SMALL})


def snapshot(rows8: float = 1.0, rows4: float = 0.3, comm: bool = True, version: int = 3) -> PerfModel:
    """Two single-core profiles of MODULE (per-rank batch 8 and 4) and a loopback table:
    too few profiles for a fitted curve, so answers come from the profiles."""
    pts = [ProfilePoint(MODULE, 8, 32, 1, 1.0, rows8, 20, 0.05), ProfilePoint(MODULE, 4, 32, 1, 1.0, rows4, 20, 0.05)]
    links = {}
    if comm:
        rows = [{"link": "loopback-gloo", "op": "all_reduce", "bytes": b, "world": 2, "seconds": 1e-4 + b / 1e9}
                for b in (4096, 1 << 20, 4 << 20)]
        links["loopback-gloo"] = fit_comm("loopback-gloo", rows)
    return PerfModel(version=version, comm=links, profiles={"cpu": pts})


def node(name: str, parts: int = 2, cores: int = 1) -> tpb.Node:
    n = tpb.Node(name=name, state=tpb.READY)
    for i in range(parts):
        n.devices.add(id=f"cpu{i}", kind="cpu", model="Xeon", capacity=cores)
        n.partitions.add(id=f"cpu{i}", kind="cpuset", device_id=f"cpu{i}", capacity_units=cores, unit="cores")
    return n


def job(jid: str, phase=P.PENDING, batch: int = 8, steps: int = 400, done: int = 0, created: float = 0.0) -> tpb.Job:
    j = tpb.Job(id=jid, created=created)
    j.spec.tenant = "t"
    w = j.spec.workload
    w.type, w.steps, w.batch_size = "gpt", steps, batch
    for k, v in SMALL.items():
        setattr(w.model, k, v)
    w.plan.dp = w.plan.tp = w.plan.pp = w.plan.micro_batches = 1
    j.spec.resources.devices = 1
    j.spec.resources.device_kind = "cpu"
    j.status.phase = phase
    j.status.step = done
    return j


def live(nodes, jobs, model: PerfModel) -> SnapshotEstimator:
    est = SnapshotEstimator(model, adapter.device_classes(nodes))
    for j in jobs:
        s = adapter.job_shape(j)
        if s is not None:
            est.register(job_key(s), s)
    return est


def test_plan_for_matches_the_controllers_replan():
    assert plan_for(1, 1, 1, 4, 64, 2, 8, 2) == (2, 1, 1, 1)
    assert plan_for(2, 1, 1, 4, 64, 2, 8, 4) == (2, 2, 1, 1)
    assert plan_for(1, 1, 1, 4, 64, 2, 8, 3) is None  # batch 8 does not divide by 3
    p = adapter.replan(tpb.ParallelPlan(dp=1, tp=1, pp=1, micro_batches=1), tpb.ModelConfig(**SMALL), 8, 2)
    assert (p.dp, p.tp, p.pp, p.micro_batches) == (2, 1, 1, 1)


def test_model_key_names_module_batch_and_plan_and_classes_read_partitions():
    j = job("a")
    assert adapter.model_key(j) == f"{MODULE}:b8:m1:t1:p1:n1"
    assert adapter.build_request([node("n1")], [j], 0.0).pending[0].model == adapter.model_key(j)
    other = tpb.Job(id="x")
    other.spec.workload.type = "peft"
    assert adapter.model_key(other) == "peft" and adapter.job_shape(other) is None
    assert adapter.device_classes([node("n1", cores=2)]) == {"cpu": DeviceClass("cpu", 2.0, 0.0)}


def test_estimates_come_from_the_snapshot_and_unknown_is_none():
    j, small = job("a"), job("b", batch=4)
    est = live([node("n1")], [j, small], snapshot())
    k, ks = adapter.model_key(j), adapter.model_key(small)
    assert abs(est.iter_time(k, "cpu", 1, 1) - 1.0) < 1e-9          # the batch-8 profile
    two = est.iter_time(k, "cpu", 1, 2)                             # dp=2: batch-4 profile + all-reduce
    assert 0.3 < two < 0.35 and est.stages(k, "cpu", 1, 2) == 1
    assert "all-reduce" in est.describe(k, "cpu", 1, 2).reason
    assert est.knows(k) and est.knows(ks)
    assert est.iter_time(ks, "cpu", 1, 2) is None                   # per-rank batch 2 never profiled
    assert est.iter_time(k, "a100", 1, 1) is None and est.iter_time("gpt", "cpu", 1, 1) is None
    assert not est.knows("gpt") and not est.knows(f"{MODULE}:b16:m1:t1:p1:n1")
    # No communication table: dp=2 cannot be estimated, one rank still can.
    nocomm = live([node("n1")], [j], snapshot(comm=False))
    assert nocomm.iter_time(k, "cpu", 1, 2) is None and nocomm.iter_time(k, "cpu", 1, 1) == 1.0
    # Memory known and too small: infeasible there.
    tiny = SnapshotEstimator(snapshot(), {"cpu": DeviceClass("cpu", 1.0, 1000.0)})
    tiny.register(k, adapter.job_shape(j))
    assert tiny.iter_time(k, "cpu", 1, 1) is None


def running_on_cpu0(j: tpb.Job) -> tpb.Job:
    j.status.placement.add(node="n1", device_ids=["cpu0"], partition_ids=["cpu0"])
    j.status.history.add(phase=P.SCHEDULED, time=0.0)
    return j


def test_policy_expands_a_running_job_when_the_estimate_pays_the_restart():
    nodes, jobs = [node("n1")], [running_on_cpu0(job("a", P.RUNNING, done=50))]
    reply = TesseraPolicy().schedule(adapter.build_request(nodes, jobs, 100.0, live(nodes, jobs, snapshot())))
    (rz,) = reply.resizes
    assert rz.kind == "expand" and rz.job_id == "a" and rz.placement.num_devices == 2
    assert "estimated" in rz.reason and "restart" in rz.reason and "cpu:1x2" in rz.reason
    # Without the estimator, or when the snapshot says the gain does not pay the restart
    # cost (60 s) within the remaining steps, it stays.
    assert not TesseraPolicy().schedule(adapter.build_request(nodes, jobs, 100.0)).resizes
    slow2 = live(nodes, jobs, snapshot(rows4=0.8))
    assert not TesseraPolicy().schedule(adapter.build_request(nodes, jobs, 100.0, slow2)).resizes


def test_job_the_snapshot_cannot_estimate_is_placed_as_requested():
    nodes = [node("n1")]
    unknown = job("u", batch=16)  # no profile of per-rank batch 16; dp=2 needs the missing link table
    est = live(nodes, [unknown], snapshot(comm=False))
    assert not est.knows(adapter.model_key(unknown))
    reply = TesseraPolicy().schedule(adapter.build_request(nodes, [unknown], 0.0, est))
    (p,) = reply.placements
    assert p.num_devices == 1 and not reply.infeasible


def peft_job(jid: str, steps: int = 400, created: float = 0.0) -> tpb.Job:
    """A pending one-device cpu peft job of two LoRA tasks on SMALL, batch 4."""
    from tessera import manifest

    doc = {"apiVersion": "tessera/v1", "name": jid, "tenant": "t",
           "workload": {"type": "peft", "steps": steps, "batch_size": 4, "model": dict(SMALL),
                        "peft": {"tasks": [{"name": "a", "rank": 4, "steps": steps},
                                           {"name": "b", "rank": 8, "steps": steps}]}},
           "resources": {"devices": 1, "device_kind": "cpu"}}
    j = tpb.Job(id=jid, created=created, spec=manifest.to_proto(manifest.validate(doc)))
    j.status.phase = P.PENDING
    return j


def peft_model(module: str, seconds: float, version: int = 4) -> PerfModel:
    """A snapshot holding one profile point of the peft step shape ``module`` (batch 4, quota 1)."""
    return PerfModel(version=version, profiles={"cpu": [ProfilePoint(module, 4, 32, 1, 1.0, seconds, 20, 0.05)]})


def test_a_peft_job_is_priced_by_its_step_shape_at_its_requested_count_only():
    from tessera import manifest
    from tessera.modelkey import shape_key

    j = peft_job("p")
    s = adapter.job_shape(j)
    doc = manifest.validate(manifest.from_proto(j.spec))
    assert s is not None and s.fixed and s.module == shape_key(doc["workload"], 1) and s.devices == 1
    k = adapter.model_key(j)
    assert k == job_key(s) and k.startswith("peft:")
    est = live([node("n1")], [j], peft_model(s.module, 0.25))
    assert abs(est.iter_time(k, "cpu", 1, 1) - 0.25) < 1e-9 and est.knows(k)
    assert "this workload's step" in est.describe(k, "cpu", 1, 1).reason
    # Another count is another step shape: never composed from this one.
    assert est.iter_time(k, "cpu", 1, 2) is None and est.iter_time(k, "cpu", 2, 1) is None
    assert est.stages(k, "cpu", 1, 1) == 0
    # No profile of the shape: unknown, so the policy schedules it as requested.
    assert not live([node("n1")], [j], peft_model("peft:other", 0.25)).knows(k)


def test_srpt_orders_peft_jobs_by_their_estimated_remaining_time():
    """One free device, two pending peft jobs of different step shapes: the one submitted
    later but estimated to finish sooner is placed first; without estimates, submission
    order decides."""
    slow = peft_job("slow", created=0.0)
    quick = peft_job("quick", created=1.0)
    quick.spec.workload.batch_size = 8  # another step shape (batch 8), its own profile
    ks, kq = adapter.job_shape(slow), adapter.job_shape(quick)
    assert ks.module != kq.module
    model = PerfModel(version=4, profiles={"cpu": [ProfilePoint(ks.module, 4, 32, 1, 1.0, 2.0, 20, 0.05),
                                                   ProfilePoint(kq.module, 8, 32, 1, 1.0, 0.1, 20, 0.05)]})
    nodes, jobs = [node("n1", parts=1)], [slow, quick]
    placed = TesseraPolicy().schedule(adapter.build_request(nodes, jobs, 0.0, live(nodes, jobs, model))).placements
    assert [p.job_id for p in placed] == ["quick"], placed
    placed = TesseraPolicy().schedule(adapter.build_request(nodes, jobs, 0.0)).placements
    assert [p.job_id for p in placed] == ["slow"], placed
