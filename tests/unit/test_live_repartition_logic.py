"""The pure parts of carrying out reshards and repartitions: the partition ledger's live
regrant (cpuset keeps/extends its cores, refusals change nothing, other kinds are not
live) and the controller's checks and plans (controller/actions.py)."""

from __future__ import annotations

import pytest

from agent.devices import LocalDevice
from agent.partitions import BadGrant, CapacityRefused, CpusetBackend, NotLive, Partitions, TimeSliceBackend
from controller import actions
from controller.policy import Repartition, Reshard
from tessera import manifest
from tessera.api.v1 import types_pb2 as tpb

CPU = LocalDevice(id="cpu0", kind="cpu", model="x", memory_bytes=0, capacity=4, cores=(0, 1, 2, 3))


def test_cpuset_regrant_grows_shrinks_and_refuses_without_change():
    b = CpusetBackend(CPU)
    a = b.grant("a", "cpu0", 1)
    b.grant("b", "cpu0", 2)
    assert a.cores == (0,)
    g = b.regrant("a", 2)
    assert (g.units, g.cores, g.threads) == (2, (0, 3), 2)  # keeps core 0, adds the free one
    before = (b.partitions(), b.grants())
    with pytest.raises(CapacityRefused) as e:
        b.regrant("a", 3)
    assert "asked 3 cores" in str(e.value) and "only 2 of 4 cores are free" in str(e.value)
    assert (b.partitions(), b.grants()) == before
    with pytest.raises(BadGrant):
        b.regrant("a", 0)
    assert (b.partitions(), b.grants()) == before
    g = b.regrant("a", 1)
    assert g.cores == (0,) and b.partitions()[0].free_units == 1
    with pytest.raises(KeyError):
        b.regrant("nobody", 1)


def test_regrant_on_a_backend_that_cannot_change_live_is_refused():
    parts = Partitions([TimeSliceBackend(CPU, slots=4)])
    parts.grant("a", "cpu0", 1)
    with pytest.raises(NotLive):
        parts.regrant("a", 2)
    assert parts.describe()[0].free_units == 3
    with pytest.raises(KeyError):
        parts.regrant("b", 1)


def _job(jid: str, typ: str = "gpt", units: int = 1, devices: int = 1, mm: dict | None = None) -> tpb.Job:
    # seq_len 32: a multimodal sample of the default section needs 24 positions (validated at submission)
    wl = {"type": typ, "model": {"vocab": 64, "seq_len": 32, "layers": 1, "hidden": 32, "heads": 2}, "steps": 10,
          "batch_size": 4}
    if mm is not None:
        wl["multimodal"] = mm
    j = tpb.Job(id=jid, spec=manifest.to_proto(manifest.validate({
        "apiVersion": "tessera/v1", "name": jid, "tenant": "t", "workload": wl,
        "resources": {"devices": devices, "device_kind": "cpu"}})))
    j.status.phase = tpb.RUNNING
    j.status.allocation_id = "a-" + jid
    j.status.placement.add(node="n1", device_ids=[f"cpu{i}" for i in range(devices)],
                           partition_ids=[f"cpu{i}" for i in range(devices)] if devices > 1 else ["cpu0"], units=units)
    return j


def _nodes(cap: int = 4) -> dict:
    n = tpb.Node(name="n1")
    n.partitions.add(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=cap, unit="cores")
    return {"n1": n}


def test_reshard_problem_and_override():
    dis = _job("m", "multimodal", devices=3, mm={"mode": "disaggregated"})
    assert actions.reshard_problem(dis, Reshard("m", 2, 1)) == ""
    assert "does not cover" in actions.reshard_problem(dis, Reshard("m", 3, 0))
    assert "does not cover" in actions.reshard_problem(dis, Reshard("m", 1, 1))
    assert "not multimodal" in actions.reshard_problem(_job("g"), Reshard("g", 1, 1))
    colo = _job("c", "multimodal", mm={"mode": "colocated"})
    assert "no encoder:LLM rank split" in actions.reshard_problem(colo, Reshard("c", 1, 1))
    doc = manifest.from_proto(dis.spec)
    actions.apply_overrides(dis, doc)
    assert doc["workload"]["multimodal"].get("disaggregated", {}).get("encoder_ranks", "auto") == "auto"
    dis.status.encoder_ranks = 2
    assert "already runs" in actions.reshard_problem(dis, Reshard("m", 2, 1))
    actions.apply_overrides(dis, doc)
    assert doc["workload"]["multimodal"]["disaggregated"]["encoder_ranks"] == 2
    # A later placement on fewer ranks than the split needs: not applied.
    del dis.status.placement[0].device_ids[2:]
    doc = manifest.from_proto(dis.spec)
    actions.apply_overrides(dis, doc)
    assert doc["workload"]["multimodal"].get("disaggregated", {}).get("encoder_ranks", "auto") == "auto"


def test_repartition_plan_orders_shrinks_first_and_skips_what_does_not_apply():
    jobs = {"a": _job("a", units=3), "b": _job("b", units=1)}
    why, steps, part, node = actions.repartition_plan(Repartition("g", (("a", 0.25), ("b", 0.75)), True), jobs, _nodes())
    assert why == "" and node == "n1" and part.id == "cpu0"
    assert steps == [("a", 3, 1), ("b", 1, 3)]
    why, steps, *_ = actions.repartition_plan(Repartition("g", (("a", 0.75), ("b", 0.25)), True), jobs, _nodes())
    assert why == "the quotas already hold" and steps == []
    why, *_ = actions.repartition_plan(Repartition("g", (("x", 0.5),), True), jobs, _nodes())
    assert why == "no running member"
    jobs["b"].status.placement[0].partition_ids[0] = "cpu1"
    why, *_ = actions.repartition_plan(Repartition("g", (("a", 0.5), ("b", 0.5)), True), jobs, _nodes())
    assert "different partitions" in why
    why, *_ = actions.repartition_plan(Repartition("g", (("a", 1.5),), True), jobs, _nodes())
    assert "quotas must be in (0, 1]" in why
