"""Per-task datasets of the ``peft`` workload.

Contract: every dataset has ``batch(step, batch_size) -> list[LongTensor]`` (1-D token
sequences, each of length in ``[min_len, max_len]``) that is a pure function of the
dataset's seed and ``step``: a resumed or re-added task sees the same data, and the
benchmark feeds HF PEFT exactly the sequences Tessera trains on.

* :class:`SyntheticTask`: a learnable task: tokens from a small task-specific subset of
  the vocabulary following a task-specific successor map (with noise). Lengths are
  ``uniform`` in ``[min_len, max_len]`` or ``longtail`` (most short, a few long, like
  instruction-tuning corpora).
* :class:`FileTask`: local UTF-8 text (one sample per non-empty line) or JSONL (one object
  per line, text under ``field``); a leading byte-order mark is skipped, not content; UTF-8
  bytes modulo ``vocab`` are the tokens; samples are truncated to ``max_len``, shorter
  than ``min_len`` dropped.
"""

from __future__ import annotations

import json

import torch


def _lengths(g: torch.Generator, n: int, lo: int, hi: int, distribution: str) -> list[int]:
    u = torch.rand(n, generator=g, dtype=torch.float64)
    if distribution == "longtail":
        # u^4: mean length ~ lo + (hi-lo)/5 while the longest of a batch is often near hi,
        # which is what makes padding to the longest expensive on real data.
        u = u ** 4
    return [lo + int(x) for x in (u * (hi - lo + 1)).floor().clamp(max=hi - lo).tolist()]


class SyntheticTask:
    """Seeded learnable token task; see module doc."""

    SUBSET = 32

    def __init__(self, seed: int, vocab: int, min_len: int, max_len: int, distribution: str = "uniform",
                 noise: float = 0.1) -> None:
        if not 2 <= min_len <= max_len:
            raise ValueError(f"need 2 <= min_len <= max_len, got {min_len}, {max_len}")
        self.seed, self.vocab, self.min_len, self.max_len = seed, vocab, min_len, max_len
        self.distribution, self.noise = distribution, noise
        g = torch.Generator().manual_seed(seed)
        k = min(self.SUBSET, vocab)
        self.subset = torch.randperm(vocab, generator=g)[:k]
        self.succ = torch.randperm(k, generator=g)  # successor of subset index i is succ[i]

    def batch(self, step: int, batch_size: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        out = []
        for ln in _lengths(g, batch_size, self.min_len, self.max_len, self.distribution):
            flips = (torch.rand(ln, generator=g) < self.noise).tolist()
            rnd = torch.randint(len(self.subset), (ln,), generator=g).tolist()
            succ = self.succ.tolist()
            idx = [rnd[0]]  # plain ints: a per-token tensor loop would dominate small steps
            for t in range(1, ln):
                idx.append(rnd[t] if flips[t] else succ[idx[-1]])
            out.append(self.subset[torch.tensor(idx)])
        return out


class FileTask:
    """Samples from a local text or JSONL file; see module doc."""

    def __init__(self, path: str, kind: str, vocab: int, min_len: int, max_len: int, seed: int,
                 field: str | None = "text") -> None:
        self.samples: list[torch.Tensor] = []
        with open(path, encoding="utf-8-sig") as f:  # a leading BOM is not content
            for n, line in enumerate(f, 1):
                line = line.rstrip("\n")
                if not line.strip():
                    continue
                if kind == "jsonl":
                    try:
                        text = json.loads(line)[field]
                    except (json.JSONDecodeError, KeyError, TypeError) as e:
                        raise ValueError(f"{path}:{n}: not a JSON object with a {field!r} string ({e})") from e
                    if not isinstance(text, str):
                        raise ValueError(f"{path}:{n}: {field!r} is not a string")
                else:
                    text = line
                toks = torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % vocab
                if toks.numel() >= min_len:
                    self.samples.append(toks[:max_len])
        if not self.samples:
            raise ValueError(f"{path}: no sample with at least {min_len} tokens")
        self.seed = seed

    def batch(self, step: int, batch_size: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + 1)
        idx = torch.randint(len(self.samples), (batch_size,), generator=g).tolist()
        return [self.samples[i] for i in idx]


def make_dataset(ds: dict, vocab: int, max_len: int, seed: int):
    """Dataset of a validated task ``dataset`` section (``max_len``/``seed`` resolved by the caller)."""
    if ds["kind"] == "synthetic":
        return SyntheticTask(seed, vocab, ds["min_len"], max_len, ds["distribution"])
    return FileTask(ds["path"], ds["kind"], vocab, ds["min_len"], max_len, seed, ds.get("field"))
