"""Retention of finished jobs against a real etcd and a real controller: a finished job
older than ``finished_job_ttl_s`` is removed by the leader's reconcile round with every key
keyed by it (its idempotency key, its allocation's rank exits and partition units); younger
finished jobs, active jobs and a guest whose host is active are kept; ttl 0 keeps
everything; a job changed since the round read it is not removed; a deposed leader removes
nothing; and through the daemon, GetJob of a removed job is NOT_FOUND saying how long
finished jobs are kept, and a tenant's watch sees the deletion of its own jobs only.
Rounds are driven directly (injected clock) or polled with a deadline: nothing sleeps to
synchronise."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace

import aetcd
import grpc
import pytest

from _live import etcd_client, leading_controller, stand_in_profiling, take_leadership
from controller.config import ControllerConfig
from controller.core import Controller, NotFound, NotLeader
from controller.policy import FirstFit
from controller.store import Fenced, Store
from tessera import manifest
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import controller_pb2_grpc as cgrpc
from tessera.api.v1 import types_pb2 as tpb
from tessera.etcdproc import free_port

P = tpb.JobPhase
TTL = 100.0
T0 = 1000.0
DOC = {"apiVersion": "tessera/v1", "name": "r1", "tenant": "t",
       "workload": {"type": "gpt", "steps": 5, "model": {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8}},
       # No gpu anywhere: pending jobs stay pending (infeasible), nothing is launched.
       "resources": {"devices": 1, "device_kind": "gpu"}}


def node(name: str) -> tpb.Node:
    n = tpb.Node(name=name, state=tpb.READY, incarnation="inc1", agent_address="127.0.0.1:1")
    n.devices.add(id="cpu0", kind="cpu", model="x", capacity=4)
    n.partitions.add(id="cpu0", kind="cpuset", device_id="cpu0", capacity_units=4, unit="cores")
    return n


def job(jid: str, phase: int, at: float, *, alloc: str = "", fused_into: str = "", tenant: str = "t",
        idem: str = "") -> tpb.Job:
    """A job placed on n1 at ``T0`` (when it has an allocation) that entered ``phase`` at ``at``."""
    j = tpb.Job(id=jid, created=T0 - 10, idempotency_key=idem)
    j.spec.tenant, j.spec.name = tenant, jid
    j.spec.workload.type, j.spec.workload.steps = "gpt", 100
    # A pending one waits (no gpu anywhere); the others' placement is recorded as cpu.
    j.spec.resources.devices, j.spec.resources.device_kind = 1, "gpu" if phase == P.PENDING else "cpu"
    j.status.history.add(phase=P.PENDING, time=T0 - 10, reason="submitted")
    if alloc:
        j.status.allocation_id = alloc
        j.status.placement.add(node="n1", device_ids=["cpu0"], partition_ids=["cpu0"], first_rank=0)
        j.status.history.add(phase=P.SCHEDULED, time=T0, reason="placed")
    if phase != P.PENDING and phase != P.SCHEDULED:
        j.status.history.add(phase=phase, time=at, reason="now")
    j.status.phase = phase
    j.status.fused_into = fused_into
    return j


@pytest.fixture
async def ctl(etcd_server, request):
    now = [T0]
    ctl, store, c = await leading_controller(etcd_server, f"/ret-{request.node.name[:40]}",
                                             ControllerConfig(grace_s=3.0, finished_job_ttl_s=TTL), FirstFit(),
                                             clock=lambda: now[0])
    await store.put_node(node("n1"), None)
    yield ctl, store, c, now
    await c.close()


async def _round(ctl: Controller, now: list[float], at: float) -> dict:
    now[0] = at
    ctl.heartbeats["n1"] = at  # n1 stays READY: only retention is under test
    return await ctl.reconcile_once()


async def _keys(c: aetcd.Client, store: Store, sub: str) -> list[str]:
    base = len(store.k(sub)) + 1
    return sorted(kv.key.decode()[base:] for kv in await c.get_prefix(store.k(sub) + b"/"))


async def test_an_expired_finished_job_is_removed_with_its_keys_and_the_others_are_kept(ctl):
    ctl, store, c, now = ctl
    # The finished job to remove: submitted for real (idempotency key), then SUCCEEDED at T0.
    spec = manifest.to_proto(manifest.validate(DOC))
    old, created = await ctl.submit(spec, "key-1")
    assert created and (await store.get_idem("t", "key-1")) == old.id
    v = await store.get_job(old.id)
    done = v.value
    done.status.allocation_id = "a-old"
    done.status.placement.add(node="n1", device_ids=["cpu0"], partition_ids=["cpu0"], first_rank=0)
    done.status.history.add(phase=P.SUCCEEDED, time=T0, reason="all ranks exited 0")
    done.status.phase = P.SUCCEEDED
    await store.update_job(done, v.mod_revision)
    # Keys a bug or an older version could have left behind for its allocation: a rank exit
    # and units still held (next to a running job's units on the same partition).
    await c.put(store.exit_key("a-old", 0), b"0")
    await c.put(store.alloc_key("n1", "cpu0"), json.dumps({"a-old": 1, "a-run": 1}).encode())
    kept = [
        job("j-00000000000a", P.FAILED, T0 + 50),                      # finished, but younger than the TTL
        job("j-00000000000b", P.PENDING, 0),                            # active, however old
        job("j-00000000000c", P.RUNNING, T0, alloc="a-run"),            # active, running (a peft host)
        job("j-00000000000d", P.SUCCEEDED, T0, alloc="a-run", fused_into="j-00000000000c"),  # guest of an active host
    ]
    for j in kept:
        await store.create_job(j, "")
    await c.put(store.exit_key("a-run", 0), b"0")

    # Not yet expired: nothing removed.
    assert (await _round(ctl, now, T0 + TTL))["removed"] == 0
    assert await store.get_job(old.id) is not None

    out = await _round(ctl, now, T0 + TTL + 1)
    assert out["removed"] == 1
    assert await store.get_job(old.id) is None
    for j in kept:
        assert await store.get_job(j.id) is not None, j.id
    assert await _keys(c, store, "idem") == []
    assert await _keys(c, store, "exits") == ["a-run/0"]  # the host's (and its guest's) allocation untouched
    assert await store.list_holders() == {("n1", "cpu0"): {"a-run": 1}}

    # The removed job: NOT_FOUND saying how long finished jobs are kept; its key is free again.
    with pytest.raises(NotFound, match="finished_job_ttl_s=100s"):
        await ctl.get(old.id)
    with pytest.raises(NotFound, match="finished_job_ttl_s"):
        await ctl.get(f"{old.id}/t0")
    again, created = await ctl.submit(spec, "key-1")
    assert created and again.id != old.id and (await store.get_idem("t", "key-1")) == again.id

    # Later, the young one expires too; active ones never do.
    out = await _round(ctl, now, T0 + 50 + TTL + 1)
    assert out["removed"] == 1 and await store.get_job("j-00000000000a") is None
    assert await store.get_job("j-00000000000b") is not None and await store.get_job("j-00000000000d") is not None


async def test_ttl_zero_keeps_every_finished_job(ctl):
    ctl, store, c, now = ctl
    ctl.cfg = replace(ctl.cfg, finished_job_ttl_s=0)
    for i, ph in enumerate((P.SUCCEEDED, P.FAILED, P.CANCELLED)):
        await store.create_job(job(f"j-00000000010{i}", ph, 1.0), "")
    out = await _round(ctl, now, T0 + 10 ** 9)
    assert out["removed"] == 0 and len((await store.list_jobs())[0]) == 3
    with pytest.raises(NotFound, match="kept forever"):
        await ctl.get("j-0000000001ff")


async def test_a_job_changed_since_the_round_read_it_is_not_removed(ctl):
    ctl, store, c, now = ctl
    await store.create_job(job("j-000000000201", P.CANCELLED, T0), "")
    await store.create_job(job("j-000000000202", P.CANCELLED, T0), "")
    jobs, _ = await store.list_jobs()  # what the round read
    # Meanwhile another writer updates one of them.
    v = await store.get_job("j-000000000201")
    v.value.status.reason = "annotated meanwhile"
    await store.update_job(v.value, v.mod_revision)
    assert await ctl.remove_finished(jobs, T0 + TTL + 1) == 1
    assert (await store.get_job("j-000000000201")).value.status.reason == "annotated meanwhile"
    assert await store.get_job("j-000000000202") is None
    # A later round reads it afresh and removes it.
    assert (await _round(ctl, now, T0 + TTL + 2))["removed"] == 1
    assert await store.list_jobs() == ([], (await store.list_jobs())[1])


async def test_a_deposed_leader_removes_nothing(ctl):
    ctl, store, c, now = ctl
    await store.create_job(job("j-000000000301", P.SUCCEEDED, T0, idem="k3"), "k3")
    # Another controller took over: the leader key was recreated (a new fencing token).
    await c.delete(store.leader_key())
    await c.put(store.leader_key(), b"other")
    with pytest.raises((Fenced, NotLeader)):
        await _round(ctl, now, T0 + TTL + 1)
    assert await store.get_job("j-000000000301") is not None and await store.get_idem("t", "k3") == "j-000000000301"
    # Deposed by its own leadership loop (the flag): refused before any transaction.
    await c.delete(store.leader_key())
    await take_leadership(c, store)
    store.deposed = True
    with pytest.raises(Fenced):
        await ctl.remove_finished((await store.list_jobs())[0], T0 + TTL + 1)
    assert await store.get_job("j-000000000301") is not None
    store.deposed = False
    assert await ctl.remove_finished((await store.list_jobs())[0], T0 + TTL + 1) == 1
    assert await store.get_idem("t", "k3") is None


async def test_kept_jobs_do_not_starve_the_removal_of_others(ctl, monkeypatch):
    """The longest-finished jobs all kept (finished guests of a running host, more than a
    round's limit): the other expired jobs are still removed, a limit's worth per round.
    The candidates used to be cut to the limit before the kept ones were dropped: every
    round then removed nothing."""
    from controller import core

    ctl, store, c, now = ctl
    monkeypatch.setattr(core, "MAX_REMOVALS_PER_ROUND", 4)
    await store.create_job(job("j-000000000501", P.RUNNING, T0, alloc="a-h"), "")
    for i in range(6):
        await store.create_job(job(f"j-0000000005{i + 10:02d}", P.SUCCEEDED, T0, alloc="a-h",
                                   fused_into="j-000000000501"), "")
    others = [f"j-0000000006{i:02d}" for i in range(6)]
    for i, jid in enumerate(others):
        await store.create_job(job(jid, P.SUCCEEDED, T0 + 1 + i), "")
    assert (await _round(ctl, now, T0 + 10 * TTL))["removed"] == 4
    assert [jid for jid in others if await store.get_job(jid) is not None] == others[4:]
    assert (await _round(ctl, now, T0 + 10 * TTL + 1))["removed"] == 2
    left = sorted(j.id for j in (await store.list_jobs())[0])
    assert left == ["j-000000000501"] + [f"j-0000000005{i + 10:02d}" for i in range(6)]


async def _profiled_pair(store: Store, prof_at: float, user_at: float, user_phase: int = P.CANCELLED):
    """A FAILED profiling job (stored under its idempotency key) and a gpt job of ``DOC``
    whose estimate names it."""
    from controller.profiling import profile_doc

    doc = manifest.validate({**DOC, "resources": {"devices": 1, "device_kind": "cpu"}})
    pdoc, idem = profile_doc(doc, 8)
    pj = tpb.Job(id="j-000000000701", spec=manifest.to_proto(manifest.validate(pdoc)), created=T0 - 20,
                 idempotency_key=idem)
    pj.status.history.add(phase=P.FAILED, time=prof_at)
    pj.status.phase = P.FAILED
    await store.create_job(pj, idem)
    u = tpb.Job(id="j-000000000702", spec=manifest.to_proto(doc), created=T0 - 20)
    u.status.history.add(phase=user_phase, time=user_at)
    u.status.phase = user_phase
    u.status.estimate.CopyFrom(tpb.JobEstimate(status="insufficient_data", profile_job_id=pj.id, time=prof_at,
                                               reason=f"profiling job {pj.id} ended FAILED"))
    await store.create_job(u, "")
    return pj, u


async def test_a_profiling_job_is_removed_after_the_job_naming_it_and_a_cycle_between_requests_nothing(ctl):
    """Retention removes the job whose estimate names a profiling job before that profiling
    job (even though the profiling job finished earlier), and a profiling cycle run between
    any two removals submits no new profiling job. It used to remove the profiling job
    first, and the cycle in between then profiled the long-finished job again."""
    from controller.profiling import is_profile_job

    ctl, store, c, now = ctl
    pj, u = await _profiled_pair(store, T0, T0 + 1)
    prof = await stand_in_profiling(ctl, lambda: now[0])  # knows no profile (its job failed)
    assert await prof.once() == {"requested": 0, "estimated": 0}
    order, cycles = [], []
    real = store.delete_job

    async def delete_job(j, *a, **kw):
        rev = await real(j, *a, **kw)
        order.append(j.id)
        cycles.append(await prof.once())  # the profiling loop runs between two removals
        return rev

    store.delete_job = delete_job
    assert (await _round(ctl, now, T0 + 10 * TTL))["removed"] == 2
    assert order == [u.id, pj.id]
    assert all(x["requested"] == 0 for x in cycles), cycles
    assert not [j for j in (await store.list_jobs())[0] if is_profile_job(j)]


async def test_a_finished_job_whose_profiling_job_is_gone_is_never_profiled_again(ctl):
    """The profiling loop never submits a profiling job on behalf of a finished job: one
    whose named profiling job was removed keeps (or marks) its estimate."""
    ctl, store, c, now = ctl
    pj, u = await _profiled_pair(store, T0, T0 + 1)
    v = await store.get_job(u.id)
    v.value.status.estimate.status = "profiling"
    v.value.status.estimate.reason = "no profile yet"
    await store.update_job(v.value, v.mod_revision)
    await store.delete_job(pj, (await store.get_job(pj.id)).mod_revision)  # removed (by hand, or an older version)
    prof = await stand_in_profiling(ctl, lambda: now[0])  # knows no profile (its job failed)
    assert await prof.once() == {"requested": 0, "estimated": 1}
    jobs = (await store.list_jobs())[0]
    assert [j.id for j in jobs] == [u.id]
    est = jobs[0].status.estimate
    assert est.status == "insufficient_data" and est.profile_job_id == pj.id and "removed" in est.reason
    assert await prof.once() == {"requested": 0, "estimated": 0}  # said once


async def test_a_job_left_stored_keeps_the_jobs_it_names_that_round(ctl):
    """The job naming a profiling job changed since the round read it (its removal
    deferred): the profiling job it names stays too, until a later round removes both."""
    ctl, store, c, now = ctl
    pj, u = await _profiled_pair(store, T0, T0 + 1)
    jobs, _ = await store.list_jobs()
    v = await store.get_job(u.id)
    v.value.status.reason = "annotated meanwhile"
    await store.update_job(v.value, v.mod_revision)
    assert await ctl.remove_finished(jobs, T0 + 10 * TTL) == 0
    assert await store.get_job(pj.id) is not None and await store.get_job(u.id) is not None
    assert (await _round(ctl, now, T0 + 10 * TTL))["removed"] == 2
    assert (await store.list_jobs())[0] == []


async def test_the_daemon_removes_an_expired_job_get_is_not_found_and_watch_filters_deletions(etcd_server):
    from controller import main as cmain

    cfg = ControllerConfig(listen=f"127.0.0.1:{free_port()}", etcd=etcd_server, prefix=f"/ret-d{os.getpid()}",
                           grace_s=3.0, heartbeat_interval_s=0.3, reconcile_interval_s=0.2,
                           finished_job_ttl_s=3600)
    c = await etcd_client(etcd_server)
    writer = Store(c, cfg.prefix)  # no fencing token: a plain writer seeding records
    now = time.time()
    await writer.create_job(job("j-000000000401", P.SUCCEEDED, now - 7300, tenant="bob"), "")
    await writer.create_job(job("j-000000000402", P.FAILED, now - 7200, tenant="alice"), "")
    await writer.create_job(job("j-000000000403", P.SUCCEEDED, now - 60, tenant="alice"), "")
    seeded = (await writer.list_jobs())[1]
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(cmain.serve(cfg, ready=ready, stop=stop))
    ch = grpc.aio.insecure_channel(cfg.listen)
    try:
        await asyncio.wait_for(ready.wait(), 20)
        stub = cgrpc.JobServiceStub(ch)
        watch = stub.WatchJobs(cpb.WatchJobsRequest(tenant="alice", start_revision=seeded))
        deleted = []

        async def first_deletion():
            async for ev in watch:
                if ev.type == cpb.JobEvent.DELETED:
                    deleted.append(ev.job.id)
                    return

        await asyncio.wait_for(first_deletion(), 30)
        # bob's job was removed first (it ended earlier), yet alice's watch saw only hers.
        assert deleted == ["j-000000000402"]
        watch.cancel()
        deadline = time.monotonic() + 20
        while await writer.get_job("j-000000000401") is not None:
            assert time.monotonic() < deadline, "bob's expired job was never removed"
            await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.GetJob(cpb.GetJobRequest(job_id="j-000000000402"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "finished jobs are kept for finished_job_ttl_s=3600s (1h)" in e.value.details()
        assert (await stub.GetJob(cpb.GetJobRequest(job_id="j-000000000403"))).status.phase == P.SUCCEEDED
    finally:
        await ch.close()
        stop.set()
        await asyncio.wait_for(task, 30)
        await c.close()


async def test_a_dangling_idempotency_key_is_freed_by_the_next_submission(ctl):
    """A key that names a job no longer stored (removed by an older version without its
    key, or by hand) no longer blocks its tenant: the submission creates a job."""
    ctl, store, c, now = ctl
    await c.put(store.idem_key("t", "key-9"), b"j-0000000009ff")
    job_, created = await ctl.submit(manifest.to_proto(manifest.validate(DOC)), "key-9")
    assert created and job_.id != "j-0000000009ff" and await store.get_idem("t", "key-9") == job_.id
