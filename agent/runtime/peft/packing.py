"""Chunk-based alignment: pack variable-length sequences into fixed-size chunks.

Contract: :func:`plan_chunks` is pure Python (no torch): it assigns sequence lengths to
chunks of ``chunk_size`` tokens, first-fit decreasing, one task per chunk (so that each
chunk row needs one LoRA adapter). :func:`pack` turns the plan into tensors:

* ``tokens`` (N, C) int64, pads are 0;
* ``targets`` (N, C) int64, the next token *within the same sequence*, ``-100`` on pads
  and on each sequence's last token (nothing follows it);
* ``positions`` (N, C) restarting at 0 for every sequence, so a packed sequence sees
  exactly the positional embeddings it would see alone;
* ``mask`` (N, C, C) bool, block-diagonal causal: row i may attend column j iff both
  belong to the same sequence and j <= i. A pad row attends only to itself (a row with
  no allowed column would make softmax produce NaN);
* ``chunk_slot`` (N,) the adapter slot of each chunk, ``token_slot`` (N, C) (-1 on pads);
* ``seg`` (N, C) the index of each token's sequence within its chunk (-1 on pads), from
  which :class:`varlen.SegmentLayout` attends sequence by sequence without the mask.

:class:`PackStats` counts real tokens, pads after packing, and the pads that padding
each task's batch to its longest sequence would have cost (what HF PEFT does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackStats:
    """Token accounting of one packed step."""

    real_tokens: int = 0
    chunks: int = 0
    chunk_size: int = 0
    pad_longest: int = 0  # pads if each task's batch were padded to its longest sequence

    @property
    def pad_chunked(self) -> int:
        return self.chunks * self.chunk_size - self.real_tokens

    @property
    def pad_removed(self) -> int:
        return self.pad_longest - self.pad_chunked

    def add(self, other: "PackStats") -> None:
        self.real_tokens += other.real_tokens
        self.chunks += other.chunks
        self.chunk_size = other.chunk_size or self.chunk_size
        self.pad_longest += other.pad_longest

    def to_dict(self) -> dict:
        return {"real_tokens": self.real_tokens, "chunks": self.chunks, "pad_chunked": self.pad_chunked,
                "pad_longest": self.pad_longest, "pad_removed": self.pad_removed}


def plan_chunks(lengths: list[int], chunk_size: int) -> list[list[int]]:
    """Indices of ``lengths`` per chunk, first-fit decreasing; every length must be <= chunk_size."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        if n > chunk_size or n < 1:
            raise ValueError(f"sequence length {n} outside 1..{chunk_size}")
        for b, room in enumerate(free):
            if room >= n:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(chunk_size - n)
    return bins


@dataclass
class Packed:
    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    chunk_slot: torch.Tensor
    token_slot: torch.Tensor
    stats: PackStats
    seg: torch.Tensor | None = None  # (N, C) sequence id within its chunk, -1 on pads


def pack(batches: list[tuple[int, list[torch.Tensor]]], chunk_size: int) -> Packed:
    """Pack ``[(slot, [seq, ...]), ...]`` (1-D int64 sequences) into chunks; see module doc."""
    rows: list[tuple[int, list[torch.Tensor]]] = []
    stats = PackStats(chunk_size=chunk_size)
    for slot, seqs in batches:
        lens = [int(s.numel()) for s in seqs]
        stats.real_tokens += sum(lens)
        stats.pad_longest += len(lens) * max(lens) - sum(lens) if lens else 0
        for idx in plan_chunks(lens, chunk_size):
            rows.append((slot, [seqs[i] for i in idx]))
    n, c = len(rows), chunk_size
    stats.chunks = n
    tokens = torch.zeros(n, c, dtype=torch.long)
    targets = torch.full((n, c), -100, dtype=torch.long)
    positions = torch.zeros(n, c, dtype=torch.long)
    seg = torch.full((n, c), -1, dtype=torch.long)
    chunk_slot = torch.empty(n, dtype=torch.long)
    for r, (slot, seqs) in enumerate(rows):
        chunk_slot[r] = slot
        off = 0
        for k, s in enumerate(seqs):
            ln = s.numel()
            tokens[r, off:off + ln] = s
            targets[r, off:off + ln - 1] = s[1:]
            positions[r, off:off + ln] = torch.arange(ln)
            seg[r, off:off + ln] = k
            off += ln
    mask = block_causal_mask(seg)
    token_slot = torch.where(seg >= 0, chunk_slot[:, None].expand(n, c), torch.full_like(seg, -1))
    return Packed(tokens, targets, positions, mask, chunk_slot, token_slot, stats, seg)


def block_causal_mask(seg: torch.Tensor) -> torch.Tensor:
    """(N, C, C) bool from segment ids (N, C) (-1 = pad); see module doc."""
    c = seg.shape[1]
    causal = torch.ones(c, c, dtype=torch.bool).tril()
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    eye = torch.eye(c, dtype=torch.bool)
    pad_row = (seg < 0)[:, :, None] & eye
    return (same & causal) | pad_row
