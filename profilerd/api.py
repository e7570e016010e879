"""ProfilerService: thin gRPC servicer over the daemon's ``Profilerd`` core.

ReportStep refuses (INVALID_ARGUMENT, naming the field, nothing buffered) what the
estimator would refuse (``tessera.measurement.malformed``: a NaN/inf, negative or
implausibly large step time or phase, a NaN/inf time, a numeric label that does not parse) and a measurement over
``MAX_MEASUREMENT_BYTES`` as it would be buffered (stamped and numbered): buffered, either
would block the stream to the estimator. One the buffer cannot hold is RESOURCE_EXHAUSTED;
one whose seq number cannot be persisted (the seq state file cannot be written: disk
full, read-only directory) is UNAVAILABLE ("sequence state not persisted: ...; nothing
buffered"; retry later). Either way nothing is buffered, evicted or numbered: OK only for
a measurement that was buffered.

GetStats reports ``Profilerd.counters()``: ``dropped`` counts the buffer's drops (full,
refused by the estimator) and the samplers' measurements lost to the seq state."""

from __future__ import annotations

import grpc

from tessera.api.v1 import profiler_pb2, profiler_pb2_grpc
from tessera.measurement import malformed

from .buffer import MeasurementTooLarge
from .config import MAX_MEASUREMENT_BYTES  # serialized; a batch to the estimator is cut at 1 MiB (stream.MAX_BATCH_BYTES)
from .seqstate import SeqNotPersisted


class ProfilerService(profiler_pb2_grpc.ProfilerServiceServicer):
    def __init__(self, core) -> None:
        self.core = core

    async def ReportStep(self, request, context):
        if request.kind not in ("", "step"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kind: must be 'step' (or empty), got {request.kind!r}")
        m = profiler_pb2.Measurement()
        m.CopyFrom(request)
        m.kind = "step"
        bad = malformed(m)
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad)
        # the size as buffered and streamed: stamped (source, node, time) and numbered
        self.core.stamp(m)
        m.seq = self.core.buffer.next_seq
        size = m.ByteSize()
        if size > MAX_MEASUREMENT_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"measurement: at most {MAX_MEASUREMENT_BYTES} bytes serialized "
                                f"(with source, node, time and seq), got {size}")
        try:
            seq = self.core.add(m)
        except MeasurementTooLarge as e:  # never OK for what was not buffered
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{e} (the whole buffer); nothing buffered")
        except SeqNotPersisted as e:  # a disk problem of this node: retryable, nothing changed
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{e}; nothing buffered")
        return profiler_pb2.ReportStepResponse(seq=seq)

    async def GetStats(self, request, context):
        c = self.core.counters()
        return profiler_pb2.ProfilerStats(buffered=c.buffered, sent=c.sent, dropped=c.dropped, next_seq=c.next_seq,
                                          connected=self.core.connected, stream_errors=self.core.stream_errors)
