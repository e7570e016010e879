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
        self.refused = 0   # of ``dropped``: discarded because the estimator refused them
        self.oversized = 0  # refused by ``add`` (over ``max_bytes`` alone): never numbered, never buffered
        self._items: deque[profiler_pb2.Measurement] = deque()
        self._sizes: deque[int] = deque()  # serialized size of each item on entry, in step with _items
        self.bytes = 0                     # sum of _sizes

    def __len__(self) -> int:
        return len(self._items)

    def add(self, m: profiler_pb2.Measurement) -> tuple[int, int]:
        """Number ``m`` (sets ``m.seq`` in place), append it, then drop the oldest while
        either bound is exceeded. Returns (seq, how many were dropped). A measurement that
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
            self._popleft()
            self.dropped += 1
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
        returns how many, which are counted as sent."""
        n = 0
        while self._items and self._items[0].seq <= watermark:
            self._popleft()
            n += 1
        self.sent += n
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
        Returns the new next_seq; no-op when ``watermark < next_seq``."""
        if watermark < self.next_seq:
            return self.next_seq
        seq = watermark + 1
        for m in self._items:
            m.seq = seq
            seq += 1
        self.next_seq = seq
        return seq

    def counters(self) -> Counters:
        return Counters(buffered=len(self._items), sent=self.sent, dropped=self.dropped, next_seq=self.next_seq,
                        buffered_bytes=self.bytes, oversized=self.oversized)
