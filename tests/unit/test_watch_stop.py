"""A stopping controller ends its open WatchJobs streams at once (controller.api.until_set
and JobService.stopping): UNAVAILABLE, which clients answer by watching again; before,
the stop waited out the gRPC server's grace for streams that never end by themselves."""

from __future__ import annotations

import asyncio

import grpc
import pytest

import controller.api as api
from tessera.api.v1 import controller_pb2, types_pb2


async def _collect(agen):
    return [x async for x in agen]


def test_until_set_passes_every_item_through_when_the_event_is_never_set():
    async def source():
        for i in range(5):
            await asyncio.sleep(0)
            yield i

    async def go():
        return await _collect(api.until_set(asyncio.Event(), source()))

    assert asyncio.run(go()) == [0, 1, 2, 3, 4]


def test_until_set_stops_while_waiting_for_the_next_item_and_closes_the_source():
    closed = []

    async def source(gate: asyncio.Event):
        try:
            yield "first"
            await gate.wait()  # a quiet watch: no next event
            yield "never"
        finally:
            closed.append(True)

    async def go():
        ev, gate = asyncio.Event(), asyncio.Event()
        got = []

        async def consume():
            async for x in api.until_set(ev, source(gate)):
                got.append(x)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0)
        ev.set()
        await asyncio.wait_for(task, 5)  # ends without the gate ever opening
        return got

    assert asyncio.run(go()) == ["first"]
    assert closed == [True]


class Aborted(Exception):
    pass


class Context:
    def __init__(self):
        self.aborted = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise Aborted

    async def send_initial_metadata(self, md):
        pass


def test_a_watch_open_when_the_controller_stops_ends_unavailable(monkeypatch):
    async def quiet_watch(ctl, request):
        yield controller_pb2.JobEvent(type=controller_pb2.JobEvent.SNAPSHOT, job=types_pb2.Job(id="j-1"))
        await asyncio.Event().wait()  # nothing else ever changes
        yield controller_pb2.JobEvent()

    monkeypatch.setattr(api, "watch_jobs", quiet_watch)

    async def go():
        stopping = asyncio.Event()
        svc, ctx, got = api.JobService(ctl=None, stopping=stopping), Context(), []

        async def consume():
            async for ev in svc.WatchJobs(controller_pb2.WatchJobsRequest(), ctx):
                got.append(ev.job.id)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0)
        stopping.set()
        with pytest.raises(Aborted):
            await asyncio.wait_for(task, 5)
        return got, ctx.aborted

    got, aborted = asyncio.run(go())
    assert got == ["j-1"]
    assert aborted[0] == grpc.StatusCode.UNAVAILABLE and "controller stopping" in aborted[1]
