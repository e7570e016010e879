"""The controller core under repeated faults, against a real etcd and a recording agent on
loopback gRPC (the controller's clock injected): transient launch refusals back off and keep
the record bounded, one job's failing write does not abort the round for the others, an
agent restart requeues without counting a failed attempt, a requeued peft job's tasks stop
showing RUNNING, a re-placement resets/rescales the measured busy fraction, and a slow
StopExecutor does not delay node liveness."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from _live import eventually, leading_controller, serve_agent
from controller.config import ControllerConfig
from controller.core import TRANSIENT_BACKOFF_MAX_S
from controller.policy import FirstFit
from controller.records import HISTORY_KEEP, dropped_transitions
from tessera import manifest
from tessera.api.v1 import agent_pb2, agent_pb2_grpc, controller_pb2
from tessera.api.v1 import types_pb2 as tpb

P = tpb.JobPhase
K = controller_pb2.ExecutorReport
MODEL = {"vocab": 64, "seq_len": 32, "layers": 1, "hidden": 32, "heads": 4}


class Agent(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.launch_code: grpc.StatusCode | None = None
        self.stop_delay = 0.0

    async def LaunchExecutor(self, request, context):
        self.calls.append(("launch", request.allocation_id, request.job_id))
        if self.launch_code is not None:
            await context.abort(self.launch_code, "partition cpu0 is still granted to an executor that has not exited")
        return agent_pb2.LaunchExecutorResponse()

    async def StopExecutor(self, request, context):
        self.calls.append(("stop", request.allocation_id))
        if self.stop_delay:
            await asyncio.sleep(self.stop_delay)  # the agent's side: ranks checkpointing
        return agent_pb2.StopExecutorResponse()

    async def ControlTask(self, request, context):
        self.calls.append(("control", request.op, request.allocation_id, request.task))
        return agent_pb2.ControlTaskResponse()


def gpt(name: str = "g") -> tpb.JobSpec:
    return manifest.to_proto(manifest.validate({
        "apiVersion": "tessera/v1", "name": name, "tenant": "it",
        "workload": {"type": "gpt", "model": MODEL, "steps": 30, "batch_size": 4, "learning_rate": 0.01,
                     "plan": {"dp": 1, "tp": 1, "pp": 1, "micro_batches": 1}, "checkpoint_every": 10},
        "resources": {"devices": 1, "device_kind": "cpu"}}))


def peft(name: str, tasks: dict[str, int]) -> tpb.JobSpec:
    return manifest.to_proto(manifest.validate({
        "apiVersion": "tessera/v1", "name": name, "tenant": "it",
        "workload": {"type": "peft", "model": MODEL, "steps": 50, "batch_size": 4, "learning_rate": 0.02,
                     "checkpoint_every": 10,
                     "peft": {"mode": "spatial", "tasks": [{"name": t, "rank": 4, "steps": s} for t, s in tasks.items()]}},
        "resources": {"devices": 1, "device_kind": "cpu"}}))


def reg(name: str, addr: str, cap: int = 2) -> controller_pb2.RegisterNodeRequest:
    r = controller_pb2.RegisterNodeRequest(name=name, agent_address=addr)
    r.devices.add(id="cpu0", kind="cpu", model="x", capacity=cap)
    r.partitions.add(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=cap, unit="cores", free_units=cap)
    return r


@pytest.fixture
async def env(etcd_server, tmp_path, request):
    now = [1000.0]
    ctl, store, c = await leading_controller(
        etcd_server, f"/cf-{request.node.name[:40]}",
        ControllerConfig(grace_s=3.0, max_attempts=2, checkpoint_root=str(tmp_path / "ckpt")), FirstFit(),
        clock=lambda: now[0])
    agent = Agent()
    server, address = await serve_agent(agent)
    yield ctl, store, now, agent, address
    await server.stop(None)
    await ctl.agents.close()
    await c.close()


async def test_busy_launch_refusals_back_off_and_the_history_stays_bounded(env):
    """An agent that keeps refusing a launch as RESOURCE_EXHAUSTED (a partition still
    held): each refusal is a transient requeue (not a failed attempt); the n-th in a row
    keeps the job out of the rounds for min(2^(n-1), 60) s, said in its reason and its
    "wait" decision; the job is placed again once that passed; the record stays small and
    the job can still be cancelled."""
    ctl, store, now, agent, addr = env
    agent.launch_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    inc = (await ctl.register(reg("n1", addr))).incarnation
    job, _ = await ctl.submit(gpt(), "")

    def launches() -> int:
        return sum(1 for c in agent.calls if c[0] == "launch")

    await ctl.reconcile_once()
    assert launches() == 1
    j = (await store.get_job(job.id)).value
    assert j.status.phase == P.PENDING and j.status.preemptions == 1
    assert "not re-placed for 1s" in j.status.reason and "1 transient requeues in a row" in j.status.reason
    assert j.status.last_decision.action == "wait" and "backoff" in j.status.last_decision.reason
    # Rounds within the backoff do not place it; once it passed, the next round does.
    await ctl.reconcile_once()
    assert launches() == 1
    now[0] += 1.01
    await ctl.reconcile_once()
    assert launches() == 2
    assert "not re-placed for 2s" in (await store.get_job(job.id)).value.status.reason
    now[0] += 1.5
    await ctl.reconcile_once()
    assert launches() == 2  # 2 s not over yet
    # Many more refusals: the wait doubles up to its cap; the history is bounded.
    for _ in range(120):
        now[0] += TRANSIENT_BACKOFF_MAX_S + 0.01
        await ctl.heartbeat(controller_pb2.HeartbeatRequest(name="n1", incarnation=inc))
        await ctl.reconcile_once()
    j = (await store.get_job(job.id)).value
    assert launches() == 122
    assert f"not re-placed for {TRANSIENT_BACKOFF_MAX_S:g}s" in j.status.reason
    assert len(j.status.history) == HISTORY_KEEP + 1 and j.status.history[0].phase == P.PENDING
    assert dropped_transitions(j) == 2 * 122 + 1 - (HISTORY_KEEP + 1)
    assert j.status.phase == P.PENDING and j.status.attempts == j.status.preemptions == 122
    assert (await ctl.cancel(job.id, "operator")).status.phase == P.CANCELLED


async def test_a_running_job_starts_its_backoff_over(env):
    """Once the job runs, its next transient requeue waits the first step again (1 s)."""
    ctl, store, now, agent, addr = env
    agent.launch_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    inc = (await ctl.register(reg("n1", addr))).incarnation
    job, _ = await ctl.submit(gpt(), "")
    for _ in range(3):
        await ctl.reconcile_once()
        now[0] += 2.5
        await ctl.reconcile_once()
        now[0] += 2.5
        await ctl.heartbeat(controller_pb2.HeartbeatRequest(name="n1", incarnation=inc))
    r = (await store.get_job(job.id)).value.status.reason
    assert "not re-placed for" in r and "not re-placed for 1s" not in r
    now[0] += TRANSIENT_BACKOFF_MAX_S
    await ctl.heartbeat(controller_pb2.HeartbeatRequest(name="n1", incarnation=inc))
    agent.launch_code = None
    await ctl.reconcile_once()
    j = (await store.get_job(job.id)).value
    assert j.status.phase == P.SCHEDULED
    await ctl.report(K(kind=K.STARTED, job_id=job.id, allocation_id=j.status.allocation_id, node="n1"))
    await ctl.report(K(kind=K.EXITED, job_id=job.id, allocation_id=j.status.allocation_id, node="n1", rank=0,
                       exit_code=143, stopped_by_agent=True, message="agent shutdown"))
    assert "not re-placed for 1s" in (await store.get_job(job.id)).value.status.reason


async def test_one_jobs_failing_write_does_not_abort_the_round(env):
    """A job whose write fails (here: etcd refuses it) is logged and skipped; the round
    still places the other jobs."""
    ctl, store, now, agent, addr = env
    await ctl.register(reg("n1", addr))
    await ctl.register(reg("n2", addr))
    bad, _ = await ctl.submit(gpt("bad"), "")
    good, _ = await ctl.submit(gpt("good"), "")
    update = store.update_job

    async def failing(job, *a, **kw):
        if job.id == bad.id:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "etcdserver: request is too large")
        return await update(job, *a, **kw)

    store.update_job = failing
    out = await ctl.reconcile_once()
    assert out["placed"] == 1
    assert (await store.get_job(good.id)).value.status.phase == P.SCHEDULED
    assert (await store.get_job(bad.id)).value.status.phase == P.PENDING


async def test_agent_restarts_requeue_without_counting_a_failed_attempt(env):
    """A node whose agent re-registers (new incarnation) requeues its jobs as preemptions:
    more restarts than ``max_attempts`` (2 here) never fail a healthy job, and each is in
    its history and ``preemptions``."""
    ctl, store, now, agent, addr = env
    await ctl.register(reg("n1", addr))
    job, _ = await ctl.submit(gpt(), "")
    for i in range(3):
        await ctl.reconcile_once()
        j = (await store.get_job(job.id)).value
        assert j.status.phase == P.SCHEDULED, (i, j.status.reason)
        await ctl.report(K(kind=K.STARTED, job_id=job.id, allocation_id=j.status.allocation_id, node="n1"))
        now[0] += 1
        await ctl.register(reg("n1", addr))  # the agent restarted
        j = (await store.get_job(job.id)).value
        assert j.status.phase == P.PENDING and "node re-registered" in j.status.reason
        assert "not re-placed" not in j.status.reason  # no backoff: the node is back
    await ctl.reconcile_once()
    j = (await store.get_job(job.id)).value
    assert j.status.phase == P.SCHEDULED and j.status.attempts == 4 and j.status.preemptions == 3
    assert sum("node re-registered" in h.reason for h in j.status.history) == 3


async def test_a_requeued_or_preempted_peft_jobs_running_tasks_wait_to_resume(env):
    """After a requeue (agent restart) or a preemption, a peft job's task that was RUNNING
    is PENDING "waiting to resume (job requeued: ...)" in its own view; an ended task keeps
    its outcome; the task's next running report makes it RUNNING again."""
    ctl, store, now, agent, addr = env
    await ctl.register(reg("n1", addr))
    job, _ = await ctl.submit(peft("p", {"t0": 100, "t1": 5}), "")
    await ctl.reconcile_once()
    alloc = (await store.get_job(job.id)).value.status.allocation_id
    for t, ph in (("t0", "running"), ("t1", "succeeded")):
        await ctl.report(K(kind=K.TASK, job_id=job.id, allocation_id=alloc, node="n1", task=t, task_phase=ph, step=5,
                           total_steps=100, loss=1.0))
    assert (await ctl.get(job.id + "/t0")).status.phase == P.RUNNING
    await ctl.register(reg("n1", addr))  # agent restart: requeue
    assert (await ctl.get(job.id)).status.phase == P.PENDING
    t0, t1 = await ctl.get(job.id + "/t0"), await ctl.get(job.id + "/t1")
    assert t0.status.phase == P.PENDING and t0.status.reason.startswith("waiting to resume (job requeued: node re-")
    assert t1.status.phase == P.SUCCEEDED
    # Placed again, the task resumes; then a preemption.
    await ctl.reconcile_once()
    alloc = (await store.get_job(job.id)).value.status.allocation_id
    await ctl.report(K(kind=K.TASK, job_id=job.id, allocation_id=alloc, node="n1", task="t0", task_phase="running",
                       step=6, total_steps=100, loss=1.0))
    t0 = await ctl.get(job.id + "/t0")
    assert t0.status.phase == P.RUNNING and not t0.status.reason.startswith("waiting")
    assert await ctl._preempt((await store.get_job(job.id)).value, "make room", "d-1")
    t0 = await ctl.get(job.id + "/t0")
    assert t0.status.phase == P.PENDING and "job requeued: preempted: make room" in t0.status.reason
    assert (await ctl.get(job.id + "/t1")).status.phase == P.SUCCEEDED


async def test_busy_follows_the_units_of_a_resize_and_resets_on_a_new_placement(env):
    """``status.busy`` is a fraction of the current quota: a resize from 1 to all 4 cores
    rescales it (1.0 -> 0.25); a preempted job placed again starts unmeasured (0)."""
    from controller.policy import Placement, Resize
    from controller.policy.types import Shard

    ctl, store, now, agent, addr = env
    await ctl.register(reg("n1", addr, cap=4))
    nodes = {"n1": (await store.get_node("n1")).value}
    job, _ = await ctl.submit(gpt(), "")
    await ctl._place((await store.get_job(job.id)).value,
                     Placement(job.id, (Shard("n1", ("cpu0",)),), reason="pack", quota=0.25), nodes, "d-0")
    j = (await store.get_job(job.id)).value
    assert j.status.phase == P.SCHEDULED and j.status.placement[0].units == 1
    j.status.busy = 1.0  # saturating its one core
    await store.update_job(j, (await store.get_job(job.id)).mod_revision)
    rz = Resize(job.id, Placement(job.id, (Shard("n1", ("cpu0",)),), reason="expand", quota=1.0), kind="expand")
    assert await ctl._resize((await store.get_job(job.id)).value, rz, nodes, "d-1")
    j = (await store.get_job(job.id)).value
    assert (j.status.placement[0].units or 4) == 4 and j.status.busy == pytest.approx(0.25)
    assert await ctl._preempt(j, "make room", "d-2")
    await ctl.reconcile_once()
    j = (await store.get_job(job.id)).value
    assert j.status.phase == P.SCHEDULED and j.status.busy == 0.0


async def test_a_slow_stop_does_not_delay_node_liveness(env):
    """A round waiting on a StopExecutor (the agent answers once the ranks checkpointed,
    here after 6 s) does not delay liveness: a node silent past its grace (1 s) is marked
    NOT_READY while that stop is still in progress (real clock)."""
    import dataclasses

    from controller.policy import ScheduleReply
    from controller.policy.types import Preempt

    ctl, store, now, agent, addr = env
    ctl.cfg = dataclasses.replace(ctl.cfg, grace_s=1.0, reconcile_interval_s=0.1)
    ctl.clock = time.time
    agent.stop_delay = 6.0
    await ctl.on_elected()
    await ctl.register(reg("n1", addr))
    await ctl.register(reg("n2", "127.0.0.1:1"))  # never heartbeats
    job, _ = await ctl.submit(gpt(), "")
    j = (await store.get_job(job.id)).value

    class PreemptOnce:
        name = "preempt-once"
        done = False

        def schedule(self, req):
            if self.done:
                return ScheduleReply()
            if not any(r.placement.job_id == job.id for r in req.running):
                return FirstFit().schedule(req)
            self.done = True
            return ScheduleReply(preemptions=(Preempt(job.id, "make room"),))

    ctl.policy = PreemptOnce()
    await ctl.reconcile_once()  # placed on n1 (first fit)
    j = (await store.get_job(job.id)).value
    assert j.status.phase == P.SCHEDULED and j.status.placement[0].node == "n1"
    await ctl.report(K(kind=K.STARTED, job_id=job.id, allocation_id=j.status.allocation_id, node="n1"))
    stop = asyncio.Event()
    inc1 = (await store.get_node("n1")).value.incarnation
    loop = asyncio.create_task(ctl.run(stop))
    try:
        t0 = time.time()
        await eventually(lambda: any(c[0] == "stop" for c in agent.calls), timeout=5, what="the slow stop sent")
        # n1 keeps heartbeating (its agent is alive, busy checkpointing); n2 is silent.
        async def n2_lost():
            await ctl.heartbeat(controller_pb2.HeartbeatRequest(name="n1", incarnation=inc1))
            return (await store.get_node("n2")).value.state == tpb.NOT_READY
        await eventually(n2_lost, timeout=4.5, what="n2 marked NOT_READY while the stop is awaited", interval=0.1)
        assert time.time() - t0 < agent.stop_delay  # the stop is still in progress
        assert (await store.get_node("n1")).value.state == tpb.READY
    finally:
        stop.set()
        ctl.kick.set()
        await asyncio.wait_for(loop, 15)
