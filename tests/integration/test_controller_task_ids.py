"""The JobService with ids it must bound or resolve: over-long ids and tokens (refused
or echoed short, never a status too large for gRPC's metadata), and peft task ids
(``<job id>/<task>``) in WatchJobs and GetJobLogs, over real gRPC against a real etcd."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from _live import eventually
from controller import core
from controller.api import MAX_MESSAGE_BYTES, cap_message
from tessera import manifest
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import controller_pb2_grpc as cgrpc
from tessera.api.v1 import types_pb2 as tpb

# device_kind gpu: no CPU node can take it, so the job stays PENDING.
PEFT = {"apiVersion": "tessera/v1", "name": "p1", "tenant": "alice", "resources": {"device_kind": "gpu"},
        "workload": {"type": "peft", "steps": 5, "peft": {"tasks": [{"name": "t1"}, {"name": "t2"}]}}}
LONG = "x" * 20000


@pytest.fixture
async def stubs(controller):
    ch = grpc.aio.insecure_channel(controller.listen)
    yield cgrpc.JobServiceStub(ch), cgrpc.NodeServiceStub(ch)
    await ch.close()


async def submit(jobs, key: str) -> str:
    """Submit PEFT once the controller leads (UNAVAILABLE until then); its id."""
    spec = manifest.to_proto(manifest.validate(PEFT))

    async def go():
        try:
            return (await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec, idempotency_key=key))).job.id
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return None

    return await eventually(go, 20, "controller leads")


async def status_of(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        r = call()
        if hasattr(r, "__aiter__"):
            async for _ in r:
                pass
        else:
            await r
    return e.value


async def test_over_long_ids_are_invalid_argument_naming_the_field_and_echoes_are_short(stubs):
    jobs, nodes = stubs
    jid = await submit(jobs, "long")
    for field, call in [
        ("job_id", lambda: jobs.GetJob(cpb.GetJobRequest(job_id=LONG))),
        ("job_id", lambda: jobs.CancelJob(cpb.CancelJobRequest(job_id=LONG))),
        ("job_id", lambda: jobs.GetJobLogs(cpb.GetJobLogsRequest(job_id=LONG))),
        ("job_id", lambda: jobs.WatchJobs(cpb.WatchJobsRequest(job_id=LONG))),
        ("job_id", lambda: jobs.WatchJobs(cpb.WatchJobsRequest(job_id=jid + "/" + LONG))),
        ("name", lambda: nodes.Heartbeat(cpb.HeartbeatRequest(name=LONG))),
        ("name", lambda: nodes.RegisterNode(cpb.RegisterNodeRequest(name=LONG, agent_address="127.0.0.1:1"))),
        ("allocation_id", lambda: nodes.ReportExecutor(cpb.ExecutorReport(job_id=jid, allocation_id=LONG))),
        ("step_time_s", lambda: nodes.ReportExecutor(cpb.ExecutorReport(job_id=jid, allocation_id="a",
                                                                         step_time_s=float("nan")))),
        ("step_time_median_s", lambda: nodes.ReportExecutor(cpb.ExecutorReport(job_id=jid, allocation_id="a",
                                                                                step_time_median_s=-1.0))),
        ("page_token", lambda: jobs.ListJobs(cpb.ListJobsRequest(page_token="!" * 20000))),
    ]:
        e = await status_of(call)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.code(), e.details()[:200])
        assert e.details().startswith(field) and len(e.details()) < 300, e.details()[:200]
    # Within the limit yet long: NOT_FOUND, the id echoed cut short.
    for call in (lambda: jobs.GetJob(cpb.GetJobRequest(job_id="y" * 256)),
                 lambda: jobs.GetJob(cpb.GetJobRequest(job_id=jid + "/" + "z" * 200))):
        e = await status_of(call)
        assert e.code() == grpc.StatusCode.NOT_FOUND and "y" * 65 not in e.details() and "z" * 65 not in e.details()
    assert (await jobs.GetJob(cpb.GetJobRequest(job_id=jid))).status.phase == tpb.PENDING


def test_status_messages_are_capped_in_utf8_bytes():
    assert cap_message("short") == "short"
    for text in ("a" * 50000, "é" * 50000, "\U0001f600" * 50000):
        out = cap_message(text)
        assert len(out.encode()) <= MAX_MESSAGE_BYTES and out.endswith("…") and text.startswith(out[:-1])


async def test_watch_of_a_task_yields_its_view_until_the_job_ends(stubs):
    jobs, _ = stubs
    jid = await submit(jobs, "watch")
    got: list[cpb.JobEvent] = []

    async def follow():
        async for ev in jobs.WatchJobs(cpb.WatchJobsRequest(job_id=jid + "/t1")):
            got.append(ev)
            if ev.job.status.phase == tpb.CANCELLED:
                return

    w = asyncio.create_task(follow())
    await eventually(lambda: got, 20, "snapshot of the task")
    assert got[0].type == cpb.JobEvent.SNAPSHOT and got[0].job.id == jid + "/t1" and got[0].job.parent_id == jid
    assert got[0].job.status.phase == tpb.PENDING
    await jobs.CancelJob(cpb.CancelJobRequest(job_id=jid))
    await asyncio.wait_for(w, 20)
    want = await jobs.GetJob(cpb.GetJobRequest(job_id=jid + "/t1"))
    assert {ev.job.id for ev in got} == {jid + "/t1"} and got[-1].type == cpb.JobEvent.UPDATED
    assert got[-1].job == want and want.status.phase == tpb.CANCELLED
    # From a revision: only the changes after it, as the task.
    resumed = jobs.WatchJobs(cpb.WatchJobsRequest(job_id=jid + "/t2", start_revision=got[0].revision))
    later = []
    while not later or later[-1].job.status.phase != tpb.CANCELLED:
        later.append(await asyncio.wait_for(resumed.read(), 20))
    resumed.cancel()
    assert {(ev.type, ev.job.id) for ev in later} == {(cpb.JobEvent.UPDATED, jid + "/t2")}
    for bad in (jid + "/nope", "j-000000000000/t1"):
        e = await status_of(lambda: jobs.WatchJobs(cpb.WatchJobsRequest(job_id=bad)))
        assert e.code() == grpc.StatusCode.NOT_FOUND, (bad, e.code(), e.details())


class RefusingAgent:
    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def ReadLogs(self, request, timeout=None):
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="agent says no")


async def test_logs_of_a_task_are_its_jobs_executor_log(live, monkeypatch):
    async with live(prefix="/tasklogs") as cl:
        jid = await submit(cl.jobs, "logs")
        log = Path(cl.agents[0].state_dir) / "logs" / f"{jid}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("[rank 0] step 1 task t1 loss 2.0\n")
        for job_id in (jid, jid + "/t1"):
            r = await cl.jobs.GetJobLogs(cpb.GetJobLogsRequest(job_id=job_id))
            assert "==> node node-1 <==" in r.text and "task t1 loss 2.0" in r.text, (job_id, r.text)
        e = await status_of(lambda: cl.jobs.GetJobLogs(cpb.GetJobLogsRequest(job_id=jid + "/nope")))
        assert e.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.details()
        # An agent's refusal keeps its code; only an unreachable agent is UNAVAILABLE (retry).
        for code, want in [(grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
                           (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE),
                           (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE)]:
            monkeypatch.setattr(core.AgentPool, "stub", lambda self, address, code=code: RefusingAgent(code))
            e = await status_of(lambda: cl.jobs.GetJobLogs(cpb.GetJobLogsRequest(job_id=jid + "/t1")))
            assert e.code() == want and "node-1" in e.details() and "agent says no" in e.details(), (code, e.details())


async def test_logs_from_one_node_are_returned_when_another_agent_refuses(live, monkeypatch):
    """One agent refusing (a code other than NOT_FOUND) no longer fails GetJobLogs when
    another node returned the log: the refusal is a line naming its node; only when no
    node returned a log is it the call's status."""
    async with live(prefix="/tasklogs2", agents=2) as cl:
        jid = await submit(cl.jobs, "logs2")
        log = Path(cl.agents[0].state_dir) / "logs" / f"{jid}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("[rank 0] step 1 task t1 loss 2.0\n")
        real_stub, refusing = core.AgentPool.stub, cl.agents[1].listen
        monkeypatch.setattr(core.AgentPool, "stub", lambda self, address: RefusingAgent(
            grpc.StatusCode.PERMISSION_DENIED) if address == refusing else real_stub(self, address))
        r = await cl.jobs.GetJobLogs(cpb.GetJobLogsRequest(job_id=jid + "/t1"))
        assert "==> node node-1 <==" in r.text and "task t1 loss 2.0" in r.text, r.text
        assert "==> node node-2: log not read (PERMISSION_DENIED: agent says no) <==" in r.text, r.text
        log.unlink()  # node-1 now has no log (NOT_FOUND): the refusal is the status
        e = await status_of(lambda: cl.jobs.GetJobLogs(cpb.GetJobLogsRequest(job_id=jid)))
        assert e.code() == grpc.StatusCode.PERMISSION_DENIED and "node-2" in e.details(), e.details()
