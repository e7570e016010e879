"""profilerd.commbench measures only the ops it is asked for (real gloo, 2 processes)."""

from __future__ import annotations

import pytest

from profilerd.commbench import OPS, table


def test_table_measures_the_requested_ops_only():
    rows, dev_s = table([4 << 10, 8 << 20], reps=3, ops=("all_reduce", "send_recv"))
    assert {r["op"] for r in rows} == {"all_reduce", "send_recv"}
    assert sorted((r["op"], r["bytes"]) for r in rows) == sorted(
        (op, b) for op in ("all_reduce", "send_recv") for b in (4 << 10, 8 << 20))
    assert all(r["world"] == 2 and r["seconds"] > 0 for r in rows) and dev_s > 0
    # send/recv to a waiting receiver is a transfer: 8 MiB through loopback takes
    # milliseconds, 4 KiB well under one (no skew between the ranks' compute in it).
    p2p = {r["bytes"]: r["seconds"] for r in rows if r["op"] == "send_recv"}
    assert p2p[8 << 20] > 2 * p2p[4 << 10]


def test_unknown_op_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="all_to_all"):
        table([4 << 10], reps=1, ops=("all_reduce", "all_to_all"))
    with pytest.raises(ValueError, match="none given"):
        table([4 << 10], reps=1, ops=())
    assert OPS == ("all_reduce", "all_gather", "broadcast", "send_recv")


def test_sync_table_adds_the_synchronisation_rows_one_resume_and_one_refill_row():
    """``sync=True``: two sync rows (8-byte all-reduce after a short and a long chunk, with
    the chunk's compute time), one resume row (a chunk after a blocking op minus the
    same chunk after a chunk, the median over pairs: positive and under a millisecond —
    0.1-0.5 ms on the 2-vCPU host, where the chunk itself takes ~0.5 ms) and one
    refill row (rank 0's chunk after waiting in recv for rank 1's long chunk: the wait
    is about that chunk, and the cost of coming back is a fraction of it)."""
    rows, _ = table([4 << 10], reps=3, sync=True, ops=("all_reduce",))
    sync = [r for r in rows if r["op"] == "sync"]
    assert len(sync) == 2 and sync[0]["compute_s"] < sync[1]["compute_s"]
    (resume,) = [r for r in rows if r["op"] == "resume"]
    assert resume["bytes"] == 0 and resume["world"] == 2 and 0 < resume["seconds"] < 1e-3
    (refill,) = [r for r in rows if r["op"] == "refill"]
    assert refill["bytes"] == 0 and refill["world"] == 2
    # rank 1 computed 24 units while rank 0 waited, the long sync chunk 48.
    assert refill["idle_s"] > 0.2 * sync[1]["compute_s"] and 0 < refill["seconds"] < refill["idle_s"]
