"""The stream to the estimator: one ReportMeasurements client-stream call per flush
(the pending measurements cut in batches), the buffer trimmed to the acknowledged
watermark; on (re)connect GetWatermark first, so only what the estimator has not
persisted is resent; reconnect with exponential backoff.

Renumbering: the estimator's watermark is the highest seq it persisted for this source.
One at or above ``next_seq`` means it holds seqs this daemon never issued (its seq state
was lost), so the buffer is renumbered past it. Before this process has sent anything,
a watermark at or above this run's first seq can only come from a previous run either,
so it renumbers too (trimming would take unsent measurements for sent ones).

Any other error of a session (not only a gRPC one; e.g. an OSError writing the seq
state) is logged with its traceback, counted in ``errors``, marks the stream
disconnected, and the stream reconnects after a backoff; it never ends the task."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from tessera import log
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc

from .buffer import SeqBuffer


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
                 backoff_min_s: float = 0.1, backoff_max_s: float = 5.0, rpc_timeout_s: float = 10.0) -> None:
        self.buffer = buffer
        self.source = source
        self.target = target
        self.on_seq_change = on_seq_change
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        self.max_per_call = max_per_call
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.rpc_timeout_s = rpc_timeout_s
        self.changed = asyncio.Event()  # set by producers: something new is buffered
        self.connected = False
        self.flushes = 0
        self.errors = 0            # sessions ended by an unexpected (non-gRPC) exception
        head = buffer.pending(limit=1)
        self.first_seq = head[0].seq if head else buffer.next_seq  # this run's first seq
        self._sent_any = False     # whether a ReportMeasurements call of this run has started
        self.log = log.get(component="profilerd.stream", source=source, estimator=target)

    def notify(self) -> None:
        self.changed.set()

    def _apply_watermark(self, wm: int) -> None:
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
        else:
            self.buffer.trim(wm)

    async def run(self, stop: asyncio.Event) -> None:
        """Stream until ``stop`` is set; then one last flush if connected."""
        backoff = self.backoff_min_s
        hold_backoff = False  # the last session failed unexpectedly without progress
        while not stop.is_set():
            channel = grpc.aio.insecure_channel(self.target)
            flushes = self.flushes
            try:
                stub = estimator_pb2_grpc.EstimatorServiceStub(channel)
                wm = await stub.GetWatermark(estimator_pb2.GetWatermarkRequest(source=self.source), timeout=self.rpc_timeout_s)
                self._apply_watermark(wm.seq)
                self.connected = True
                if not hold_backoff:
                    backoff = self.backoff_min_s
                hold_backoff = False
                self.log.info("connected to estimator", watermark=wm.seq, buffered=len(self.buffer))
                await self._session(stub, stop)
            except grpc.aio.AioRpcError as e:
                if self.connected:
                    self.log.warning("estimator stream lost; buffering", code=e.code().name, error=e.details(),
                                     buffered=len(self.buffer))
                else:
                    self.log.info("estimator unreachable", code=e.code().name, retry_in_s=backoff)
                self.connected = False
            except Exception as e:  # anything else must not end the task while it looks connected
                self.errors += 1
                self.connected = False
                hold_backoff = self.flushes == flushes  # failing before any progress: keep backing off
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
            before = self.buffer.sent
            await self._flush(stub, pending)
            if stop.is_set():
                if self.buffer.sent == before:
                    return  # no progress: do not spin while stopping
                continue  # drain what is left, then return
            # let measurements accumulate into the next call
            await wait_any(stop, timeout=self.flush_interval_s)

    async def _flush(self, stub, pending) -> None:
        batches = [estimator_pb2.MeasurementBatch(measurements=pending[i: i + self.batch_size])
                   for i in range(0, len(pending), self.batch_size)]
        self._sent_any = True  # from here on the estimator may hold seqs of this run
        ack = await stub.ReportMeasurements(iter(batches), timeout=self.rpc_timeout_s)
        self.flushes += 1
        wm = ack.watermark.get(self.source, 0)
        self._apply_watermark(wm)
        self.log.debug("flushed", sent=len(pending), accepted=ack.accepted, duplicates=ack.duplicates, watermark=wm)
