"""The bounded, sequence-numbered buffer between producers (samplers, ReportStep) and
the stream to the estimator (pure: no I/O, no clock).

Measurements get seq numbers 1, 2, 3, ... (per source) on entry. They stay until the
estimator's watermark (highest persisted seq) covers them. The buffer is bounded twice:
by count (``capacity`` measurements) and by size (``max_bytes``, the sum of their
serialized sizes, as measured on entry). When either bound is exceeded the oldest are
dropped and counted until both hold again, so an outage during which fewer than
``capacity`` measurements of at most ``max_bytes`` in all are produced loses nothing.
A single measurement larger than ``max_bytes`` (with its seq) cannot be kept: ``add``
refuses it (``MeasurementTooLarge``, counted in ``oversized``), takes no number for it
and evicts nothing for it.

In flight: the stream hands the head of the buffer to a ReportMeasurements call
(``begin_flight(last_seq)``) and the measurements stay buffered until the ack's watermark
trims them. One evicted meanwhile (seq <= ``in_flight``) may still be stored by the
estimator, so it is not counted yet: the ack decides (``trim``: covered, it counts as
sent); whatever of them the ack does not cover is counted as dropped when the call ends
(``end_flight``; also when the call failed: whether the estimator stored them is then
unknown, so a lost acknowledgement can count a stored one as dropped). The bounds are not
affected: eviction happens the same way, only its accounting waits for the ack.

Accounting: every number issued is exactly one of buffered, sent, dropped or
``evicted_in_flight`` (awaiting its call's ack). ``dropped`` counts ``evicted`` (lost to a
full buffer) and ``refused`` (``discard``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tessera.api.v1 import profiler_pb2


class MeasurementTooLarge(ValueError):
    """A measurement larger (serialized, with its seq) than the buffer's ``max_bytes``."""

    def __init__(self, size: int, max_bytes: int) -> None:
        super().__init__(f"measurement: at most {max_bytes} bytes serialized, got {size}")
        self.size, self.max_bytes = size, max_bytes


@dataclass
class Counters:
    buffered: int
    sent: int
    dropped: int
    next_seq: int
    buffered_bytes: int = 0
    oversized: int = 0
    evicted: int = 0            # of dropped: lost to a full buffer (either bound)
    evicted_in_flight: int = 0  # evicted during a call that carried them: sent or dropped once it ends


class SeqBuffer:
    def __init__(self, capacity: int, next_seq: int = 1, max_bytes: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if next_seq < 1:
            raise ValueError(f"next_seq must be >= 1, got {next_seq}")
        self.capacity = capacity
        self.max_bytes = max_bytes  # None: bounded by count only
        self.next_seq = next_seq
        self.sent = 0      # acknowledged by the estimator (trimmed by a watermark)
        self.dropped = 0   # lost: to a full buffer, or refused by the estimator (``discard``)
        self.evicted = 0   # of ``dropped``: evicted by a bound and not acknowledged
        self.refused = 0   # of ``dropped``: discarded because the estimator refused them
        self.in_flight = 0  # highest seq handed to the call in flight (``begin_flight``); 0: none
        self._evicted_in_flight: deque[int] = deque()  # their seqs, increasing: the ack decides
        self.oversized = 0  # refused by ``add`` (over ``max_bytes`` alone): never numbered, never buffered
        self._items: deque[profiler_pb2.Measurement] = deque()
        self._sizes: deque[int] = deque()  # serialized size of each item on entry, in step with _items
        self.bytes = 0                     # sum of _sizes

    def __len__(self) -> int:
        return len(self._items)

    def add(self, m: profiler_pb2.Measurement) -> tuple[int, int]:
        """Number ``m`` (sets ``m.seq`` in place), append it, then evict the oldest while
        either bound is exceeded. Returns (seq, how many were counted as dropped): an
        evicted measurement that is in flight (seq <= ``in_flight``) is not counted yet
        (see the module docstring). A measurement that
        alone is over ``max_bytes`` raises ``MeasurementTooLarge`` instead: nothing is
        evicted for it, no number is used (``m.seq`` left 0), ``oversized`` counts it."""
        m.seq = self.next_seq
        size = m.ByteSize()
        if self.max_bytes is not None and size > self.max_bytes:
            m.seq = 0
            self.oversized += 1
            raise MeasurementTooLarge(size, self.max_bytes)
        self.next_seq += 1
        self._items.append(m)
        self._sizes.append(size)
        self.bytes += size
        dropped = 0
        while self._items and (len(self._items) > self.capacity
                               or (self.max_bytes is not None and self.bytes > self.max_bytes)):
            old = self._popleft()
            if old.seq <= self.in_flight:  # the estimator may be storing it right now
                self._evicted_in_flight.append(old.seq)
            else:
                self.dropped += 1
                self.evicted += 1
                dropped += 1
        return m.seq, dropped

    def _popleft(self) -> profiler_pb2.Measurement:
        self.bytes -= self._sizes.popleft()
        return self._items.popleft()

    def pending(self, after: int = 0, limit: int | None = None) -> list[profiler_pb2.Measurement]:
        """Buffered measurements with seq > ``after``, oldest first, at most ``limit``."""
        out = []
        for m in self._items:  # seqs are increasing: skip the head, stop at the limit
            if m.seq <= after:
                continue
            if limit is not None and len(out) >= limit:
                break
            out.append(m)
        return out

    def trim(self, watermark: int) -> int:
        """Remove every measurement with seq <= ``watermark`` (persisted by the estimator);
        returns how many, which are counted as sent, with those evicted while in flight
        that it covers."""
        n = 0
        while self._items and self._items[0].seq <= watermark:
            self._popleft()
            n += 1
        while self._evicted_in_flight and self._evicted_in_flight[0] <= watermark:
            self._evicted_in_flight.popleft()
            n += 1
        self.sent += n
        return n

    def begin_flight(self, last_seq: int) -> None:
        """A call to the estimator now carries the buffered measurements up to ``last_seq``
        (the head of the buffer): evicting one of them is not a drop unless its ack does
        not cover it. Pair with ``end_flight``."""
        self.in_flight = max(self.in_flight, last_seq)

    def end_flight(self) -> int:
        """The call is over (its ack applied with ``trim``, or it failed): those evicted
        during it that no ack covered are counted as dropped (``evicted``). Returns how
        many. Idempotent."""
        n = len(self._evicted_in_flight)
        self._evicted_in_flight.clear()
        self.in_flight = 0
        self.dropped += n
        self.evicted += n
        return n

    def discard(self, seq: int) -> profiler_pb2.Measurement | None:
        """Remove the measurement numbered ``seq`` (one the estimator refuses: resending it
        would fail every call) and count it as dropped and refused; returns it, or None
        when it is no longer buffered. Its number stays unused: a gap the estimator accepts."""
        for j, m in enumerate(self._items):
            if m.seq == seq:
                del self._items[j]
                self.bytes -= self._sizes[j]
                del self._sizes[j]
                self.dropped += 1
                self.refused += 1
                return m
            if m.seq > seq:
                break
        return None

    def rebase(self, watermark: int) -> int:
        """The estimator has persisted seqs we never issued (our seq state was lost):
        renumber the buffer from ``watermark + 1`` so nothing is taken for a duplicate.
        Returns the new next_seq; no-op when ``watermark < next_seq``. Measurements
        evicted in flight are counted as dropped (``end_flight``): under the old numbers the
        estimator holds another run's measurements, not theirs."""
        if watermark < self.next_seq:
            return self.next_seq
        self.end_flight()
        seq = watermark + 1
        for m in self._items:
            m.seq = seq
            seq += 1
        self.next_seq = seq
        return seq

    def counters(self) -> Counters:
        return Counters(buffered=len(self._items), sent=self.sent, dropped=self.dropped, next_seq=self.next_seq,
                        buffered_bytes=self.bytes, oversized=self.oversized, evicted=self.evicted,
                        evicted_in_flight=len(self._evicted_in_flight))
