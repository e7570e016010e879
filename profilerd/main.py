"""``tessera-profilerd``: one per node. Samples the node's devices (NVML; /proc on CPU),
receives step timings from local executors (ReportStep), and streams every measurement
to the estimator with a bounded buffer, per-source sequence numbers and reconnect."""

from __future__ import annotations

import asyncio
import json
import sys

import structlog
import time

from tessera import config, grpcserver, log
from tessera.api.v1 import profiler_pb2, profiler_pb2_grpc
from tessera.errors import SpecError
from tessera.measurement import COMM_OPTIONAL_VALUES

from .api import ProfilerService
from .buffer import Counters, MeasurementTooLarge, SeqBuffer
from .config import ProfilerdConfig
from .samplers import CpuSampler, NvmlSampler, Sampler
from .seqstate import SeqNotPersisted, SeqReservation, SeqStateError
from .stream import Streamer, wait_any

SERVICE = grpcserver.full_name(profiler_pb2, "ProfilerService")
DROP_LOG_INTERVAL_S = 5.0


def default_samplers(cfg: ProfilerdConfig, nvml=None) -> list[Sampler]:
    """NVML GPUs when present (and not disabled), else the CPU sampler."""
    if not cfg.disable_nvml:
        gpu = NvmlSampler.create(cfg.node, nvml)
        if gpu is not None:
            return [gpu]
    return [CpuSampler(cfg.node)]


class Profilerd:
    """The daemon's core: numbering, buffering, sampling and streaming. ``start`` and
    ``stop`` drive the background tasks; the gRPC server is run around it.

    Drops: every measurement the full buffer drops is logged ("buffer full: dropped
    oldest measurements", with how many since the last such line), at most once per
    ``DROP_LOG_INTERVAL_S``: a drop that comes too soon after a line is logged by a later
    one, by the periodic check (``start``) or, at the latest, by ``stop``.
    Seq state: a measurement whose number cannot be persisted (``SeqNotPersisted``) is not
    buffered; a sampler's is counted as dropped (``unpersisted``, in ``counters().dropped``)
    and logged, the rest of the tick's samples still go in."""

    comm_bench_argv: tuple[str, ...] = (sys.executable, "-m", "profilerd.commbench", "--sync")
    comm_bench_timeout_s: float = 300.0
    colo_bench_argv: tuple[str, ...] = (sys.executable, "-m", "profilerd.colobench")
    colo_bench_timeout_s: float = 300.0

    def __init__(self, cfg: ProfilerdConfig, samplers: list[Sampler] | None = None) -> None:
        self.cfg = cfg
        self.source = f"profilerd/{cfg.node}"
        self.log = log.get(component="profilerd", node_id=cfg.node)
        self.reservation = SeqReservation(cfg.state_dir)
        self.buffer = SeqBuffer(cfg.buffer_size, self.reservation.first_seq(), max_bytes=cfg.buffer_bytes)
        self.samplers = samplers if samplers is not None else (default_samplers(cfg) if cfg.sample_interval_s > 0 else [])
        self.streamer = (Streamer(self.buffer, self.source, cfg.estimator, on_seq_change=self.reservation.ensure,
                                  flush_interval_s=cfg.flush_interval_s, batch_size=cfg.batch_size,
                                  backoff_max_s=cfg.reconnect_max_s)
                         if cfg.estimator else None)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.unpersisted = 0  # samplers' measurements lost because the seq state could not be written
        self._evicted_logged = 0  # buffer.evicted as of the last "buffer full" line
        self._last_drop_log = float("-inf")

    @property
    def connected(self) -> bool:
        return self.streamer is not None and self.streamer.connected

    @property
    def stream_errors(self) -> int:
        """Streaming sessions that ended by an unexpected (non-gRPC) error so far."""
        return self.streamer.errors if self.streamer is not None else 0

    def stamp(self, m: profiler_pb2.Measurement) -> None:
        """Set ``m``'s source, and its node and time when unset (what ``add`` buffers)."""
        m.source = self.source
        if not m.node:
            m.node = self.cfg.node
        if not m.time:
            m.time = time.time()

    def counters(self) -> Counters:
        """The buffer's counters, ``dropped`` including the samplers' measurements lost to
        a seq state that could not be written (``unpersisted``): what GetStats reports."""
        c = self.buffer.counters()
        c.dropped += self.unpersisted
        return c

    def add(self, m: profiler_pb2.Measurement) -> int:
        """Stamp (``stamp``), number and buffer ``m``; returns its seq. Raises
        ``buffer.MeasurementTooLarge`` (nothing buffered, nothing evicted) for one that
        alone is over the buffer's byte bound, and ``SeqNotPersisted`` when the seq state
        cannot be written (nothing buffered, nothing evicted, no number used)."""
        self.stamp(m)
        try:
            self.reservation.ensure(self.buffer.next_seq)  # the number is durable before it is used
        except OSError as e:  # ensure changed nothing
            raise SeqNotPersisted(f"sequence state not persisted: {e}") from e
        try:
            seq, dropped = self.buffer.add(m)
        except MeasurementTooLarge as e:
            self.log.warning("measurement larger than the whole buffer refused", kind=m.kind, error=str(e),
                             oversized_total=self.buffer.oversized)
            raise
        if dropped:  # either bound (count or bytes) exceeded
            self.log_drops()
        if self.streamer is not None:
            self.streamer.notify()
        return seq

    def log_drops(self, force: bool = False) -> int:
        """Log the buffer-full drops (``buffer.evicted``) not logged yet, unless a line was
        logged less than ``DROP_LOG_INTERVAL_S`` ago (``force``: regardless). Returns how
        many it logged."""
        unlogged = self.buffer.evicted - self._evicted_logged
        now = time.monotonic()
        if unlogged <= 0 or (not force and now - self._last_drop_log < DROP_LOG_INTERVAL_S):
            return 0
        self.log.warning("buffer full: dropped oldest measurements", dropped=unlogged,
                         dropped_total=self.buffer.dropped, capacity=self.buffer.capacity,
                         capacity_bytes=self.buffer.max_bytes, buffered=len(self.buffer),
                         buffered_bytes=self.buffer.bytes)
        self._evicted_logged += unlogged
        self._last_drop_log = now
        return unlogged

    async def _drop_log_loop(self) -> None:
        """Log the drops ``add`` held back (rate limit), and those the stream settles
        after an ack (evicted in flight), within about ``DROP_LOG_INTERVAL_S``."""
        while not self._stop.is_set():
            await wait_any(self._stop, timeout=DROP_LOG_INTERVAL_S)
            self.log_drops()

    async def _sample_loop(self) -> None:
        interval = self.cfg.sample_interval_s
        next_at = time.monotonic() + interval
        while not self._stop.is_set():
            await wait_any(self._stop, timeout=max(0.0, next_at - time.monotonic()))
            if self._stop.is_set():
                return
            next_at = max(next_at + interval, time.monotonic())  # no burst after a stall
            for s in self.samplers:
                try:
                    self._add_samples(s)
                except Exception as e:  # a flaky sensor must not kill the daemon
                    self.log.warning("sampling failed", sampler=type(s).__name__, error=str(e))

    def _add_samples(self, s: Sampler) -> None:
        """One tick of sampler ``s``: each measurement is added on its own; one that cannot
        be (seq state not written; larger than the buffer, logged by ``add``) does not stop
        the rest. Those lost to the seq state are counted as dropped and logged."""
        lost, error = 0, ""
        for m in s.sample():
            try:
                self.add(m)
            except SeqNotPersisted as e:
                self.unpersisted += 1
                lost, error = lost + 1, str(e)
            except MeasurementTooLarge:
                pass  # logged and counted (oversized) by add
        if lost:
            self.log.warning("sequence state not persisted; dropped samples", sampler=type(s).__name__,
                             dropped=lost, dropped_total=self.counters().dropped, error=error)

    async def comm_benchmark(self) -> int:
        """Run ``profilerd.commbench`` (``comm_bench_argv``) in a fresh process and buffer
        its rows as ``kind="comm"`` measurements (labels op, link; values bytes, world,
        seconds, and compute_s on the synchronisation rows that ``--sync`` adds, idle_s on
        its refill row). Returns the rows reported (buffered). A failure (the child cannot
        be started, exits non-zero, outlives ``comm_bench_timeout_s``, prints no valid
        table; a row ``add`` refuses) is logged ("comm micro-benchmark failed", with the rows
        buffered before it), never raised; a child still running on a timeout or a
        cancellation is killed and reaped, and a cancellation propagates."""
        rows = [0]  # buffered so far, also when a later row fails
        try:
            return await self._comm_benchmark(rows)
        except TimeoutError:
            self.log.warning("comm micro-benchmark failed", rows=rows[0], link=self.cfg.comm_link,
                             error=f"no result within {self.comm_bench_timeout_s} s; killed it")
            return rows[0]
        except Exception as e:  # CancelledError is no Exception: it propagates
            self.log.warning("comm micro-benchmark failed", rows=rows[0], link=self.cfg.comm_link, error=repr(e),
                             exc_info=True)
            return rows[0]

    async def _child_json(self, argv: tuple[str, ...], timeout_s: float, what: str) -> dict | None:
        """Run ``argv`` in a fresh process (forking the daemon, which has gRPC threads,
        would be unsafe) and return its stdout as JSON; None, logged ("<what> failed" with
        its exit code and last stderr), when it exits non-zero. A timeout (TimeoutError)
        or a cancellation kills and reaps it, and propagates."""
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
        except BaseException:  # timeout, cancellation: no orphaned benchmark
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            self.log.warning(f"{what} failed", code=proc.returncode, stderr=err.decode(errors="replace")[-500:])
            return None
        return json.loads(out)

    async def _comm_benchmark(self, rows: list[int]) -> int:
        doc = await self._child_json(self.comm_bench_argv, self.comm_bench_timeout_s, "comm micro-benchmark")
        if doc is None:
            return 0
        for r in doc["rows"]:
            values = {"bytes": float(r["bytes"]), "world": float(r["world"]), "seconds": float(r["seconds"])}
            # The sync rows' compute_s (the straggler wait), the refill row's idle_s.
            values.update({k: float(r[k]) for k in COMM_OPTIONAL_VALUES if k in r})
            self.add(profiler_pb2.Measurement(kind="comm", labels={"op": r["op"], "link": self.cfg.comm_link},
                                              values=values))
            rows[0] += 1
        self.log.info("comm micro-benchmark reported", rows=rows[0], link=self.cfg.comm_link,
                      device_s=round(doc["device_s"], 2))
        return rows[0]

    async def colocation_benchmark(self) -> int:
        """Run ``profilerd.colobench`` (``colo_bench_argv``) in a fresh process and buffer
        its pairs as ``kind="colocation"`` measurements (labels mode, device_kind "cpu" and
        the measured module's shape: layers, hidden, heads, vocab, rows, seq — the
        estimator's ``interference_ref``; values colocated, oversubscription, alone_s,
        together_s) and its ``ranks`` row as a ``kind="ranks"`` one
        (``_colobench_measurement``). Returns the rows buffered. Failures are logged ("colocation
        micro-benchmark failed", with the child's last words), never raised; a child still
        running on a timeout or a cancellation is killed and reaped, and a cancellation
        propagates."""
        rows = [0]
        try:
            return await self._colocation_benchmark(rows)
        except TimeoutError:
            self.log.warning("colocation micro-benchmark failed", rows=rows[0],
                             error=f"no result within {self.colo_bench_timeout_s} s; killed it")
            return rows[0]
        except Exception as e:  # CancelledError is no Exception: it propagates
            self.log.warning("colocation micro-benchmark failed", rows=rows[0], error=repr(e), exc_info=True)
            return rows[0]

    async def _colocation_benchmark(self, rows: list[int]) -> int:
        doc = await self._child_json(self.colo_bench_argv, self.colo_bench_timeout_s, "colocation micro-benchmark")
        if doc is None:
            return 0
        for r in doc["rows"]:
            self.add(self._colobench_measurement(r))
            rows[0] += 1
        self.log.info("colocation micro-benchmark reported", rows=rows[0], device_s=round(doc["device_s"], 2),
                      **{f"{r['mode']}_ratio": round(r["together_s"] / r["alone_s"], 3)
                         for r in doc["rows"] if "together_s" in r},
                      **{f"{r['mode']}_step_s": round(r["seconds"], 5) for r in doc["rows"] if "seconds" in r})
        return rows[0]

    def _colobench_measurement(self, r: dict) -> profiler_pb2.Measurement:
        """One row of ``profilerd.colobench`` as a measurement: a pair (split, shared) as
        ``kind="colocation"``; the ``ranks`` row (one job's 2-stage pipeline) as
        ``kind="ranks"`` — labels mode, device_kind "cpu", link (``comm_link``: the link
        its ranks' transfers take, whose comm fit the estimator prices them with), the
        module's shape (layers, hidden, heads, vocab, seq_len) and the plan (batch, seq,
        dp, tp, pp, micro_batches); values seconds (the median step) and quota (cores
        per rank)."""
        if r["mode"] == "ranks":
            labels = {"mode": r["mode"], "device_kind": "cpu", "link": self.cfg.comm_link,
                      "seq_len": str(int(r["seq"])), "batch": str(int(r["rows"])),
                      **{k: str(int(r[k])) for k in ("layers", "hidden", "heads", "vocab", "seq",
                                                     "dp", "tp", "pp", "micro_batches")}}
            return profiler_pb2.Measurement(kind="ranks", labels=labels,
                                            values={"seconds": float(r["seconds"]), "quota": float(r["quota"])})
        labels = {"mode": r["mode"], "device_kind": "cpu",
                  **{k: str(int(r[k])) for k in ("layers", "hidden", "heads", "vocab", "rows", "seq")}}
        values = {k: float(r[k]) for k in ("colocated", "oversubscription", "alone_s", "together_s")}
        return profiler_pb2.Measurement(kind="colocation", labels=labels, values=values)

    async def _benchmarks(self) -> None:
        """The start-up micro-benchmarks the configuration asks for, one after the other
        (run together, each would measure the other's load)."""
        if self.cfg.comm_benchmark:
            await self.comm_benchmark()
        if self.cfg.colocation_benchmark:
            await self.colocation_benchmark()

    def start(self) -> None:
        """Start sampling, streaming and the periodic drop log (call from the running loop)."""
        self._tasks.append(asyncio.create_task(self._drop_log_loop()))
        if self.cfg.comm_benchmark or self.cfg.colocation_benchmark:
            self._tasks.append(asyncio.create_task(self._benchmarks()))
        if self.samplers and self.cfg.sample_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._sample_loop()))
        if self.streamer is not None:
            self._tasks.append(asyncio.create_task(self.streamer.run(self._stop)))
        self.log.info("profilerd started", source=self.source, estimator=self.cfg.estimator or None,
                      next_seq=self.buffer.next_seq, samplers=[type(s).__name__ for s in self.samplers])

    async def stop(self) -> None:
        """Stop sampling, try one last flush (bounded by the grace), stop streaming, and log
        the drops not logged yet (regardless of the rate limit)."""
        self._stop.set()
        if self._tasks:
            done, pending = await asyncio.wait(self._tasks, timeout=self.cfg.grace_s + 1)
            for t in pending:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self.samplers:
            close = getattr(s, "close", None)
            if close:
                close()
        self.buffer.end_flight()  # no call is in flight any more
        self.log_drops(force=True)
        c = self.counters()
        self.log.info("profilerd stopped", sent=c.sent, dropped=c.dropped, unsent=c.buffered, next_seq=c.next_seq)

    def servicers(self):
        return [(profiler_pb2_grpc.add_ProfilerServiceServicer_to_server, ProfilerService(self))]


async def serve(cfg: ProfilerdConfig, stop: asyncio.Event | None = None, samplers: list[Sampler] | None = None) -> None:
    """Run until ``stop`` is set (SIGTERM/SIGINT when None)."""
    d = Profilerd(cfg, samplers)

    def started(r: grpcserver.Running) -> None:
        d.log.info("listening", listen=cfg.listen, port=r.port)
        d.start()

    await grpcserver.serve(d.servicers(), [SERVICE], cfg.listen, stop=stop, grace=cfg.grace_s,
                           on_started=started, on_stop=d.stop)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2: bad configuration or a corrupt seq
    file, one line on stderr naming it; 1: cannot serve)."""
    try:
        cfg = config.load(ProfilerdConfig, argv, "TESSERA_PROFILERD_", __doc__)
    except SpecError as e:
        print(f"tessera-profilerd: {e}", file=sys.stderr)
        return 2
    logger = log.setup("profilerd", node_id=cfg.node)
    structlog.contextvars.bind_contextvars(service="profilerd", node_id=cfg.node)  # on every line, not only this logger's
    try:
        asyncio.run(serve(cfg))
    except SeqStateError as e:  # state that needs an operator, like a configuration error
        print(f"tessera-profilerd: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        logger.error("profilerd failed", error=str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
