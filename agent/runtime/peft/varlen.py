"""Attention over packed chunks, one sequence at a time, without a (N, C, C) mask.

Contract: :class:`SegmentLayout` is built (on the host, once per micro-batch) from the
segment ids of packed chunks (N, W) (``-1`` on pads; a sequence is a run of one id in
one row, see :mod:`packing`). ``layout.attend(qkv, heads)`` takes the fused q/k/v
projection (N, W, 3C) of those chunks and returns the attention output (N, W, C) in
which every token attends causally to the earlier tokens of ITS OWN sequence only —
exactly what the block-diagonal causal mask of :func:`packing.block_causal_mask` gives
for real tokens. Pad positions get zeros (nothing reads them: no real token attends to
a pad, and pads carry no target). Autograd flows through it like through the masked
``scaled_dot_product_attention``.

How: sequences are sorted by length and grouped into a few buckets of similar length;
each bucket is gathered into a dense (n, H, L, D) batch and runs the causal kernel
(``is_causal=True``, which skips the masked-out upper triangle), and the results are
scattered back. Compared with one masked attention over the whole chunk, the work is
sum over buckets of n * L^2 / 2 instead of N * W^2 (no block skipping with a mask), and
no mask is built or converted per layer. A bucket opens when a sequence is shorter than
``ratio`` x its longest one, so no sequence is padded by more than 1/ratio.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SegmentLayout:
    """Bucketed gather/scatter indices of the sequences in packed chunks; see module doc."""

    def __init__(self, seg: torch.Tensor, device: torch.device | str = "cpu", ratio: float = 0.7) -> None:
        if seg.dim() != 2:
            raise ValueError(f"seg must be (N, W), got shape {tuple(seg.shape)}")
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        n, w = seg.shape
        self.shape = (n, w)
        ids = seg.tolist()
        runs: list[tuple[int, int]] = []  # (flat start, length)
        for r, row in enumerate(ids):
            j = 0
            while j < w:
                s = row[j]
                if s < 0:
                    j += 1
                    continue
                k = j + 1
                while k < w and row[k] == s:
                    k += 1
                runs.append((r * w + j, k - j))
                j = k
        runs.sort(key=lambda x: -x[1])
        self.lengths = [ln for _, ln in runs]
        buckets: list[list[tuple[int, int]]] = []
        for run in runs:
            if buckets and run[1] >= ratio * buckets[-1][0][1]:
                buckets[-1].append(run)
            else:
                buckets.append([run])
        self.buckets: list[tuple[torch.Tensor, int, int]] = []  # (gather index, n, L)
        src, dst = [], []
        base = 0
        for b in buckets:
            L = b[0][1]
            gather = []
            for i, (start, ln) in enumerate(b):
                # Past a sequence's end, gather its first token again: those rows and
                # columns are pads that a real (earlier) query never sees under causality.
                gather += [start + j if j < ln else start for j in range(L)]
                src += range(base + i * L, base + i * L + ln)
                dst += range(start, start + ln)
            self.buckets.append((torch.tensor(gather, dtype=torch.long, device=device), len(b), L))
            base += len(b) * L
        self.src = torch.tensor(src, dtype=torch.long, device=device)
        self.dst = torch.tensor(dst, dtype=torch.long, device=device)

    def attend(self, qkv: torch.Tensor, heads: int) -> torch.Tensor:
        """(N, W, 3C) fused projections -> (N, W, C) per-sequence causal attention."""
        n, w, c3 = qkv.shape
        if (n, w) != self.shape:
            raise ValueError(f"qkv is for chunks {(n, w)}, layout for {self.shape}")
        c = c3 // 3
        d = c // heads
        flat = qkv.reshape(n * w, 3, heads, d)
        ys = []
        for gather, nb, L in self.buckets:
            g = flat.index_select(0, gather).view(nb, L, 3, heads, d).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(g[0], g[1], g[2], is_causal=True)  # (nb, H, L, D)
            ys.append(y.transpose(1, 2).reshape(nb * L, c))
        out = qkv.new_zeros(n * w, c)
        if ys:
            out = out.index_copy(0, self.dst, torch.cat(ys).index_select(0, self.src))
        return out.view(n, w, c)
