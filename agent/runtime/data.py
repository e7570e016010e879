"""Token sources for the GPT workload.

Contract: ``source.batch(step, batch_size, seq_len) -> (inputs, targets)``, both int64
of shape (batch_size, seq_len), ``targets`` being ``inputs`` shifted by one token. The
batch is a pure function of (seed, step, batch_size, seq_len): no hidden cursor, so a
resumed job or a job under another parallel plan sees exactly the same data order, and
every rank can draw the global batch and keep only its rows.

Kinds:
- ``synthetic``: a fixed random Markov chain over the vocabulary (each token has
  ``branching`` equally likely successors). It is learnable by a tiny model within a
  hundred steps (loss falls from ln(vocab) towards ln(branching)).
- ``file``: a local UTF-8 text file (bytes are tokens, vocab 256) or a JSONL file whose
  lines are objects with a ``"text"`` field (texts joined by newlines).
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Protocol

import numpy as np
import torch

from tessera.errors import SpecError

_GOLDEN = 0x9E3779B97F4A7C15  # decorrelates (seed, step) pairs before seeding a generator


def step_generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    """A CPU generator seeded from (seed, step, stream) only."""
    g = torch.Generator()
    g.manual_seed((seed * _GOLDEN + step * 1_000_003 + stream * 7919 + 1) % (2**63 - 1))
    return g


class TokenSource(Protocol):
    def batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class SyntheticSource:
    """Seeded Markov chain with ``branching`` successors per token."""

    def __init__(self, vocab: int, seed: int, branching: int = 4) -> None:
        if vocab < 2:
            raise ValueError("vocab must be >= 2")
        self.vocab = vocab
        self.seed = seed
        self.branching = min(branching, vocab)
        g = step_generator(seed, -1, stream=1)  # the chain depends on the seed only
        self.successors = torch.stack([torch.randperm(vocab, generator=g)[: self.branching] for _ in range(vocab)])
        self._succ = self.successors.numpy()

    def batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = step_generator(self.seed, step)
        first = torch.randint(self.vocab, (batch_size,), generator=g)
        choice = torch.randint(self.branching, (batch_size, seq_len), generator=g).numpy()
        # The chain walks position by position; numpy's indexing costs ~3 us a position
        # where torch's cost ~13 (0.85 -> 0.21 ms for 16 x 64 tokens): the tokens of
        # walk_reference, exactly.
        succ = self._succ
        toks = np.empty((batch_size, seq_len + 1), dtype=np.int64)
        toks[:, 0] = first.numpy()
        for t in range(seq_len):
            toks[:, t + 1] = succ[toks[:, t], choice[:, t]]
        out = torch.from_numpy(toks)
        return out[:, :-1].contiguous(), out[:, 1:].contiguous()


def walk_reference(src: SyntheticSource, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of :class:`SyntheticSource`'s token order: the chain walked with
    torch indexing, as ``batch`` did until 2026-12-06 (~4x slower). ``batch`` must return
    exactly these tokens (tests), so that a resumed job sees the same data whatever the
    version that wrote its checkpoint."""
    g = step_generator(src.seed, step)
    toks = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(src.vocab, (batch_size,), generator=g)
    choice = torch.randint(src.branching, (batch_size, seq_len), generator=g)
    for t in range(seq_len):
        toks[:, t + 1] = src.successors[toks[:, t], choice[:, t]]
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


class FileSource:
    """Random windows of a byte-token corpus; window offsets drawn from (seed, step)."""

    def __init__(self, tokens: torch.Tensor, seed: int) -> None:
        if tokens.numel() == 0:
            raise ValueError("empty corpus")
        self.tokens = tokens.long()
        self.seed = seed

    def batch(self, step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        toks = self.tokens
        if toks.numel() < seq_len + 2:
            # A short corpus is repeated so that every window has seq_len + 1 tokens.
            toks = toks.repeat((seq_len + 2) // toks.numel() + 1)
        g = step_generator(self.seed, step)
        starts = torch.randint(toks.numel() - seq_len - 1 + 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        win = toks[idx]
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()


def read_corpus(path: str) -> bytes:
    """Bytes of a .txt file, or the ``text`` fields of a .jsonl file joined by newlines.
    A leading UTF-8 byte order mark (as many editors write it) is not content: it is
    skipped in both (as the peft datasets do)."""
    if path.endswith(".jsonl"):
        texts = []
        with open(path, encoding="utf-8-sig") as f:  # a leading BOM is not content
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                obj = json.loads(line)
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise ValueError(f"{path}:{n}: expected an object with a string 'text' field")
                texts.append(obj["text"])
        return "\n".join(texts).encode("utf-8")
    with open(path, "rb") as f:
        raw = f.read()
    return raw[len(codecs.BOM_UTF8):] if raw.startswith(codecs.BOM_UTF8) else raw


def make_source(data: dict | None, vocab: int, seed: int) -> TokenSource:
    """Build the source a ``workload.data`` section names; SpecError on a bad section."""
    data = data or {"kind": "synthetic"}
    kind = data.get("kind", "synthetic")
    if kind == "synthetic":
        branching = data.get("branching", 4)
        if isinstance(branching, bool) or not isinstance(branching, int) or branching < 1:
            raise SpecError("workload.data.branching", f"must be an integer >= 1, got {branching!r}")
        return SyntheticSource(vocab, seed, branching=branching)
    if kind == "file":
        path = data.get("path")
        if not isinstance(path, str) or not os.path.isabs(path):
            raise SpecError("workload.data.path", "must be an absolute path")
        if vocab < 256:
            raise SpecError("workload.model.vocab", "byte-level file data needs vocab >= 256")
        try:
            raw = read_corpus(path)
        except (OSError, ValueError) as e:
            raise SpecError("workload.data.path", str(e)) from e
        if not raw:
            raise SpecError("workload.data.path", "corpus is empty")
        return FileSource(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone(), seed)
    raise SpecError("workload.data.kind", f"unknown data kind {kind!r} (synthetic | file)")
