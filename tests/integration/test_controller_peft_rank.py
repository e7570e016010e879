"""A peft job whose LoRA rank exceeds its model's hidden size is refused at submission over
gRPC: INVALID_ARGUMENT naming ``workload.peft.tasks[i].rank``, and nothing is stored (it used
to be accepted and refused only by the executor, after being queued and placed)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tessera import manifest
from tessera.api.v1 import controller_pb2 as cpb
from tessera.api.v1 import controller_pb2_grpc as cgrpc

DOC = {"apiVersion": "tessera/v1", "name": "p1", "tenant": "alice",
       "workload": {"type": "peft", "steps": 2, "model": {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 8},
                    "peft": {"tasks": [{"name": "a", "rank": 4}, {"name": "b", "rank": 16}]}},
       "resources": {"devices": 1, "device_kind": "cpu"}}


async def _leader(jobs) -> None:
    """Until the controller answers as leader (UNAVAILABLE before), polled with a deadline."""
    for _ in range(400):
        try:
            await jobs.ListJobs(cpb.ListJobsRequest())
            return
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("controller never became leader")


async def test_rank_above_hidden_is_invalid_argument_at_submit(controller):
    async with grpc.aio.insecure_channel(controller.listen) as ch:
        jobs = cgrpc.JobServiceStub(ch)
        await _leader(jobs)
        spec = manifest.to_proto(manifest.validate(DOC))  # rank 16 == hidden: valid
        # The proto a client that skips local validation would send: task b's rank 17 > hidden 16.
        spec.workload.peft["tasks"][1]["rank"] = 17
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec, idempotency_key="k1"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "workload.peft.tasks[1].rank" in e.value.details()
        assert not (await jobs.ListJobs(cpb.ListJobsRequest())).jobs
        spec.workload.peft["tasks"][1]["rank"] = 16
        r = await jobs.SubmitJob(cpb.SubmitJobRequest(spec=spec, idempotency_key="k1"))
        assert r.created
