"""EstimatorService: thin gRPC servicer over ``MeasurementStore`` and ``profiles``."""

from __future__ import annotations

import grpc

from tessera import log
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc, profiler_pb2

from .profiles import summarize
from .store import MeasurementStore


def validate(m: profiler_pb2.Measurement, i: int) -> str | None:
    """The field at fault in the ``i``-th measurement of a batch, or None. Only what
    deduplication needs is checked: a kind this version does not know is stored (and
    not aggregated) rather than refused, so a newer profilerd cannot wedge its stream."""
    if not m.source:
        return f"measurements[{i}].source: required"
    if m.seq == 0:
        return f"measurements[{i}].seq: must be >= 1"
    return None


class EstimatorService(estimator_pb2_grpc.EstimatorServiceServicer):
    def __init__(self, store: MeasurementStore) -> None:
        self.store = store
        self.log = log.get(component="estimator.api")

    async def ReportMeasurements(self, request_iterator, context):
        accepted = dups = 0
        sources: set[str] = set()
        async for batch in request_iterator:
            for i, m in enumerate(batch.measurements):
                err = validate(m, i)
                if err:
                    # earlier batches of this stream stay persisted; the client learns
                    # how far it got from GetWatermark
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
            a, d = await self.store.append(batch.measurements)
            accepted += a
            dups += d
            sources.update(m.source for m in batch.measurements)
        if dups:
            self.log.info("duplicates dropped", duplicates=dups, accepted=accepted, sources=sorted(sources))
        return estimator_pb2.ReportAck(accepted=accepted, duplicates=dups,
                                       watermark={s: self.store.watermark(s) for s in sources})

    async def GetWatermark(self, request, context):
        if not request.source:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "source: required")
        return estimator_pb2.Watermark(source=request.source, seq=self.store.watermark(request.source))

    async def GetProfile(self, request, context):
        if not request.job_id and not request.model_key:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id: one of job_id, model_key is required")
        s = summarize(self.store.steps(request.job_id, request.model_key))
        if s is None:
            what = " and ".join(f"{k} {v!r}" for k, v in (("job_id", request.job_id), ("model_key", request.model_key)) if v)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no step measurements for {what}")
        return estimator_pb2.Profile(
            job_id=request.job_id, model_key=request.model_key, samples=s.samples,
            mean_step_time_s=s.mean_step_time_s, p50_step_time_s=s.p50_step_time_s, p90_step_time_s=s.p90_step_time_s,
            mean_phases=s.mean_phases, last_time=s.last_time)
