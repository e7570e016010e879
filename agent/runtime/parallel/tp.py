"""Megatron-style tensor parallelism for the GPT blocks of ``agent.runtime.model``.

Attention: ``qkv`` is column-parallel by heads (shard r holds heads
[r*H/tp, (r+1)*H/tp) of q, k and v), ``proj`` is row-parallel (its input columns of the
same heads), followed by one all-reduce. MLP: ``fc`` column-parallel, ``out``
row-parallel, one all-reduce. Embeddings, layer norms, the head and the biases of
row-parallel layers are replicated; their gradients come out identical on every shard
because the input of each parallel region is summed in backward (``copy_to_tp``).

Parameters keep the names of the full :class:`GPT`, so :func:`shard` /
:func:`unshard` map between the full (checkpoint) form and a shard by name alone.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from agent.runtime.model import GPTConfig
from agent.runtime.parallel.comm import copy_to_tp, reduce_from_tp

# How each full parameter is cut: "qkv" = dim 0 viewed as (3, hidden), "col" = dim 0,
# "row" = dim 1, None = replicated.
_RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r"blocks\.\d+\.attn\.qkv\.(weight|bias)$"), "qkv"),
    (re.compile(r"blocks\.\d+\.attn\.proj\.weight$"), "row"),
    (re.compile(r"blocks\.\d+\.mlp\.fc\.(weight|bias)$"), "col"),
    (re.compile(r"blocks\.\d+\.mlp\.out\.weight$"), "row"),
]


def rule(name: str) -> str | None:
    """Sharding rule of a full-model parameter name (None: replicated)."""
    for pat, kind in _RULES:
        if pat.search(name):
            return kind
    return None


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The part of full tensor ``name`` that tensor-parallel shard ``rank`` of ``size`` holds."""
    kind = rule(name)
    if size == 1 or kind is None:
        return full.clone()
    if kind == "qkv":
        three = full.view(3, full.shape[0] // 3, *full.shape[1:])
        return three.chunk(size, dim=1)[rank].reshape(-1, *full.shape[1:]).clone()
    dim = 0 if kind == "col" else 1
    return full.chunk(size, dim=dim)[rank].clone()


def unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`shard`: the full tensor from the pieces of shards 0..size-1."""
    kind = rule(name)
    if len(pieces) == 1 or kind is None:
        return pieces[0].clone()
    if kind == "qkv":
        threes = [p.view(3, p.shape[0] // 3, *p.shape[1:]) for p in pieces]
        cat = torch.cat(threes, dim=1)
        return cat.reshape(-1, *cat.shape[2:]).clone()
    return torch.cat(pieces, dim=0 if kind == "col" else 1)


class RowParallelLinear(nn.Module):
    """``y = allreduce(x_shard @ W_shard^T) + b``; bias replicated and added once."""

    def __init__(self, in_shard: int, out_features: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_shard))
        self.bias = nn.Parameter(torch.zeros(out_features))
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.group) + self.bias


class TPAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: int, group) -> None:
        super().__init__()
        self.local_heads = cfg.heads // tp
        self.local_hidden = cfg.hidden // tp
        self.group = group
        self.qkv = nn.Linear(cfg.hidden, 3 * self.local_hidden)
        self.proj = RowParallelLinear(self.local_hidden, cfg.hidden, group)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        x = copy_to_tp(x, self.group)
        hd = self.local_hidden // self.local_heads
        q, k, v = self.qkv(x).split(self.local_hidden, dim=2)
        q = q.view(b, t, self.local_heads, hd).transpose(1, 2)
        k = k.view(b, t, self.local_heads, hd).transpose(1, 2)
        v = v.view(b, t, self.local_heads, hd).transpose(1, 2)
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None, :, :])
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, self.local_hidden))


class TPMLP(nn.Module):
    def __init__(self, cfg: GPTConfig, tp: int, group) -> None:
        super().__init__()
        self.group = group
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden // tp)
        self.out = RowParallelLinear(4 * cfg.hidden // tp, cfg.hidden, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(copy_to_tp(x, self.group))))


class TPBlock(nn.Module):
    """Same computation and parameter names as ``model.Block``, sharded ``tp`` ways."""

    def __init__(self, cfg: GPTConfig, tp: int, group) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = TPAttention(cfg, tp, group)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = TPMLP(cfg, tp, group)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attn_mask)
        return x + self.mlp(self.ln2(x))
