"""WatchJobs' check of a task id before the stream (controller.api): any error of it
becomes the status ``_code`` maps it to, as in every unary rpc, never UNKNOWN."""

from __future__ import annotations

import asyncio

import aetcd
import grpc
import pytest

from controller.api import JobService
from controller.core import NotFound, NotLeader
from controller.store import Conflict
from tessera.api.v1 import controller_pb2


class Aborted(Exception):
    pass


class Context:
    def __init__(self):
        self.aborted: tuple | None = None
        self.metadata = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise Aborted

    async def send_initial_metadata(self, md):
        self.metadata = md


class Ctl:
    def __init__(self, error):
        self.error = error

    async def get(self, job_id):
        raise self.error


@pytest.mark.parametrize("error, code", [
    (NotLeader("not the leader"), grpc.StatusCode.UNAVAILABLE),
    (Conflict("raced"), grpc.StatusCode.UNAVAILABLE),
    (aetcd.ClientError("etcd down"), grpc.StatusCode.UNAVAILABLE),
    (NotFound("job j-000000000000/t9 not found"), grpc.StatusCode.NOT_FOUND),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_a_task_ids_pre_check_error_maps_to_its_code(error, code):
    ctx = Context()
    req = controller_pb2.WatchJobsRequest(job_id="j-000000000000/t9")

    async def go():
        async for _ in JobService(Ctl(error)).WatchJobs(req, ctx):
            pass

    with pytest.raises(Aborted):
        asyncio.run(go())
    assert ctx.aborted is not None and ctx.aborted[0] == code, ctx.aborted
    assert ctx.metadata is None  # refused before the watch opened
