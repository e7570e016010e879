"""EstimatorService: thin gRPC servicer over ``MeasurementStore``, ``profiles`` and
``models.ModelKeeper`` (estimates are ``tessera.perfmodel`` evaluated on the current
snapshot: the same code and numbers the controller gets from GetModelSnapshot)."""

from __future__ import annotations

import asyncio
import json
import math

import grpc

from tessera import log
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc, profiler_pb2
from tessera.measurement import malformed
from tessera.modelkey import model_key
from tessera.perfmodel import FORMAT, MAX_MICRO_BATCHES, MAX_PIPELINE_SLOTS, MAX_PP, Candidate, Estimate
from tessera.perfmodel.workload import profiled, workload_of

from . import models
from . import store as store_mod
from .models import ModelKeeper
from .profiles import summarize
from .store import MeasurementStore, StoreFailed

MAX_BATCH = 100_000


def validate(m: profiler_pb2.Measurement, i: int) -> str | None:
    """The field at fault in the ``i``-th measurement of a batch, or None. Only what
    deduplication needs is checked: a kind this version does not know is stored (and
    not aggregated) rather than refused, so a newer profilerd cannot wedge its stream;
    and a known kind whose model inputs are not numbers (``tessera.measurement.malformed``, which
    profilerd's ReportStep applies too: a label that does not parse, a NaN/inf time or
    value) is refused, naming the field. (``ReportMeasurements`` also refuses a batch in
    which a source's seq goes back: ``measurements[i].seq``. A seq that repeats the one
    before it, and seqs at or below the source's persisted watermark at the head of a
    batch (a resend), are duplicates, not errors.)"""
    if not m.source:
        return f"measurements[{i}].source: required"
    if m.seq == 0:
        return f"measurements[{i}].seq: must be >= 1"
    bad = malformed(m)
    if bad:  # the seq lets the sender drop exactly this one (profilerd.stream) and go on
        return f"measurements[{i}].{bad} (seq {m.seq})"
    return None


def candidate(c: estimator_pb2.Candidate, where: str = "candidate") -> tuple[Candidate | None, str]:
    """(the perfmodel Candidate, "") or (None, "<where>.<field>: why") for a malformed one.
    Zero plan fields take their defaults (1, seq = seq_len, schedule "1f1b").

    Refused, for every candidate: device_type empty; layers, hidden, heads, vocab,
    seq_len, batch <= 0; seq, dp, tp, pp, micro_batches, colocated < 0; quota,
    oversubscription negative or not finite; hidden not divisible by heads; an unknown
    schedule; pp > ``MAX_PP``, micro_batches > ``MAX_MICRO_BATCHES`` or, for pp > 1,
    pp * micro_batches > ``MAX_PIPELINE_SLOTS`` (the pipeline replay's cost,
    ``tessera.perfmodel.pipeline``); seq > seq_len (the runtime's context).
    Refused for a ``gpt`` candidate only (a ``peft`` / ``multimodal`` module, a
    ``tessera.modelkey.shape_key``, takes no gpt plan: its dp, tp, pp are not read —
    ``tessera.perfmodel.workload.invalid``): batch not divisible by dp * micro_batches
    (``batch``), tp not dividing hidden and heads (``tp``), pp > layers (``pp``). What is
    left for ``insufficient_data`` is what data could answer."""
    if not c.device_type:
        return None, f"{where}.device_type: required"
    for f in ("layers", "hidden", "heads", "vocab", "seq_len", "batch"):
        if getattr(c, f) <= 0:
            return None, f"{where}.{f}: must be > 0, got {getattr(c, f)}"
    for f in ("seq", "dp", "tp", "pp", "micro_batches", "colocated"):
        if getattr(c, f) < 0:
            return None, f"{where}.{f}: must be >= 0, got {getattr(c, f)}"
    for f in ("quota", "oversubscription"):
        v = getattr(c, f)
        if v < 0 or not math.isfinite(v):
            return None, f"{where}.{f}: must be a finite number >= 0, got {v}"
    if c.hidden % c.heads:
        return None, f"{where}.hidden: must be divisible by heads ({c.heads}), got {c.hidden}"
    if c.schedule not in ("", "1f1b", "gpipe"):
        return None, f"{where}.schedule: must be '1f1b' or 'gpipe', got {c.schedule!r}"
    for f, most in (("pp", MAX_PP), ("micro_batches", MAX_MICRO_BATCHES)):
        if getattr(c, f) > most:
            return None, f"{where}.{f}: must be <= {most}, got {getattr(c, f)}"
    if c.pp > 1 and c.pp * max(c.micro_batches, 1) > MAX_PIPELINE_SLOTS:
        return None, (f"{where}.micro_batches: pp*micro_batches must be <= {MAX_PIPELINE_SLOTS} for a pipeline, "
                      f"got {c.pp}*{c.micro_batches}")
    if c.seq > c.seq_len:
        return None, f"{where}.seq: must be <= seq_len ({c.seq_len}), got {c.seq}"
    dp, tp, pp, mb = c.dp or 1, c.tp or 1, c.pp or 1, c.micro_batches or 1
    if not profiled(c.module):
        if c.batch % (dp * mb):
            return None, f"{where}.batch: must be divisible by dp*micro_batches ({dp}*{mb}), got {c.batch}"
        if c.hidden % tp or c.heads % tp:
            return None, f"{where}.tp: must divide hidden ({c.hidden}) and heads ({c.heads}), got {tp}"
        if pp > c.layers:
            return None, f"{where}.pp: must be <= layers ({c.layers}), got {pp}"
    return Candidate(device_type=c.device_type, layers=c.layers, hidden=c.hidden, heads=c.heads, vocab=c.vocab,
                     seq_len=c.seq_len, batch=c.batch, seq=c.seq, dp=dp, tp=tp, pp=pp,
                     micro_batches=mb, quota=c.quota or 1.0, link=c.link, module=c.module,
                     colocated=c.colocated or 1, oversubscription=c.oversubscription or 1.0,
                     schedule=c.schedule or "1f1b"), ""


def reply(e: Estimate, version: int) -> estimator_pb2.EstimateReply:
    """The wire form of an estimate (numbers 0 unless ok)."""
    if not e.ok:
        return estimator_pb2.EstimateReply(status=e.status, reason=e.reason, model_version=version)
    return estimator_pb2.EstimateReply(status=e.status, seconds=e.seconds, memory_bytes=e.memory_bytes,
                                       rel_std=e.rel_std, confidence=e.confidence, reason=e.reason,
                                       breakdown={k: float(v) for k, v in e.breakdown.items()}, model_version=version)


class EstimatorService(estimator_pb2_grpc.EstimatorServiceServicer):
    def __init__(self, store: MeasurementStore, keeper: ModelKeeper | None = None) -> None:
        self.store = store
        self.keeper = keeper if keeper is not None else ModelKeeper(store, store.dir)
        self.log = log.get(component="estimator.api")

    def _unindexable(self, batch: estimator_pb2.MeasurementBatch, e: store_mod.Unindexable) -> str:
        """The refusal of a batch the store could not index, naming the measurement like
        ``validate`` does ("measurements[i]: ... (seq N)"), so the sender can drop that
        one and go on (profilerd.stream). The store refused the first record of the batch
        that is new (above its source's watermark, not repeated in the batch) and that
        ``store.slots`` cannot index; it is located the same way. No single field is at
        fault, so the whole measurement is named."""
        seen: dict[str, int] = {}
        for i, m in enumerate(batch.measurements):
            if m.seq <= seen.get(m.source, self.store.watermark(m.source)):
                continue  # a duplicate: the store did not index it
            seen[m.source] = m.seq
            try:
                store_mod.slots(m)
            except Exception:
                return f"measurements[{i}]: {e}"
        return str(e)  # not found again (cannot happen with a pure slots): unlocated, as before

    async def ReportMeasurements(self, request_iterator, context):
        accepted = dups = 0
        sources: set[str] = set()
        async for batch in request_iterator:
            last: dict[str, int] = {}  # per source, the seq before in this batch
            for i, m in enumerate(batch.measurements):
                err = validate(m, i)
                if not err and m.seq < last.get(m.source, 0):
                    # a profilerd numbers in order: a seq that goes back would be silently
                    # taken for a duplicate (an exact repeat of the seq before is one)
                    err = (f"measurements[{i}].seq: must increase per source within a batch "
                           f"({m.source!r}: {m.seq} after {last[m.source]}); nothing of this batch was persisted "
                           f"(seq {m.seq})")
                last[m.source] = m.seq
                if err:
                    # earlier batches of this stream stay persisted; the client learns
                    # how far it got from GetWatermark
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
            try:
                a, d = await self.store.append(batch.measurements)
            except store_mod.Unindexable as e:  # a record the store cannot index: nothing of this batch persisted
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._unindexable(batch, e))
            except OSError as e:  # nothing of this batch acknowledged; the client resends later
                self.log.error("measurements not persisted", error=str(e), failed=isinstance(e, StoreFailed))
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"measurements not persisted ({e}); retry later (earlier batches are kept)")
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

    async def Estimate(self, request, context):
        c, err = candidate(request.candidate)
        if err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
        model = await self.keeper.current()
        # Off the event loop (a pipeline replay can take seconds). Safe: a published
        # PerfModel is never mutated (ModelKeeper replaces it whole on a refit).
        e = await asyncio.to_thread(model.estimate, c)
        return reply(e, model.version)

    async def EstimateBatch(self, request, context):
        if len(request.candidates) > MAX_BATCH:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"candidates: at most {MAX_BATCH} per call, got {len(request.candidates)}")
        cands = []
        for i, pc in enumerate(request.candidates):
            c, err = candidate(pc, f"candidates[{i}]")
            if err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, err)
            cands.append(c)
        model = await self.keeper.current()
        ests = await asyncio.to_thread(model.estimate_batch, cands)  # off the loop, as in Estimate
        return estimator_pb2.EstimateBatchReply(estimates=[reply(e, model.version) for e in ests],
                                                model_version=model.version)

    async def GetModelSnapshot(self, request, context):
        """The current snapshot; ``unchanged`` (no JSON) only when the caller holds exactly
        this version. A caller *ahead* of it (a model of another lineage: this estimator's
        state was lost or replaced) gets the full snapshot and must replace its cache."""
        model = await self.keeper.current()
        k = self.keeper
        if model.version == request.if_newer_than:
            return estimator_pb2.ModelSnapshot(version=model.version, unchanged=True, format=FORMAT,
                                               fitted_at=k.fitted_at, measurements=k.measurements)
        return estimator_pb2.ModelSnapshot(version=model.version, format=FORMAT, json=json.dumps(model.to_dict(), allow_nan=False),
                                           fitted_at=k.fitted_at, measurements=k.measurements)

    async def ListProfiles(self, request, context):
        model = await self.keeper.current()
        out = [estimator_pb2.ProfileEntry(
            module=p.module, model_key=model_key({"type": workload_of(p.module), "batch_size": p.rows, "model": {
                "layers": p.layers, "hidden": p.hidden, "seq_len": p.seq_len, "vocab": p.vocab}}), device_type=p.device_type, job_id=p.job_id, rows=p.rows, seq=p.seq_len,
            micro_batches=p.micro_batches, quota=p.quota, steps=p.steps, median_step_time_s=p.median_s, spread=p.spread)
            for p in models.profiles(self.store.runs, self.store.run_fb)
            if (not request.module or p.module == request.module)
            and (not request.device_type or p.device_type == request.device_type)]
        return estimator_pb2.ListProfilesResponse(profiles=out, model_version=model.version)
