"""The controller finishes what an interrupted leader left half done, against a real etcd:
jobs of a node already marked NOT_READY are requeued by any later round (not only by the
round that marked it), a job SCHEDULED whose launch never reached its agent is requeued
once the node's heartbeats leave it out past the grace period, a late EXITED report of a
stopped allocation leaves no key behind, a progress report without a step time keeps the
last one measured, and a stray fused task whose cancel failed is
cancelled again at its next report (real gRPC on loopback to a recording agent servicer)."""

from __future__ import annotations

import json

import pytest

from _live import leading_controller, serve_agent
from controller.config import ControllerConfig
from controller.policy import FirstFit
from controller.store import Store
from tessera.api.v1 import agent_pb2, agent_pb2_grpc, controller_pb2
from tessera.api.v1 import types_pb2 as tpb
from tessera.etcdproc import free_port

P = tpb.JobPhase
K = controller_pb2.ExecutorReport
GRACE = 3.0


def node(name: str, ready: bool = True, address: str = "127.0.0.1:1") -> tpb.Node:
    n = tpb.Node(name=name, state=tpb.READY if ready else tpb.NOT_READY, incarnation="inc1", agent_address=address)
    n.devices.add(id="cpu0", kind="cpu", model="x", capacity=2)
    n.partitions.add(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=2, unit="cores")
    return n


def job(jid: str, phase: int, node_name: str, alloc: str, at: float, ranks: int = 1) -> tpb.Job:
    j = tpb.Job(id=jid, created=1.0)
    j.spec.tenant, j.spec.name = "t", jid
    j.spec.workload.type, j.spec.workload.steps = "gpt", 100
    j.spec.resources.devices, j.spec.resources.device_kind = ranks, "cpu"
    j.status.phase, j.status.allocation_id = phase, alloc
    j.status.history.add(phase=P.SCHEDULED, time=at, reason="placed")
    if phase == P.RUNNING:
        j.status.history.add(phase=P.RUNNING, time=at + 1, reason="started")
    j.status.placement.add(node=node_name, device_ids=["cpu0"] * ranks, partition_ids=["cpu0"] * ranks, first_rank=0)
    return j


@pytest.fixture
async def ctl(etcd_server, request):
    now = [1000.0]
    ctl, store, c = await leading_controller(etcd_server, f"/rec-{request.node.name[:40]}",
                                             ControllerConfig(grace_s=GRACE), FirstFit(), clock=lambda: now[0])
    yield ctl, store, c, now
    await c.close()


async def _hold(c, store: Store, node_name: str, alloc: str, units: int = 2) -> None:
    await c.put(store.alloc_key(node_name, "cpu0"), json.dumps({alloc: units}).encode())


async def test_jobs_of_a_node_already_not_ready_are_requeued_by_a_later_round(ctl):
    ctl, store, c, now = ctl
    # The previous leader marked n1 NOT_READY and died before requeueing its job.
    await store.put_node(node("n1", ready=False), None)
    await store.create_job(job("j-000000000001", P.RUNNING, "n1", "a-1", now[0] - 50), "")
    await _hold(c, store, "n1", "a-1")
    await ctl.reconcile_once()
    j = (await store.get_job("j-000000000001")).value
    assert j.status.phase in (P.PENDING, P.SCHEDULED) and j.status.allocation_id != "a-1"
    assert any(h.phase == P.PENDING and "node n1 is not ready" in h.reason for h in j.status.history)
    assert "a-1" not in {a for hs in (await store.list_holders()).values() for a in hs}


async def test_scheduled_job_never_launched_is_requeued_after_the_grace(ctl):
    ctl, store, c, now = ctl
    await store.put_node(node("n2"), None)
    await store.create_job(job("j-000000000002", P.SCHEDULED, "n2", "a-2", now[0]), "")
    await _hold(c, store, "n2", "a-2")
    hb = controller_pb2.HeartbeatRequest(name="n2", incarnation="inc1", running_allocations=[])
    # Within the grace: the launch may still be on its way — nothing happens.
    now[0] += GRACE / 2
    await ctl.heartbeat(hb)
    await ctl._requeue_never_launched(now[0], (await store.list_jobs())[0])
    assert (await store.get_job("j-000000000002")).value.status.phase == P.SCHEDULED
    # A heartbeat past the grace that lists the allocation: it runs, nothing happens.
    now[0] += GRACE
    await ctl.heartbeat(controller_pb2.HeartbeatRequest(name="n2", incarnation="inc1", running_allocations=["a-2"]))
    await ctl._requeue_never_launched(now[0], (await store.list_jobs())[0])
    assert (await store.get_job("j-000000000002")).value.status.phase == P.SCHEDULED
    # A later heartbeat without it: never launched -> requeued as transient (a preemption).
    now[0] += 1
    await ctl.heartbeat(hb)
    await ctl._requeue_never_launched(now[0], (await store.list_jobs())[0])
    j = (await store.get_job("j-000000000002")).value
    assert j.status.phase == P.PENDING and j.status.allocation_id == "" and j.status.preemptions == 1
    assert "executor never started on n2" in j.status.reason
    assert "a-2" not in {a for hs in (await store.list_holders()).values() for a in hs}


async def test_grace_counts_from_the_launch_of_a_relaunch(ctl):
    """A relaunch waits for the old ranks to checkpoint before it launches: a heartbeat
    that arrived during that wait (without the new allocation) does not requeue the job
    once the launch went out; a heartbeat past the launch's grace that still lacks it does."""
    ctl, store, c, now = ctl
    await store.put_node(node("n5"), None)
    await store.create_job(job("j-000000000005", P.SCHEDULED, "n5", "a-5", now[0]), "")
    await _hold(c, store, "n5", "a-5")
    hb = controller_pb2.HeartbeatRequest(name="n5", incarnation="inc1", running_allocations=[])
    now[0] += 2 * GRACE  # the old ranks took this long to checkpoint and exit
    await ctl.heartbeat(hb)  # sent during that wait
    ctl.launched_at["a-5"] = now[0]  # the launch went out now
    now[0] += 1
    await ctl._requeue_never_launched(now[0], (await store.list_jobs())[0])
    assert (await store.get_job("j-000000000005")).value.status.phase == P.SCHEDULED
    now[0] += GRACE
    await ctl.heartbeat(hb)
    await ctl._requeue_never_launched(now[0], (await store.list_jobs())[0])
    assert (await store.get_job("j-000000000005")).value.status.phase == P.PENDING


async def test_exit_of_a_stopped_allocation_leaves_no_key_and_exits_of_the_current_one_complete_it(ctl):
    ctl, store, c, now = ctl
    await store.put_node(node("n3"), None)
    await store.create_job(job("j-000000000003", P.RUNNING, "n3", "a-3", now[0], ranks=2), "")
    await _hold(c, store, "n3", "a-3")
    # Late EXITED of an allocation the job no longer holds: stale, nothing written.
    stale = await ctl.report(K(kind=K.EXITED, job_id="j-000000000003", allocation_id="a-old", rank=0, exit_code=143,
                               node="n3"))
    assert stale and await store.rank_exits("a-old") == {}
    # The current allocation: rank 0's exit is recorded with the job, rank 1's completes it.
    assert not await ctl.report(K(kind=K.EXITED, job_id="j-000000000003", allocation_id="a-3", rank=0, exit_code=0,
                                  node="n3"))
    assert await store.rank_exits("a-3") == {0: 0}
    assert (await store.get_job("j-000000000003")).value.status.phase == P.RUNNING
    await ctl.report(K(kind=K.EXITED, job_id="j-000000000003", allocation_id="a-3", rank=1, exit_code=0, node="n3"))
    assert (await store.get_job("j-000000000003")).value.status.phase == P.SUCCEEDED
    assert await store.rank_exits("a-3") == {}


async def test_progress_without_a_step_time_keeps_the_last_measured_one(ctl):
    """A resumed run with nothing left to train reports where it stands without a step time
    (agent.runtime.train): the status takes its step and loss, and keeps the step time
    last measured."""
    ctl, store, c, now = ctl
    await store.put_node(node("n4"), None)
    await store.create_job(job("j-000000000004", P.RUNNING, "n4", "a-4", now[0]), "")
    await ctl.report(K(kind=K.PROGRESS, job_id="j-000000000004", allocation_id="a-4", rank=0, step=90, loss=2.5,
                       step_time_s=0.02, node="n4"))
    await ctl.report(K(kind=K.PROGRESS, job_id="j-000000000004", allocation_id="a-4", rank=0, step=100, loss=2.0,
                       node="n4"))
    st = (await store.get_job("j-000000000004")).value.status
    assert (st.step, st.loss, st.step_time_s) == (100, 2.0, 0.02)


class RecordingAgent(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def ControlTask(self, request, context):
        self.calls.append((request.op, request.task))
        return agent_pb2.ControlTaskResponse()


async def test_stray_fused_task_cancel_is_retried_until_it_goes_through(ctl):
    ctl, store, c, now = ctl
    # The agent is unreachable first (a real RPC that fails), then answers.
    await store.put_node(node("n4", address=f"127.0.0.1:{free_port()}"), None)
    host = job("j-00000000000a", P.RUNNING, "n4", "a-4", now[0])
    await store.create_job(host, "")
    stray = K(kind=K.TASK, job_id="j-00000000000a", allocation_id="a-4", node="n4",
              task="j-0000000000bb_t0", task_phase="running", step=3, total_steps=10)
    await ctl.report(stray)  # guest j-0000000000bb unknown: a stray; the cancel fails
    assert ("a-4", "j-0000000000bb_t0") not in ctl._strays
    agent = RecordingAgent()
    server, address = await serve_agent(agent)
    try:
        await store.put_node(node("n4", address=address), None)
        await ctl.report(stray)  # retried, and it goes through
        await ctl.report(stray)  # remembered: not sent again
        assert agent.calls == [("cancel", "j-0000000000bb_t0")]
        # The host's allocation ends: what was remembered for it goes at the next round.
        await c.delete(store.job_key("j-00000000000a"))
        await ctl.reconcile_once()
        assert not ctl._strays
    finally:
        await server.stop(None)


async def test_an_executor_the_agent_stopped_itself_requeues_the_job_instead_of_failing_it(ctl):
    """EXITED 143 from the agent's own shutdown or self-fencing (stopped_by_agent): the job
    goes back to PENDING as a preemption, its units released; the same exit without the
    flag (the runtime died by itself) fails the job as before."""
    ctl, store, c, now = ctl
    await store.put_node(node("n6"), None)
    for jid, alloc in (("j-000000000006", "a-6"), ("j-000000000007", "a-7")):
        await store.create_job(job(jid, P.RUNNING, "n6", alloc, now[0]), "")
    await c.put(store.alloc_key("n6", "cpu0"), json.dumps({"a-6": 1, "a-7": 1}).encode())
    await ctl.report(K(kind=K.EXITED, job_id="j-000000000006", allocation_id="a-6", rank=0, exit_code=143,
                       node="n6", message="stopped by SIGTERM", stopped_by_agent=True))
    j = (await store.get_job("j-000000000006")).value
    assert j.status.phase == P.PENDING and j.status.preemptions == 1 and "stopped by the agent" in j.status.reason
    await ctl.report(K(kind=K.EXITED, job_id="j-000000000007", allocation_id="a-7", rank=0, exit_code=143,
                       node="n6", message="stopped by SIGTERM"))
    assert (await store.get_job("j-000000000007")).value.status.phase == P.FAILED
    assert not {a for hs in (await store.list_holders()).values() for a in hs} & {"a-6", "a-7"}


async def test_one_bad_job_does_not_stop_the_profiling_cycle_for_the_others(ctl, tmp_path):
    """A stored job whose spec no longer validates (rules tightened since it was stored)
    is skipped with a log line; the jobs after it still get their estimate state (a real
    estimator service on loopback)."""
    from controller.profiling import Profiling
    from tests.integration.test_estimator_service import Est

    ctl, store, c, now = ctl
    bad = job("j-00000000000b", P.PENDING, "n7", "", now[0])
    bad.spec.workload.model.hidden, bad.spec.workload.model.heads = 30, 4  # hidden % heads != 0
    good = job("j-00000000000c", P.PENDING, "n7", "", now[0])
    good.spec.workload.model.hidden, good.spec.workload.model.heads = 32, 4
    for j in (bad, good):
        del j.status.placement[:]
        j.spec.api_version = "tessera/v1"
        j.spec.workload.batch_size, j.spec.workload.model.layers = 4, 1
        j.spec.workload.model.vocab, j.spec.workload.model.seq_len = 64, 16
        await store.create_job(j, "")
    async with Est(tmp_path / "est") as est:
        prof = Profiling(ctl, f"127.0.0.1:{est.port}", steps=4, interval_s=0.1)
        out = await prof.once()
    assert out["requested"] == 1
    assert (await store.get_job("j-00000000000c")).value.status.estimate.status == "profiling"
    assert (await store.get_job("j-00000000000b")).value.status.estimate.status == ""
