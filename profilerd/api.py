"""ProfilerService: thin gRPC servicer over the daemon's ``Profilerd`` core."""

from __future__ import annotations

import grpc

from tessera.api.v1 import profiler_pb2, profiler_pb2_grpc


class ProfilerService(profiler_pb2_grpc.ProfilerServiceServicer):
    def __init__(self, core) -> None:
        self.core = core

    async def ReportStep(self, request, context):
        if request.kind not in ("", "step"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kind: must be 'step' (or empty), got {request.kind!r}")
        if request.step_time_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"step_time_s: must be >= 0, got {request.step_time_s}")
        m = profiler_pb2.Measurement()
        m.CopyFrom(request)
        m.kind = "step"
        return profiler_pb2.ReportStepResponse(seq=self.core.add(m))

    async def GetStats(self, request, context):
        c = self.core.buffer.counters()
        return profiler_pb2.ProfilerStats(buffered=c.buffered, sent=c.sent, dropped=c.dropped, next_seq=c.next_seq,
                                          connected=self.core.connected, stream_errors=self.core.stream_errors)
