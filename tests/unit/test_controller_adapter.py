"""controller/adapter.py: live state <-> policy value objects (pure, no servers)."""

from __future__ import annotations

from controller import adapter
from controller.policy import Placement, Plan, Shard, TesseraPolicy
from tessera.api.v1 import types_pb2 as tpb

P = tpb.JobPhase


def node(name: str, parts: int = 1, cores: int = 2, ready: bool = True) -> tpb.Node:
    n = tpb.Node(name=name, state=tpb.READY if ready else tpb.NOT_READY)
    for i in range(parts):
        n.devices.add(id=f"cpu{i}", kind="cpu", model="Xeon", capacity=cores)
        n.partitions.add(id=f"cpu{i}", kind="cpuset", device_id=f"cpu{i}", capacity_units=cores, unit="cores")
    return n


def job(jid: str, phase=P.PENDING, share: float = 0.0, devices: int = 1, steps: int = 100, created: float = 0.0):
    j = tpb.Job(id=jid, created=created)
    j.spec.tenant = "t"
    j.spec.workload.type = "gpt"
    j.spec.workload.steps = steps
    j.spec.resources.devices = devices
    j.spec.resources.device_kind = "cpu"
    j.spec.resources.share = share
    j.status.phase = phase
    return j


def test_quota_units_rounds_down_and_never_zero():
    assert adapter.quota_units(1.0, 8) == 8
    assert adapter.quota_units(0.5, 2) == 1
    assert adapter.quota_units(0.3, 10) == 3
    assert adapter.quota_units(0.3, 1) == 1
    assert adapter.quota_units(0.999, 100) == 99


def test_node_without_partitions_gets_one_whole_partition_per_device():
    n = tpb.Node(name="old")
    n.devices.add(id="gpu0", kind="gpu", model="H200", capacity=100)
    (p,) = adapter.node_partitions(n)
    assert (p.id, p.device_id, p.capacity_units, p.unit) == ("gpu0", "gpu0", 100, "sm_percent")


def test_request_views_partitions_pending_and_running_quota():
    a = job("a", P.RUNNING, share=0.5)
    a.status.placement.add(node="n1", device_ids=["cpu0"], partition_ids=["cpu0"], units=1)
    b = job("b", share=0.5, created=1.0)
    c = job("c", P.SUCCEEDED)
    req = adapter.build_request([node("n1"), node("n2", ready=False)], [a, b, c], now=5.0)
    assert [n.name for n in req.nodes] == ["n1", "n2"] and not req.nodes[1].ready
    d = req.nodes[0].devices[0]
    assert (d.device_id, d.model, d.capacity) == ("cpu0", "cpu", 2)
    assert [j.job_id for j in req.pending] == ["b"] and req.pending[0].gpu_fraction == 0.5
    assert req.pending[0].device_kind == "cpu" and req.pending[0].iterations == 100
    (r,) = req.running
    assert r.job.job_id == "a" and r.placement.quota == 0.5 and r.placement.group == "share:n1/cpu0"


def test_tessera_packs_two_half_jobs_on_one_partition_and_shards_carry_units():
    nodes = [node("n1")]
    req = adapter.build_request(nodes, [job("a", share=0.5), job("b", share=0.5, created=1.0)], now=2.0)
    reply = TesseraPolicy().schedule(req)
    assert sorted(p.job_id for p in reply.placements) == ["a", "b"]
    for p in reply.placements:
        (s,) = adapter.shards_for(p, {"n1": nodes[0]})
        assert (list(s.partition_ids), list(s.device_ids), s.units) == (["cpu0"], ["cpu0"], 1)
    whole = adapter.shards_for(Placement("x", (Shard("n1", ("cpu0",)),)), {"n1": nodes[0]})
    assert whole[0].units == 0 and adapter.shard_units(whole, {"n1": nodes[0]}) == {("n1", "cpu0"): 2}


def test_whole_partition_jobs_are_not_packed():
    nodes = [node("n1")]
    reply = TesseraPolicy().schedule(adapter.build_request(nodes, [job("a"), job("b", created=1.0)], now=2.0))
    assert [p.job_id for p in reply.placements] == ["a"] and [i.job_id for i in reply.infeasible] == ["b"]


def test_replan_keeps_what_divides_and_fits():
    model = tpb.ModelConfig(vocab=64, seq_len=16, layers=4, hidden=64, heads=4)
    p = tpb.ParallelPlan(dp=2, tp=1, pp=2, micro_batches=2)
    assert adapter.replan(p, model, 16, 2) == tpb.ParallelPlan(dp=1, tp=1, pp=2, micro_batches=2)
    assert adapter.replan(p, model, 16, 1) == tpb.ParallelPlan(dp=1, tp=1, pp=1, micro_batches=2)
    assert adapter.replan(tpb.ParallelPlan(dp=1, tp=2, pp=1, micro_batches=1), model, 8, 4) == \
        tpb.ParallelPlan(dp=2, tp=2, pp=1, micro_batches=1)
    assert adapter.replan(p, model, 16, 4, stages=4) == tpb.ParallelPlan(dp=1, tp=1, pp=4, micro_batches=2)
    one_layer = tpb.ModelConfig(vocab=64, seq_len=16, layers=1, hidden=64, heads=4)
    assert adapter.replan(p, one_layer, 3, 2) is None  # pp=2 needs 2 layers; dp=2 does not divide batch 3


def test_quota_units_converts_with_a_tolerance():
    # 1/3 of 6 computed in floating point, or rounded to 9 places, is 2 units, not 1.
    assert adapter.quota_units(1 / 3, 6) == 2
    assert adapter.quota_units(round(1 / 3, 9), 6) == 2
    assert adapter.quota_units(round(5 / 6, 9), 6) == 5
    assert adapter.quota_units(0.16, 6) == 1
    assert adapter.quota_units(float("nan"), 6) == 1
