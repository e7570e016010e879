"""The per-executor task cap (``MAX_TASKS`` unfinished tasks) holds within one reconcile
round against a real etcd: two pending 100-task peft guests placed "fused" onto a running
100-task host in the same round -> the first fuses, the second is refused (the host would
carry 300 tasks) and gets an executor of its own. The round used to judge every guest by
the jobs as read at its start, which do not show the guests fused earlier in it."""

from __future__ import annotations

import pytest

from _live import leading_controller
from controller import fusion
from controller.config import ControllerConfig
from controller.policy import TesseraPolicy
from tessera import manifest
from tessera.api.v1 import types_pb2 as tpb
from tessera.spec.peft import MAX_TASKS

P = tpb.JobPhase
MODEL = {"vocab": 64, "seq_len": 32, "layers": 1, "hidden": 32, "heads": 4}
NOW = 1000.0
HOST, G1, G2 = "j-000000000001", "j-000000000002", "j-000000000003"


def peft_job(jid: str, prefix: str, n: int, created: float) -> tpb.Job:
    doc = manifest.validate({"apiVersion": "tessera/v1", "name": jid.replace("j-", "p"), "tenant": "t",
                             "workload": {"type": "peft", "model": MODEL, "steps": 5, "batch_size": 3,
                                          "peft": {"tasks": [{"name": f"{prefix}{i}", "rank": 4} for i in range(n)]}},
                             "resources": {"devices": 1, "device_kind": "cpu", "share": 0.25}})
    j = tpb.Job(id=jid, spec=manifest.to_proto(doc), created=created)
    j.status.phase = P.PENDING
    j.status.history.add(phase=P.PENDING, time=NOW - 1)
    return j


class _Agents:
    """The agents' side: every ControlTask and LaunchExecutor succeeds and is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def stub(self, address: str):
        calls = self.calls

        class Stub:
            async def ControlTask(self, req, timeout=None):
                calls.append(("control", req.op, req.allocation_id))

            async def LaunchExecutor(self, req, timeout=None):
                calls.append(("launch", "", req.allocation_id))

            async def StopExecutor(self, req, timeout=None):
                calls.append(("stop", "", req.allocation_id))

        return Stub()

    async def close(self) -> None:
        pass


@pytest.fixture
async def ctl(etcd_server, request):
    ctl, store, c = await leading_controller(etcd_server, f"/fcap-{request.node.name[:40]}",
                                             ControllerConfig(grace_s=1e9), TesseraPolicy(), clock=lambda: NOW,
                                             agents=_Agents())
    n = tpb.Node(name="n1", state=tpb.READY, incarnation="inc1", agent_address="127.0.0.1:1")
    n.devices.add(id="cpu0", kind="cpu", model="x", capacity=8, cores=list(range(8)))
    n.partitions.add(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=8, unit="cores")
    await store.put_node(n, None)
    ctl.heartbeats["n1"] = NOW
    yield ctl, store
    await c.close()


async def test_a_second_guest_fused_in_the_same_round_is_refused_at_the_cap(ctl):
    ctl, store = ctl
    host = peft_job(HOST, "h", 100, 1.0)
    host.status.phase = P.RUNNING
    host.status.allocation_id = "a-host"
    host.status.placement.add(node="n1", device_ids=["cpu0"], partition_ids=["cpu0"], units=2)
    host.status.history.add(phase=P.RUNNING, time=NOW - 1)
    await store.create_job(host, "")
    await store.txn([], [store.c.transactions.put(store.alloc_key("n1", "cpu0"), b'{"a-host": 2}')])
    for jid, created in ((G1, 2.0), (G2, 3.0)):
        await store.create_job(peft_job(jid, "g", 100, created), "")

    out = await ctl.reconcile_once()

    jobs = {j.id: j for j in (await store.list_jobs())[0]}
    assert out["fused"] == 1 and out["placed"] == 1, out
    assert [g.id for g in fusion.guests_of(HOST, list(jobs.values()))] == [G1]
    assert fusion.executor_load(jobs[HOST], list(jobs.values())) == 200 <= MAX_TASKS
    g2 = jobs[G2]
    assert g2.status.phase == P.SCHEDULED and not g2.status.fused_into
    assert g2.status.allocation_id and g2.status.allocation_id != "a-host"
    assert "not fused" in g2.status.decision and f"exceed {MAX_TASKS}" in g2.status.decision
    adds = [c for c in ctl.agents.calls if c[:2] == ("control", "add")]
    assert len(adds) == 100 and {c[2] for c in adds} == {"a-host"}
    assert ("launch", "", g2.status.allocation_id) in ctl.agents.calls
