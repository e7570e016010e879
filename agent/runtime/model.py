"""GPT-style decoder used by every workload of the executor runtime.

Contract: ``GPT(cfg)(tokens) -> logits`` with ``tokens`` int64 of shape (B, T),
``T <= cfg.seq_len``; logits float of shape (B, T, vocab). The model is split into
``embed`` / ``blocks`` / ``ln_f`` + ``head`` so that pipeline and tensor parallelism
can take it apart without re-implementing it. Pure torch; no I/O.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a decoder. All fields are positive; ``hidden % heads == 0``."""

    vocab: int = 256
    seq_len: int = 64
    layers: int = 2
    hidden: int = 64
    heads: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "layers", "hidden", "heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"model.hidden ({self.hidden}) must be divisible by model.heads ({self.heads})")

    def to_dict(self) -> dict:
        return asdict(self)

    def num_params(self) -> int:
        """Parameter count of the full model (embeddings tied to nothing)."""
        h, v, t, n = self.hidden, self.vocab, self.seq_len, self.layers
        block = 4 * h * h + 4 * h + 2 * (4 * h * h) + 4 * h + h + 4 * h  # attn + mlp + norms
        return v * h + t * h + n * block + 2 * h + h * v + v


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor, attn_mask=None) -> torch.Tensor:
        """``attn_mask``: None (causal), a bool (B, T, T) mask (True = may attend), or a
        layout object with ``attend(qkv, heads) -> (B, T, C)`` (packed sequences attended
        one by one, e.g. :class:`agent.runtime.peft.varlen.SegmentLayout`)."""
        b, t, c = x.shape
        if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
            return self.proj(attn_mask.attend(self.qkv(x), self.heads))
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # attn_mask: bool (B, T, T), True where attention is allowed.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None, :, :])
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.out = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attn_mask)
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class GPT(nn.Module):
    """Decoder-only transformer; deterministic init from ``torch.manual_seed``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(
        self,
        tokens: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(tokens, positions)
        for blk in self.blocks:
            x = blk(x, attn_mask)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose target != ignore_index."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


def flops_per_token(cfg: GPTConfig) -> float:
    """Approximate training FLOPs per token (6 N + attention), for the estimator."""
    n = cfg.layers * 12 * cfg.hidden * cfg.hidden
    return 6.0 * n + 12.0 * cfg.layers * cfg.hidden * cfg.seq_len + 6.0 * cfg.hidden * cfg.vocab
