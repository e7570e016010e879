"""Leader election and fencing against a real etcd: a deposed controller cannot write."""

from __future__ import annotations

import asyncio

import pytest

from _live import etcd_client
from controller.leader import Leadership
from controller.store import Fenced, Store
from tessera.api.v1 import types_pb2


async def test_deposed_leader_write_is_fenced(etcd_server):
    c = await etcd_client(etcd_server)
    store = Store(c, "/fence")
    events: list[str] = []
    elected = asyncio.Event()

    async def on_elected():
        events.append("elected")
        elected.set()

    async def on_lost():
        events.append("lost")

    lead = Leadership(c, store, "a", ttl=2)
    task = asyncio.create_task(lead.campaign(on_elected, on_lost))
    await asyncio.wait_for(elected.wait(), 10)
    token = store.fencing_token
    assert token and await store.is_leader()
    await store.create_job(types_pb2.Job(id="j-1"), "")  # the leader writes

    # Another controller takes the key (as after our lease expired): our token is stale.
    stale = Store(c, "/fence")
    stale.fencing_token = token
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await c.put(store.leader_key(), b"b")
    with pytest.raises(Fenced):
        await stale.create_job(types_pb2.Job(id="j-2"), "")
    # The deposed controller's OWN store (whose token was cleared when it resigned): a
    # write of a round or RPC that passed its leader check before the loss is fenced too.
    assert store.fencing_token is None and store.deposed
    with pytest.raises(Fenced):
        await store.create_job(types_pb2.Job(id="j-3"), "")
    assert await c.get(store.job_key("j-2")) is None and await c.get(store.job_key("j-3")) is None
    assert await c.get(store.job_key("j-1")) is not None
    await c.close()


async def test_leadership_lost_to_an_expired_lease_fences_in_flight_writes(etcd_server):
    """Leadership lost without resigning (the lease revoked under us, another controller
    elected): the keepalive notices, and the deposed store refuses every write until it is
    elected again — then it writes again."""
    c = await etcd_client(etcd_server)
    store = Store(c, "/fence2")
    elected, lost = asyncio.Event(), asyncio.Event()

    async def on_elected():
        elected.set()

    async def on_lost():
        lost.set()

    lead = Leadership(c, store, "a", ttl=2)
    task = asyncio.create_task(lead.campaign(on_elected, on_lost))
    await asyncio.wait_for(elected.wait(), 10)
    await c.revoke_lease(lead.lease.id)  # as if the lease expired on the server
    await asyncio.wait_for(lost.wait(), 10)
    assert store.deposed
    with pytest.raises(Fenced):
        await store.create_job(types_pb2.Job(id="j-late"), "")
    assert await c.get(store.job_key("j-late")) is None
    elected.clear()
    await asyncio.wait_for(elected.wait(), 15)  # the key is vacant: re-elected
    assert not store.deposed
    await store.create_job(types_pb2.Job(id="j-new"), "")
    assert await c.get(store.job_key("j-new")) is not None
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await c.close()


async def test_one_leader_among_two_and_takeover_on_resign(etcd_server):
    c1, c2 = await etcd_client(etcd_server), await etcd_client(etcd_server)
    s1, s2 = Store(c1, "/el"), Store(c2, "/el")
    got = {"a": asyncio.Event(), "b": asyncio.Event()}

    def cb(name):
        async def on():
            got[name].set()
        return on

    async def noop():
        pass

    la, lb = Leadership(c1, s1, "a", ttl=2), Leadership(c2, s2, "b", ttl=2)
    ta = asyncio.create_task(la.campaign(cb("a"), noop))
    await asyncio.wait_for(got["a"].wait(), 10)
    token_a = s1.fencing_token
    tb = asyncio.create_task(lb.campaign(cb("b"), noop))
    await asyncio.sleep(0)  # let b campaign once; it must not win while a leads
    assert not got["b"].is_set() and s2.fencing_token is None
    ta.cancel()  # a resigns (revokes its lease): b takes over without waiting a TTL
    await asyncio.gather(ta, return_exceptions=True)
    await asyncio.wait_for(got["b"].wait(), 10)
    assert s1.fencing_token is None and s2.fencing_token > token_a
    assert await s2.is_leader()
    tb.cancel()
    await asyncio.gather(tb, return_exceptions=True)
    await c1.close()
    await c2.close()


async def test_controller_health_follows_its_leadership(controller, etcd_server):
    """The controller's gRPC health says SERVING while it leads and NOT_SERVING once it
    lost the leadership (a standby must not get work from a health-checking balancer),
    SERVING again when re-elected."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    cfg = controller
    name = "tessera.api.v1.JobService"
    c = await etcd_client(etcd_server)
    async with grpc.aio.insecure_channel(cfg.listen) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        async def status():
            try:
                return (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
            except grpc.aio.AioRpcError as e:  # not elected yet: the service has no status
                if e.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                return None

        async def until(want):
            for _ in range(400):
                if await status() == want:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"health never became {want}")

        await until(S)
        leader = await c.get(f"{cfg.prefix}/leader".encode())
        await c.revoke_lease(leader.lease)  # the lease is gone: leadership lost
        await until(N)
        await until(S)  # nobody else campaigns: re-elected
    await c.close()
