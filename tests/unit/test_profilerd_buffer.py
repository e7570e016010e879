"""profilerd's bounded seq buffer and its seq reservation (pure logic, no servers)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from profilerd.buffer import MeasurementTooLarge, SeqBuffer
from profilerd.seqstate import SeqReservation
from tessera.api.v1 import profiler_pb2


def m(i: int = 0) -> profiler_pb2.Measurement:
    return profiler_pb2.Measurement(kind="step", step=i)


def test_numbers_from_next_seq():
    b = SeqBuffer(10, next_seq=5)
    assert [b.add(m())[0] for _ in range(3)] == [5, 6, 7]
    assert [x.seq for x in b.pending()] == [5, 6, 7]
    assert b.counters().next_seq == 8


def test_bounded_drops_oldest_and_counts():
    b = SeqBuffer(3)
    dropped = [b.add(m(i))[1] for i in range(5)]
    assert dropped == [False, False, False, True, True]
    assert [x.seq for x in b.pending()] == [3, 4, 5]
    c = b.counters()
    assert (c.buffered, c.dropped, c.sent, c.next_seq) == (3, 2, 0, 6)


def test_trim_to_watermark_counts_sent():
    b = SeqBuffer(10)
    for _ in range(6):
        b.add(m())
    assert b.trim(0) == 0
    assert b.trim(4) == 4
    assert [x.seq for x in b.pending()] == [5, 6]
    assert b.trim(4) == 0  # idempotent: a repeated ack changes nothing
    assert b.trim(100) == 2
    assert (len(b), b.sent) == (0, 6)


def test_trim_after_drop_and_pending_window():
    b = SeqBuffer(3)
    for _ in range(5):
        b.add(m())
    assert b.trim(3) == 1  # 1, 2 were dropped, not sent
    assert b.sent == 1 and b.dropped == 2
    b.add(m())
    assert [x.seq for x in b.pending(after=4)] == [5, 6]
    assert [x.seq for x in b.pending(limit=1)] == [4]


def test_rebase_when_estimator_is_ahead():
    b = SeqBuffer(10)
    for _ in range(3):
        b.add(m())
    assert b.rebase(2) == 4  # estimator behind: nothing changes
    assert b.rebase(40) == 44
    assert [x.seq for x in b.pending()] == [41, 42, 43]
    assert b.add(m())[0] == 44


def test_bad_arguments():
    with pytest.raises(ValueError):
        SeqBuffer(0)
    with pytest.raises(ValueError):
        SeqBuffer(5, next_seq=0)


@given(cap=st.integers(1, 20), ops=st.lists(st.one_of(st.just(None), st.integers(0, 80)), max_size=120))
def test_invariants(cap, ops):
    """Any mix of adds (None) and acks (ints): bounded, seqs increasing, every number
    issued is exactly one of buffered, sent, dropped, or trimmed-after-drop."""
    b = SeqBuffer(cap)
    acked = 0
    for op in ops:
        if op is None:
            b.add(m())
        else:
            acked = max(acked, min(op, b.next_seq - 1))
            b.trim(acked)
        seqs = [x.seq for x in b.pending()]
        assert len(seqs) <= cap
        assert seqs == sorted(set(seqs))
        assert all(s > acked for s in seqs)
        c = b.counters()
        assert c.buffered + c.sent + c.dropped == c.next_seq - 1


def test_seq_reservation_survives_restart(tmp_path):
    r = SeqReservation(tmp_path, block=10)
    assert r.first_seq() == 1
    r.ensure(10)
    r.ensure(11)  # crosses the block: a new reservation is persisted first
    assert r.reserved == 20
    r2 = SeqReservation(tmp_path, block=10)
    assert r2.first_seq() == 21  # never reuses a number that may have been sent


def test_discard_removes_one_by_seq_and_counts_it_dropped_and_refused():
    b = SeqBuffer(10)
    for i in range(5):
        b.add(m(i))
    assert b.discard(3).step == 2
    assert [x.seq for x in b.pending()] == [1, 2, 4, 5]
    assert (b.dropped, b.refused) == (1, 1)
    assert b.discard(3) is None and b.discard(99) is None  # gone / never buffered: nothing counted
    assert (b.dropped, b.refused, len(b)) == (1, 1, 4)
    assert b.trim(4) == 3 and b.sent == 3  # the gap is no measurement


# --- the byte bound

def big(i: int, n: int) -> profiler_pb2.Measurement:
    return profiler_pb2.Measurement(kind="step", step=i, labels={"plan": "x" * n})


def test_byte_bound_drops_oldest_until_both_bounds_hold():
    one = big(1, 1000)
    one.seq = 1
    size = one.ByteSize()  # every one of these (steps, seqs 1..5 take a byte each)
    b = SeqBuffer(100, max_bytes=3 * size + size // 2)  # room for 3 by bytes, 100 by count
    results = [b.add(big(i, 1000)) for i in range(1, 6)]
    assert [d for _, d in results] == [0, 0, 0, 1, 1]
    assert [x.step for x in b.pending()] == [3, 4, 5]
    assert b.bytes == 3 * size == b.counters().buffered_bytes
    assert (b.dropped, b.refused) == (2, 0)
    # one larger measurement pushes out as many of the oldest as it needs
    seq, dropped = b.add(big(6, 2 * size))
    assert dropped == 2 and [x.step for x in b.pending()] == [5, 6]
    assert b.bytes <= b.max_bytes


def test_byte_bound_a_measurement_over_the_bound_alone_is_refused_and_evicts_nothing():
    b = SeqBuffer(10, max_bytes=500)
    for i in range(3):
        b.add(big(i, 10))
    before = [x.seq for x in b.pending()], b.bytes
    huge = big(9, 1000)
    with pytest.raises(MeasurementTooLarge, match="at most 500 bytes"):
        b.add(huge)
    assert ([x.seq for x in b.pending()], b.bytes) == before and huge.seq == 0
    c = b.counters()
    assert (c.dropped, c.oversized, c.next_seq) == (0, 1, 4)
    assert b.add(big(3, 10)) == (4, 0)  # no number was used for the refused one


def test_bytes_follow_trim_and_discard():
    b = SeqBuffer(10, max_bytes=1 << 20)
    sizes = []
    for i in range(4):
        b.add(big(i, 100 * (i + 1)))
        sizes.append(b.pending()[-1].ByteSize())
    assert b.bytes == sum(sizes)
    b.trim(1)
    assert b.bytes == sum(sizes[1:])
    b.discard(3)
    assert b.bytes == sizes[1] + sizes[3]
    b.trim(4)
    assert b.bytes == 0


def test_bad_max_bytes():
    with pytest.raises(ValueError, match="max_bytes"):
        SeqBuffer(5, max_bytes=0)


@given(cap=st.integers(1, 20), max_bytes=st.integers(1, 400),
       ops=st.lists(st.one_of(st.none(), st.integers(0, 80), st.integers(0, 120).map(lambda n: -n - 1)), max_size=120))
def test_invariants_with_a_byte_bound(cap, max_bytes, ops):
    """Adds of varied sizes (negative ints: -n-1, a label of n bytes), acks (ints >= 0),
    None (a small add): both bounds hold after every operation, bytes is the sum of what
    is buffered, and every number issued is buffered, sent or dropped."""
    b = SeqBuffer(cap, max_bytes=max_bytes)
    acked = 0
    for op in ops:
        if op is None or op < 0:
            x = m() if op is None else big(0, -op - 1)
            x.seq = b.next_seq
            alone = x.ByteSize()
            if alone > max_bytes:
                before = [y.seq for y in b.pending()]
                with pytest.raises(MeasurementTooLarge):
                    b.add(x)
                assert [y.seq for y in b.pending()] == before  # nothing evicted for it
            else:
                b.add(x)
        else:
            acked = max(acked, min(op, b.next_seq - 1))
            b.trim(acked)
        items = b.pending()
        assert len(items) <= cap and b.bytes <= max_bytes
        assert b.bytes == sum(x.ByteSize() for x in items)
        assert [x.seq for x in items] == sorted({x.seq for x in items})
        c = b.counters()
        assert c.buffered + c.sent + c.dropped == c.next_seq - 1


# --- eviction of measurements a call to the estimator carries (in flight)

def test_evicted_in_flight_and_acknowledged_counts_as_sent_not_dropped():
    b = SeqBuffer(3)
    for i in range(3):
        b.add(m(i))
    b.begin_flight(3)  # seqs 1..3 handed to ReportMeasurements
    assert b.add(m(3)) == (4, 0)  # evicts seq 1, which the estimator may be storing
    assert [x.seq for x in b.pending()] == [2, 3, 4] and len(b) == 3  # the count bound holds as before
    c = b.counters()
    assert (c.dropped, c.evicted, c.evicted_in_flight) == (0, 0, 1)
    assert b.trim(3) == 3  # the ack covers 1..3: 2 and 3 trimmed, 1 settled
    assert b.end_flight() == 0
    c = b.counters()
    assert (c.buffered, c.sent, c.dropped, c.evicted, c.evicted_in_flight) == (1, 3, 0, 0, 0)


def test_evicted_in_flight_and_not_acknowledged_is_dropped_when_the_call_ends():
    b = SeqBuffer(3)
    for i in range(3):
        b.add(m(i))
    b.begin_flight(3)
    b.add(m(3))
    b.add(m(4))  # seqs 1 and 2 evicted in flight
    assert b.dropped == 0
    assert b.trim(1) == 1  # the ack covers seq 1 only
    assert b.end_flight() == 1  # seq 2: not stored
    c = b.counters()
    assert (c.buffered, c.sent, c.dropped, c.evicted, c.evicted_in_flight) == (3, 1, 1, 1, 0)
    assert b.add(m(5)) == (6, 1)  # no call in flight: an eviction is a drop at once
    assert (b.dropped, b.evicted) == (2, 2)


def test_a_failed_call_counts_its_evicted_as_dropped_and_a_byte_bound_evicts_as_before():
    one = big(1, 1000)
    one.seq = 1
    size = one.ByteSize()
    b = SeqBuffer(100, max_bytes=2 * size)
    b.add(big(1, 1000))
    b.add(big(2, 1000))
    b.begin_flight(2)
    assert b.add(big(3, 1000)) == (3, 0)  # byte bound: seq 1 evicted, in flight
    assert b.bytes == 2 * size and [x.seq for x in b.pending()] == [2, 3]
    assert b.end_flight() == 1  # the call failed: no ack covered it
    assert (b.dropped, b.evicted, b.sent, b.in_flight) == (1, 1, 0, 0)
    assert b.end_flight() == 0  # idempotent


def test_rebase_during_a_flight_counts_its_evicted_as_dropped():
    b = SeqBuffer(2)
    b.add(m())
    b.add(m())
    b.begin_flight(2)
    b.add(m())  # seq 1 evicted in flight
    assert b.rebase(50) == 53  # the estimator holds another run's seqs: 1 was not stored
    c = b.counters()
    assert (c.dropped, c.evicted_in_flight, c.sent) == (1, 0, 0) and b.in_flight == 0


@given(cap=st.integers(1, 8),
       ops=st.lists(st.one_of(st.just("add"), st.just("begin"), st.just("end"), st.integers(0, 60)), max_size=150))
def test_invariants_with_calls_in_flight(cap, ops):
    """Adds, calls started (the whole buffer handed over) and ended, acks: the bound
    holds, every number issued is exactly one of buffered, sent, dropped or evicted in
    flight, and an evicted measurement an ack covered is never counted as dropped."""
    b = SeqBuffer(cap)
    acked = 0
    flight: set[int] = set()     # seqs of the call in flight
    evicted_in_flight: set[int] = set()
    lost_expected = 0
    for op in ops:
        if op == "add":
            before = {x.seq for x in b.pending()}
            _, dropped = b.add(m())
            gone = before - {x.seq for x in b.pending()}
            assert dropped == len(gone - flight)
            evicted_in_flight |= gone & flight
            lost_expected += dropped
        elif op == "begin":
            if b.in_flight == 0 and len(b):
                flight = {x.seq for x in b.pending()}
                b.begin_flight(max(flight))
        elif op == "end":
            assert b.end_flight() == len(evicted_in_flight)
            lost_expected += len(evicted_in_flight)
            flight, evicted_in_flight = set(), set()
        else:
            acked = max(acked, min(op, b.next_seq - 1))
            b.trim(acked)
            evicted_in_flight = {s for s in evicted_in_flight if s > acked}
        c = b.counters()
        assert len(b) <= cap
        assert c.evicted_in_flight == len(evicted_in_flight)
        assert c.dropped == c.evicted == lost_expected
        assert c.buffered + c.sent + c.dropped + c.evicted_in_flight == c.next_seq - 1
