"""The stream to the estimator: one ReportMeasurements client-stream call per flush
(the pending measurements cut in batches), the buffer trimmed to the acknowledged
watermark; on (re)connect GetWatermark first, so only what the estimator has not
persisted is resent; reconnect with exponential backoff.

Renumbering: the estimator's watermark is the highest seq it persisted for this source.
One at or above ``next_seq`` means it holds seqs this daemon never issued (its seq state
was lost), so the buffer is renumbered past it. Before this process has sent anything,
a watermark at or above this run's first seq can only come from a previous run either,
so it renumbers too (trimming would take unsent measurements for sent ones).

Batches are cut by count (``batch_size``) and by serialized size (``max_batch_bytes``,
well under the estimator's 4 MiB receive limit), so no flush can fail for its size; a
single measurement too large for a batch is dropped (counted as refused) before sending.
While a call is in flight the buffer knows the last seq it carries
(``SeqBuffer.begin_flight``): one of those evicted meanwhile (a full buffer) counts as
sent when the ack's watermark covers it, as dropped when it does not or the call fails.

A measurement the estimator refuses (INVALID_ARGUMENT for ``measurements[i]``, malformed
or one its store cannot index: the whole batch is refused, the watermark does not move) would fail every later call, so the
stream drops that one measurement (``SeqBuffer.discard``: counted in ``dropped`` and
``refused``, logged) and goes on in the same session. The refused seq comes from the
estimator's message ("(seq N)"); an estimator that does not name it is asked for its
watermark, which locates the refused batch, and the measurement is dropped only if it
is malformed here too (``tessera.measurement.malformed``). A refusal it cannot locate
ends the session like any gRPC error.

Any other error of a session (not only a gRPC one; e.g. an OSError writing the seq
state) is logged with its traceback, counted in ``errors``, marks the stream
disconnected, and the stream reconnects after a backoff; it never ends the task.

Backoff: doubles after every failed session up to ``backoff_max_s``, and goes back to
``backoff_min_s`` only after a session in which a flush advanced the watermark (a
successful GetWatermark alone is no progress: an estimator that answers it but fails
every ReportMeasurements is retried at the backoff, not 10 times a second)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import grpc

from tessera import log
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc, profiler_pb2
from tessera.measurement import malformed

from .buffer import SeqBuffer

MAX_BATCH_BYTES = 1 << 20  # serialized MeasurementBatch, well under gRPC's default 4 MiB receive limit
_FIELD_OVERHEAD = 6        # a repeated field's tag (1 byte) and length prefix (<= 5 bytes)
_REFUSED = re.compile(r"^measurements\[(\d+)\]")
_REFUSED_SEQ = re.compile(r"\(seq (\d+)\)\s*$")


def cut(pending: list[profiler_pb2.Measurement], max_count: int,
        max_bytes: int = MAX_BATCH_BYTES) -> list[list[profiler_pb2.Measurement]]:
    """``pending`` in order, in batches of at most ``max_count`` measurements whose
    serialized MeasurementBatch is at most ``max_bytes`` (a measurement larger than that
    on its own makes a batch of one: the caller keeps such out)."""
    batches: list[list[profiler_pb2.Measurement]] = []
    cur: list[profiler_pb2.Measurement] = []
    size = 0
    for m in pending:
        n = m.ByteSize() + _FIELD_OVERHEAD
        if cur and (len(cur) >= max_count or size + n > max_bytes):
            batches.append(cur)
            cur, size = [], 0
        cur.append(m)
        size += n
    if cur:
        batches.append(cur)
    return batches


async def wait_any(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Return when any event is set, or after ``timeout`` seconds."""
    if any(e.is_set() for e in events):
        return
    tasks = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


class Streamer:
    def __init__(self, buffer: SeqBuffer, source: str, target: str, *,
                 on_seq_change: Callable[[int], None] | None = None,
                 flush_interval_s: float = 0.5, batch_size: int = 256, max_per_call: int = 4096,
                 backoff_min_s: float = 0.1, backoff_max_s: float = 5.0, rpc_timeout_s: float = 10.0,
                 max_batch_bytes: int = MAX_BATCH_BYTES) -> None:
        self.buffer = buffer
        self.source = source
        self.target = target
        self.on_seq_change = on_seq_change
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        self.max_per_call = max_per_call
        self.max_batch_bytes = max_batch_bytes
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.rpc_timeout_s = rpc_timeout_s
        self.changed = asyncio.Event()  # set by producers: something new is buffered
        self.connected = False
        self.flushes = 0
        self.advances = 0          # flushes whose ack advanced the watermark (trimmed the buffer)
        self.errors = 0            # sessions ended by an unexpected (non-gRPC) exception
        head = buffer.pending(limit=1)
        self.first_seq = head[0].seq if head else buffer.next_seq  # this run's first seq
        self._sent_any = False     # whether a ReportMeasurements call of this run has started
        self.log = log.get(component="profilerd.stream", source=source, estimator=target)

    def notify(self) -> None:
        self.changed.set()

    def _apply_watermark(self, wm: int) -> int:
        """Trim to (or renumber past) the estimator's watermark ``wm``; returns how many
        measurements it acknowledged (0 when it renumbered)."""
        # Nothing of this run has reached the estimator yet: whatever it holds at or
        # above our first seq was numbered by a previous run (see the module docstring).
        previous_run = not self._sent_any and wm >= self.first_seq
        if wm >= self.buffer.next_seq or previous_run:
            old = self.buffer.next_seq
            # rebase renumbers from its argument + 1 and needs it >= next_seq; a gap of
            # unused numbers is accepted by the estimator.
            new = self.buffer.rebase(max(wm, old))
            self.first_seq = max(wm, old) + 1  # where this run's numbers start now
            if self.on_seq_change is not None:
                self.on_seq_change(new)
            self.log.warning("estimator has seqs this daemon never issued (seq state lost?); renumbered the buffer",
                             watermark=wm, old_next_seq=old, next_seq=new)
            return 0
        return self.buffer.trim(wm)

    async def run(self, stop: asyncio.Event) -> None:
        """Stream until ``stop`` is set; then one last flush if connected."""
        backoff = self.backoff_min_s
        while not stop.is_set():
            channel = grpc.aio.insecure_channel(self.target)
            advances = self.advances
            try:
                stub = estimator_pb2_grpc.EstimatorServiceStub(channel)
                wm = await stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source=self.source), timeout=self.rpc_timeout_s)
                self._apply_watermark(wm.seq)
                self.connected = True
                self.log.info("connected to estimator", watermark=wm.seq, buffered=len(self.buffer))
                await self._session(stub, stop)
            except grpc.aio.AioRpcError as e:
                if self.advances != advances:  # this session got somewhere: the next failure starts over
                    backoff = self.backoff_min_s
                if self.connected:
                    self.log.warning("estimator stream lost; buffering", code=e.code().name, error=e.details(),
                                     buffered=len(self.buffer), retry_in_s=backoff)
                else:
                    self.log.info("estimator unreachable", code=e.code().name, retry_in_s=backoff)
                self.connected = False
            except Exception as e:  # anything else must not end the task while it looks connected
                if self.advances != advances:
                    backoff = self.backoff_min_s
                self.errors += 1
                self.connected = False
                self.log.exception("estimator stream failed; reconnecting", error=repr(e), retry_in_s=backoff,
                                   buffered=len(self.buffer), errors=self.errors)
            finally:
                await channel.close()
            if stop.is_set():
                break
            await wait_any(stop, timeout=backoff)
            backoff = min(backoff * 2, self.backoff_max_s)
        self.connected = False

    async def _session(self, stub, stop: asyncio.Event) -> None:
        while True:
            pending = self.buffer.pending(limit=self.max_per_call)
            if not pending:
                if stop.is_set():
                    return
                self.changed.clear()
                await wait_any(self.changed, stop)
                continue
            before = (self.buffer.sent, self.buffer.refused)
            await self._flush(stub, pending)
            if stop.is_set():
                if (self.buffer.sent, self.buffer.refused) == before:
                    return  # no progress: do not spin while stopping
                continue  # drain what is left, then return
            # let measurements accumulate into the next call
            await wait_any(stop, timeout=self.flush_interval_s)

    async def _flush(self, stub, pending) -> None:
        sendable = []
        for m in pending:
            if m.ByteSize() + _FIELD_OVERHEAD > self.max_batch_bytes:  # would fail every call, in any batch
                self._drop(m.seq, f"larger than a batch may be ({m.ByteSize()} > {self.max_batch_bytes} bytes)")
            else:
                sendable.append(m)
        if not sendable:
            return
        chunks = cut(sendable, self.batch_size, self.max_batch_bytes)
        batches = [estimator_pb2.MeasurementBatch(measurements=c) for c in chunks]
        self._sent_any = True  # from here on the estimator may hold seqs of this run
        # Evicted while the call carries them: counted as sent if the ack covers them,
        # else as dropped when the call ends (SeqBuffer.begin_flight / end_flight).
        self.buffer.begin_flight(sendable[-1].seq)
        try:
            try:
                ack = await stub.ReportMeasurements(iter(batches), timeout=self.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.INVALID_ARGUMENT or not await self._drop_refused(stub, chunks, e):
                    raise
                return
            self.flushes += 1
            wm = ack.watermark.get(self.source, 0)
            if self._apply_watermark(wm):
                self.advances += 1
            self.log.debug("flushed", sent=len(sendable), batches=len(batches), accepted=ack.accepted,
                           duplicates=ack.duplicates, watermark=wm)
        finally:
            self.buffer.end_flight()

    async def _drop_refused(self, stub, chunks, e: grpc.aio.AioRpcError) -> bool:
        """The estimator refused ``measurements[i]`` of one batch of the call ``chunks``
        made: drop that measurement. False when it cannot be told which one it was."""
        details = e.details() or ""
        found = _REFUSED.match(details)
        if not found:
            return False
        named = _REFUSED_SEQ.search(details)
        if named:
            seq = int(named.group(1))
        else:  # an estimator that does not name the seq: its watermark tells which batch failed
            i = int(found.group(1))
            old_next = self.buffer.next_seq
            wm = await stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source=self.source),
                                         timeout=self.rpc_timeout_s)
            self._apply_watermark(wm.seq)  # the batches before the refused one are persisted
            if self.buffer.next_seq != old_next:
                return False  # renumbered: the call's seqs mean nothing now
            refused = next((c for c in chunks if c[-1].seq > wm.seq), None)
            if refused is None or i >= len(refused) or refused[i].seq <= wm.seq or malformed(refused[i]) is None:
                return False
            seq = refused[i].seq
        return self._drop(seq, details)

    def _drop(self, seq: int, why: str) -> bool:
        m = self.buffer.discard(seq)
        if m is None:
            return False
        self.log.error("measurement refused; dropped it", seq=seq, kind=m.kind, job_id=m.job_id or None,
                       error=why, refused_total=self.buffer.refused, dropped_total=self.buffer.dropped)
        return True
