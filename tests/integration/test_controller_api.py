"""JobService and NodeService over real gRPC against a real etcd."""

from __future__ import annotations

import asyncio

import aetcd
import grpc
import pytest

from tessera import manifest
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import controller_pb2_grpc as cgrpc
from tessera.api.v1 import types_pb2 as tpb

DOC = {"apiVersion": "tessera/v1", "name": "j1", "tenant": "alice",
       "workload": {"type": "gpt", "steps": 5, "model": {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8}}}


def spec(**over):
    d = manifest.validate({**DOC, **over})
    return manifest.to_proto(d)


@pytest.fixture
async def stubs(controller):
    ch = grpc.aio.insecure_channel(controller.listen)
    yield cgrpc.JobServiceStub(ch), cgrpc.NodeServiceStub(ch), controller
    await ch.close()


async def wait_leader(jobs):
    for _ in range(200):
        try:
            await jobs.ListJobs(cpb.ListJobsRequest())
            r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(name="probe"), idempotency_key="probe"))
            return r
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("controller never became leader")


async def etcd_keys(cfg, sub: str) -> list[bytes]:
    host, port = cfg.etcd.rsplit(":", 1)
    async with aetcd.Client(host=host, port=int(port)) as c:
        return [kv.key for kv in await c.get_prefix(f"{cfg.prefix}/{sub}".encode())]


async def test_submit_is_idempotent_and_conflicting_key_is_already_exists(stubs):
    jobs, _, cfg = stubs
    await wait_leader(jobs)
    a = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(), idempotency_key="k1"))
    b = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(), idempotency_key="k1"))
    assert a.created and not b.created and a.job.id == b.job.id
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(name="other"), idempotency_key="k1"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    got = await jobs.GetJob(cpb.GetJobRequest(job_id=a.job.id))
    assert got.status.phase in (tpb.PENDING,) and got.status.history[0].phase == tpb.PENDING
    assert len(await etcd_keys(cfg, "jobs")) == 2  # the probe job and j1, once


@pytest.mark.parametrize("mutate,field", [
    (lambda s: setattr(s.workload, "steps", -5), "workload.steps"),
    (lambda s: setattr(s, "name", "Bad_Name"), "name"),
    (lambda s: setattr(s.workload, "type", "nope"), "workload.type"),
    (lambda s: setattr(s.resources, "devices", 3), "resources.devices"),
    (lambda s: setattr(s, "api_version", "v0"), "apiVersion"),
])
async def test_bad_spec_is_invalid_argument_naming_the_field_and_writes_nothing(stubs, mutate, field):
    jobs, _, cfg = stubs
    await wait_leader(jobs)
    before = await etcd_keys(cfg, "")
    s = spec()
    mutate(s)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await jobs.SubmitJob(cpb.SubmitJobRequest(spec=s, idempotency_key="bad"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()
    assert await etcd_keys(cfg, "") == before


async def test_get_unknown_is_not_found_and_list_filters_and_paginates(stubs):
    jobs, _, _ = stubs
    await wait_leader(jobs)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await jobs.GetJob(cpb.GetJobRequest(job_id="j-000000000000"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    ids = []
    for i in range(5):
        r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(name=f"p{i}", tenant="bob")))
        ids.append(r.job.id)
    seen, token = [], ""
    while True:
        page = await jobs.ListJobs(cpb.ListJobsRequest(tenant="bob", page_size=2, page_token=token))
        assert len(page.jobs) <= 2
        seen += [j.id for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert seen == ids
    none = await jobs.ListJobs(cpb.ListJobsRequest(tenant="bob", phases=[tpb.SUCCEEDED]))
    assert list(none.jobs) == []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await jobs.ListJobs(cpb.ListJobsRequest(page_token="zzz"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in e.value.details()


async def test_cancel_pending_and_watch_resumes_from_revision(stubs):
    jobs, _, _ = stubs
    await wait_leader(jobs)
    r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(name="w")))
    snap = jobs.WatchJobs(cpb.WatchJobsRequest(job_id=r.job.id))
    first = await snap.read()
    assert first.type == cpb.JobEvent.SNAPSHOT and first.job.status.phase == tpb.PENDING
    snap.cancel()
    c = await jobs.CancelJob(cpb.CancelJobRequest(job_id=r.job.id, reason="test"))
    assert c.status.phase == tpb.CANCELLED
    again = await jobs.CancelJob(cpb.CancelJobRequest(job_id=r.job.id))
    assert again.status.phase == tpb.CANCELLED
    # Resume from the snapshot's revision: the cancellation is delivered.
    w = jobs.WatchJobs(cpb.WatchJobsRequest(job_id=r.job.id, start_revision=first.revision))
    ev = await asyncio.wait_for(w.read(), 10)
    while ev.job.status.phase != tpb.CANCELLED:
        ev = await asyncio.wait_for(w.read(), 10)
    assert ev.type == cpb.JobEvent.UPDATED and ev.revision > first.revision
    w.cancel()


async def test_node_register_heartbeat_and_grace(stubs):
    jobs, nodes, cfg = stubs
    await wait_leader(jobs)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await nodes.RegisterNode(cpb.RegisterNodeRequest(name="n1", agent_address="127.0.0.1:1"))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("devices")
    dev = tpb.Device(id="cpu0", kind="cpu", model="x", capacity=1)
    r1 = await nodes.RegisterNode(cpb.RegisterNodeRequest(name="n1", agent_address="127.0.0.1:1", devices=[dev]))
    await nodes.Heartbeat(cpb.HeartbeatRequest(name="n1", incarnation=r1.incarnation))
    r2 = await nodes.RegisterNode(cpb.RegisterNodeRequest(name="n1", agent_address="127.0.0.1:1", devices=[dev]))
    assert r2.incarnation != r1.incarnation
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await nodes.Heartbeat(cpb.HeartbeatRequest(name="n1", incarnation=r1.incarnation))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    ls = await nodes.ListNodes(cpb.ListNodesRequest())
    assert [n.name for n in ls.nodes] == ["n1"] and ls.nodes[0].state == tpb.READY
    # Stop heartbeating: NOT_READY after the grace period (3 s here).
    for _ in range(200):
        ls = await nodes.ListNodes(cpb.ListNodesRequest())
        if ls.nodes[0].state == tpb.NOT_READY:
            break
        await asyncio.sleep(0.05)
    assert ls.nodes[0].state == tpb.NOT_READY


async def test_pages_do_not_skip_a_job_when_another_leaves_the_filter(stubs):
    """Keyset pages: a job that changes phase between two pages (leaves the filter) does
    not shift the next page past a job never returned."""
    jobs, _, _ = stubs
    await wait_leader(jobs)
    ids = [(await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(name=f"k{i}", tenant="kim")))).job.id
           for i in range(3)]
    first = await jobs.ListJobs(cpb.ListJobsRequest(tenant="kim", phases=[tpb.PENDING], page_size=1))
    assert [j.id for j in first.jobs] == ids[:1] and first.next_page_token
    await jobs.CancelJob(cpb.CancelJobRequest(job_id=ids[0]))  # leaves the PENDING filter
    seen, token = [], first.next_page_token
    while token:
        page = await jobs.ListJobs(cpb.ListJobsRequest(tenant="kim", phases=[tpb.PENDING], page_size=1,
                                                       page_token=token))
        seen += [j.id for j in page.jobs]
        token = page.next_page_token
    assert seen == ids[1:]


async def test_oversized_inputs_are_invalid_argument_naming_the_field_and_change_nothing(stubs):
    jobs, nodes, _ = stubs
    await wait_leader(jobs)
    r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(name="long-reason")))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await jobs.CancelJob(cpb.CancelJobRequest(job_id=r.job.id, reason="r" * 501))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("reason")
    assert (await jobs.GetJob(cpb.GetJobRequest(job_id=r.job.id))).status.phase == tpb.PENDING
    dev = tpb.Device(id="cpu0", kind="cpu", model="x", capacity=-3)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await nodes.RegisterNode(cpb.RegisterNodeRequest(name="bad", agent_address="127.0.0.1:1", devices=[dev]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "devices[0].capacity" in e.value.details()
    dev = tpb.Device(id="cpu0", kind="cpu", model="x", capacity=1, memory_bytes=-1)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await nodes.RegisterNode(cpb.RegisterNodeRequest(name="bad", agent_address="127.0.0.1:1", devices=[dev]))
    assert "devices[0].memory_bytes" in e.value.details()
    assert "bad" not in [n.name for n in (await nodes.ListNodes(cpb.ListNodesRequest())).nodes]


async def test_a_spec_over_the_size_limit_is_invalid_argument(stubs, monkeypatch):
    """The normalised spec's size is bounded (etcd refuses large requests and every list
    reads every job); the limit is lowered here so that an ordinary spec crosses it."""
    from controller import core

    jobs, _, _ = stubs
    await wait_leader(jobs)
    monkeypatch.setattr(core, "MAX_SPEC_BYTES", 64)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(name="big", tenant="sz")))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("spec")
    assert list((await jobs.ListJobs(cpb.ListJobsRequest(tenant="sz"))).jobs) == []


async def test_a_quiet_watch_sends_its_open_metadata_before_any_event(stubs):
    """A watch from the current revision of a job that does not change sends no event; the
    controller still answers with initial metadata (``wire.WATCH_OPEN_METADATA_KEY``) at
    once, so a client (async or blocking) knows the call connected and restarts its
    outage clock (tessera.client._WatchState)."""
    from tessera.wire import WATCH_OPEN_METADATA_KEY

    jobs, _, cfg = stubs
    await wait_leader(jobs)
    r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec(name="quiet")))
    snap = jobs.WatchJobs(cpb.WatchJobsRequest(job_id=r.job.id))
    first = await snap.read()
    snap.cancel()
    req = cpb.WatchJobsRequest(job_id=r.job.id, start_revision=first.revision)
    w = jobs.WatchJobs(req)
    md = await asyncio.wait_for(w.initial_metadata(), 10)
    assert dict(md).get(WATCH_OPEN_METADATA_KEY) == "1"
    w.cancel()

    def blocking() -> tuple:
        with grpc.insecure_channel(cfg.listen) as ch:
            call = cgrpc.JobServiceStub(ch).WatchJobs(req, timeout=10)
            try:
                return tuple(call.initial_metadata())
            finally:
                call.cancel()

    assert (WATCH_OPEN_METADATA_KEY, "1") in await asyncio.to_thread(blocking)
