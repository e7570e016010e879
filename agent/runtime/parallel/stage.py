"""The part of a GPT that one rank holds: a pipeline stage, sharded for tensor parallelism.

Contract: ``StageModule(cfg, layers, first, last, tp, tp_rank, group)`` has exactly
the parameter names of the full :class:`~agent.runtime.model.GPT` for the pieces it
holds (``embed.*`` on the first stage, ``blocks.<global index>.*`` for its layers,
``ln_f.*`` and ``head.*`` on the last stage), with tensor-parallel shapes when tp > 1.
``forward`` maps tokens (first stage) or hidden states (others) to hidden states
(not last) or logits (last). With one stage and tp=1 it computes exactly ``GPT``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from agent.runtime.model import Block, Embedding, GPTConfig
from agent.runtime.parallel import tp as tpmod


class StageModule(nn.Module):
    def __init__(
        self,
        cfg: GPTConfig,
        layers: range,
        first: bool,
        last: bool,
        tp: int = 1,
        tp_rank: int = 0,
        tp_group=None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.first, self.last = first, last
        self.tp, self.tp_rank = tp, tp_rank
        if first:
            self.embed = Embedding(cfg)
        # ModuleDict keyed by the global block index keeps the full model's names.
        self.blocks = nn.ModuleDict(
            {str(i): (Block(cfg) if tp == 1 else tpmod.TPBlock(cfg, tp, tp_group)) for i in layers}
        )
        if last:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        for blk in self.blocks.values():
            x = blk(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x

    @torch.no_grad()
    def load_full(self, full: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shards out of a full-model state dict (KeyError if one is missing)."""
        for name, p in self.named_parameters():
            p.copy_(tpmod.shard(name, full[name], self.tp_rank, self.tp))

    def local_pieces(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by full name (shards when tp > 1), detached copies."""
        return {n: p.detach().cpu().clone() for n, p in self.named_parameters()}


def merge_pieces(per_tp: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from the pieces of tensor-parallel shards 0..tp-1 of one stage."""
    return {name: tpmod.unshard(name, [d[name] for d in per_tp]) for name in per_tp[0]}
