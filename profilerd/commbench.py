"""The communication micro-benchmark: torch.distributed gloo over loopback, 2 processes.

``table(sizes, reps)`` returns rows ``{"op", "bytes", "world", "seconds"}`` for
all_reduce, all_gather, broadcast and send/recv, plus the device-seconds it cost.
send/recv is one transfer to a receiver already waiting for it (half a ping-pong after
rank 0's compute: how a pipeline's hops run). Each collective is timed *in situ*: the
call itself, issued right after ~0.5 ms of training-like compute (``CHUNK_UNITS``),
without a barrier (ranks arrive with
their natural skew, as in a training step, and the wait for the later one is in the
call); the mean over ``reps`` (the expected cost, which is what a step's sum of many
ops adds up to). (Timing compute + op and subtracting a separate compute-alone run, as
before 2026-12-05, has the same expectation, but the two runs' own jitter — ~5 % of
the chunk — landed on the row: the sync rows' slope ``kappa`` ranged 0.01-0.17 over
eight runs. Timing the call alone also saves a compute chunk per rep.)
A barriered, idle-link loop is 2-10x too optimistic on a busy host. The mean, not the
median: an op can be bimodal (gloo as shipped, on a rank's one core: 0.3 ms, or 3-4 ms
when gloo's loop thread preempts the collective's worker, 30-50 % of calls; the ranks
here run that thread SCHED_BATCH, as the runtime's do — tessera.gloo — which removes
the slow mode), and a median of a few reps lands on either mode.

With ``sync=True`` it adds rows ``{"op": "sync", "bytes": 8, "world": 2, "seconds",
"compute_s"}`` and one ``{"op": "resume", "bytes": 0, "world": 2, "seconds"}`` (below).
A sync row is an 8-byte all-reduce right after a compute chunk of ``compute_s`` seconds
(two chunk lengths; the chunk's mean time in the same reps), the call alone timed. A
synchronous step waits at every collective for the slower rank; that wait grows with
the compute since the last synchronisation (``perfmodel.comm`` fits ``seconds = a +
kappa * compute_s``), which a 0.5 ms chunk cannot show. The resume row is what a
blocking op costs the compute after it: the median over pairs of the time of a
``CHUNK_UNITS`` chunk right after an 8-byte all-reduce minus that of the same chunk right
after another chunk
(``perfmodel.comm``: ``CommFit.resume``, added to every blocking op of a step). The
refill row ``{"op": "refill", "bytes": 0, "world": 2, "seconds", "idle_s"}`` is what
idling costs the compute after it: rank 0 waits in ``recv`` while rank 1 computes
``REFILL_IDLE_UNITS`` units (``idle_s``, the mean wait: a pipeline stage's wait for its
neighbour), then runs a ``REFILL_WEIGHTS``-weight chunk (~2 MiB working set, a pipeline
stage's) twice, in half the reps (at least 3); the mean of the first minus the mean of
the second (``perfmodel.comm``: ``CommFit.refill_time``, which the pipeline replay
charges to the side that waited). Off by default (profilerd passes ``--sync``).

Run as ``python -m profilerd.commbench [--sizes ...] [--reps N]`` it prints the rows as
one JSON document: profilerd (``--comm-benchmark``) runs it that way, in a fresh
process (forking the daemon, which has gRPC threads, would be unsafe), and reports
the rows to the estimator as ``kind="comm"`` measurements. bench/_measure.py uses
``table`` directly.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

from tessera.gloo import calm_loop_threads
from tessera.ports import free_port as _free_port

DEFAULT_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20)


OPS = ("all_reduce", "all_gather", "broadcast", "send_recv")
# The compute between two ops, in units of one transformer block's worth of training
# work: a (64, 256) activation through a 256x256 matmul, layer norm and GELU (~90 us
# here). A step's collectives follow such work, and what precedes a collective sets its
# cost: a 256 KiB all-reduce issued after ~0.6 ms of it took 0.32 ms (mean), after
# 0.2-1 ms of bare 128x128 matmuls (the chunk until 2026-12-05) 0.17-0.19 ms; 64 KiB
# 0.27 against 0.23, 1 MiB 0.48 against 0.40 (one interleaved run of each, 40 calls per
# cell). Priced from the matmul chunks, the collectives inside a tp = 2 step read ~half
# their in-step cost.
CHUNK_UNITS = 6  # ~0.5 ms before each timed op
SYNC_CHUNKS = (1, 48)  # units per compute chunk of the sync rows (~0.1 ms, ~4 ms here)
# The resume row: compute right after a blocking op is slower than the same compute right
# after other compute (the rank's caches and its core come back cold from the wait).
# Measured here (2026-12-05, fifth session; 30 pairs, medians): a 6-unit chunk 0.62 ms
# after a chunk, 0.69-0.72 after an all-reduce, 0.70-0.73 after ~3.5 ms waiting in recv;
# a 2-unit chunk +0.08 ms, a 24-unit one +0.10-0.13: a fixed refill, not a slower rate.
RESUME_REPS_FACTOR = 2
# The refill row: rank 1's compute while rank 0 idles in recv (24 units: ~2-6 ms here,
# the wait of a pipeline stage for a neighbour's micro-batch), and the chunk rank 0 times
# after it: a (64, 256) activation through 8 distinct 256x256 weights (2 MiB of weights:
# a pipeline stage's working set is 1-3 MiB of parameters here; the cost of coming back
# grows with it: +0.11-0.25 ms for 0.2 MiB, +0.29-0.67 for 2 MiB, +0.44-0.89 for 4 MiB
# after 6-25 ms idle, 2026-12-06), in half the reps of the other rows (at least 3): with
# 48 units and every rep the row cost ~0.5 device-s per table on this host, a third of
# the whole table's (the benchmark's profiling ratio fell to 10.2x), with 32 units and
# half the reps ~0.25.
REFILL_IDLE_UNITS = 24
REFILL_WEIGHTS = 8


def _refill(dist, rank: int, act, norm, work, reps: int) -> dict:
    """The refill row (module doc): on rank 0, the mean of a working-set chunk right after
    waiting in ``recv`` minus the mean of the same chunk right after it, and the mean wait."""
    import torch

    x = torch.zeros(2)
    weights = [torch.randn(256, 256) / 16.0 for _ in range(REFILL_WEIGHTS)]

    def chunk() -> None:
        with torch.no_grad():
            h = act
            for w in weights:
                h = torch.nn.functional.gelu(norm(h @ w))

    chunk()
    idle, after_wait, after_chunk = [], [], []
    for _ in range(reps):
        if rank == 1:
            work(REFILL_IDLE_UNITS)
            dist.send(x, dst=0)
            dist.recv(x, src=0)
            continue
        t = time.perf_counter()
        dist.recv(x, src=1)
        t0 = time.perf_counter()
        chunk()
        t1 = time.perf_counter()
        chunk()
        t2 = time.perf_counter()
        dist.send(x, dst=1)
        idle.append(t0 - t)
        after_wait.append(t1 - t0)
        after_chunk.append(t2 - t1)
    if rank == 1:
        return {}
    return {"op": "refill", "bytes": 0, "world": 2,
            "seconds": max(1e-6, statistics.fmean(after_wait) - statistics.fmean(after_chunk)),
            "idle_s": statistics.fmean(idle)}


def _one_way(dist, rank: int, x, reps: int, work) -> float:
    """Seconds of one point-to-point transfer of ``x`` to a rank already waiting for it:
    rank 0 computes, then sends and waits for the echo; rank 1 sits in ``recv`` and
    echoes at once; half the mean round trip. A pipeline's transfer goes to a stage that
    is waiting (fill, drain) or finds the data waiting (steady state); the skew between
    stages is the schedule's, priced by the composition. Timing the sender after equal
    compute on both ranks (as the collectives are) priced that skew into every hop: ~1 ms
    for 64 KiB here, where the transfer to a waiting receiver takes ~0.2 ms."""
    for _ in range(2):  # warm-up (connection setup, buffers)
        if rank == 0:
            dist.send(x, dst=1)
            dist.recv(x, src=1)
        else:
            dist.recv(x, src=0)
            dist.send(x, dst=0)
    rtt = []
    for _ in range(reps):
        if rank == 0:
            work()
            t = time.perf_counter()
            dist.send(x, dst=1)
            dist.recv(x, src=1)
            rtt.append(time.perf_counter() - t)
        else:
            dist.recv(x, src=0)
            dist.send(x, dst=0)
    return max(1e-6, statistics.fmean(rtt) / 2) if rtt else 0.0


def _rank(rank: int, port: int, sizes: list[int], reps: int, out_path: str, sync: bool = False,
          ops: tuple[str, ...] = OPS) -> None:
    code = 1
    # A forked rank never collects what it inherited: a full collection walking the
    # parent's objects would land inside a timed rep (tens of ms against rows of 0.1 ms).
    gc.freeze()
    try:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, [cores[rank % len(cores)]])
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        calm_loop_threads()  # as the runtime's ranks run (tessera.gloo)
        act, weight = torch.randn(64, 256), torch.randn(256, 256) / 16.0
        norm = torch.nn.LayerNorm(256)

        def work(n: int = CHUNK_UNITS) -> None:
            with torch.no_grad():
                for _ in range(n):
                    torch.nn.functional.gelu(norm(act @ weight))

        for _ in range(5):
            work()
        rows = []
        for nbytes in sizes:
            n = max(1, nbytes // 4)
            x = torch.ones(n)
            outs = [torch.empty(n) for _ in range(2)]

            fns = {"all_reduce": lambda: dist.all_reduce(x),
                   "all_gather": lambda: dist.all_gather(outs, x),
                   "broadcast": lambda: dist.broadcast(x, src=0)}

            for op in ops:
                if op == "send_recv":
                    rows.append({"op": op, "bytes": n * 4, "world": 2, "seconds": _one_way(dist, rank, x, reps, work)})
                    continue
                fn = fns[op]
                fn()  # warm-up (connection setup, buffers)
                ts = []
                for _ in range(reps):
                    work()
                    t = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t)
                rows.append({"op": op, "bytes": n * 4, "world": 2, "seconds": max(1e-6, statistics.fmean(ts))})
        if sync:
            x = torch.ones(2)
            for chunk in SYNC_CHUNKS:
                ts, base = [], []
                for _ in range(reps):
                    t = time.perf_counter()
                    work(chunk)
                    t1 = time.perf_counter()
                    dist.all_reduce(x)
                    base.append(t1 - t)
                    ts.append(time.perf_counter() - t1)
                rows.append({"op": "sync", "bytes": 8, "world": 2, "seconds": max(1e-6, statistics.fmean(ts)),
                             "compute_s": statistics.fmean(base), "chunk": chunk})
            # Resume: a compute chunk right after a blocking op against the same chunk
            # right after another chunk (RESUME_REPS_FACTOR x reps pairs).
            after_op, after_chunk = [], []
            dist.all_reduce(x)
            for _ in range(RESUME_REPS_FACTOR * reps):
                t = time.perf_counter()
                work()
                t1 = time.perf_counter()
                work()
                t2 = time.perf_counter()
                dist.all_reduce(x)
                after_op.append(t1 - t)
                after_chunk.append(t2 - t1)
            # The median of the pairs' differences: one chunk the host disturbed (a 20 ms
            # stall among 0.5 ms chunks) moved the mean of 6 pairs by 3 ms, six times the
            # effect measured (2026-12-07: 0.001-3.3 ms over four tables, reps 3).
            rows.append({"op": "resume", "bytes": 0, "world": 2,
                         "seconds": max(1e-6, statistics.median(a - b for a, b in zip(after_op, after_chunk)))})
            refill = _refill(dist, rank, act, norm, work, max(3, reps // 2))
            if refill:  # rank 0's; rank 1 only computed and echoed
                rows.append(refill)
        if rank == 0:
            with open(out_path, "w", encoding="utf-8") as f:
                json.dump(rows, f)
        dist.destroy_process_group()
        code = 0
    finally:
        os._exit(code)


def table(sizes: list[int] | tuple[int, ...] | None = None, reps: int = 7,
          timeout_s: float = 120.0, sync: bool = False, ops: tuple[str, ...] = OPS) -> tuple[list[dict], float]:
    """Run the micro-benchmark (2 forked ranks); (rows, device-seconds); ``sync`` adds
    the synchronisation rows (module docstring); ``ops`` (a subset of ``OPS``) are the
    ops measured, in that order. Raises ValueError for an unknown op, RuntimeError when
    a rank fails or times out. Call it from a process without threads that must not be
    forked (not from a gRPC server)."""
    bad = [op for op in ops if op not in OPS]
    if bad or not ops:
        raise ValueError(f"ops: unknown {bad or 'none given'}; a subset of {list(OPS)}")
    sizes = list(sizes or DEFAULT_SIZES)
    ctx = mp.get_context("fork")
    port = _free_port()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-comm-") as tmp:
        path = os.path.join(tmp, "rows.json")
        procs = [ctx.Process(target=_rank, args=(r, port, sizes, reps, path, sync, tuple(ops)), daemon=True)
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
                p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"comm micro-benchmark failed: exit codes {[p.exitcode for p in procs]}")
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    return rows, (time.monotonic() - t0) * 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="gloo loopback communication micro-benchmark (JSON rows on stdout)")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="bytes per rank")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sync", action="store_true", help="add the synchronisation rows (op sync, with compute_s)")
    a = ap.parse_args(argv)
    if a.reps < 1 or any(s <= 0 for s in a.sizes):
        print("--reps and --sizes must be positive", file=sys.stderr)
        return 2
    rows, dev_s = table(a.sizes, a.reps, sync=a.sync)
    json.dump({"rows": rows, "device_s": dev_s}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
