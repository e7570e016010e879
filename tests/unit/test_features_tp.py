"""The tensor-parallel share of a block's element-wise traffic (features.TP_SHARDED_ELEMS)
matches what the runtime's sharded block actually runs, counted op by op."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from agent.runtime.model import Block, GPTConfig
from agent.runtime.parallel.tp import TPBlock
from tessera.perfmodel import features as F

# Matmuls and attention are the flops feature; views move no bytes.
NOT_ELEMENTWISE = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu",
                   "_scaled_dot_product_flash_attention_for_cpu_backward", "view", "_unsafe_view", "t",
                   "transpose", "expand", "split", "split_with_sizes", "detach", "alias", "unsqueeze",
                   "squeeze", "permute", "slice", "select", "as_strided", "_reshape_alias"}


class _Traffic(TorchDispatchMode):
    """Elements read (tensors over 1000 elements) and written by element-wise ops."""

    def __init__(self):
        super().__init__()
        self.elems = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] not in NOT_ELEMENTWISE:
            outs = out if isinstance(out, (tuple, list)) else [out]
            flat = [a for a in args if isinstance(a, torch.Tensor)]
            flat += [x for a in args if isinstance(a, (list, tuple)) for x in a if isinstance(x, torch.Tensor)]
            self.elems += sum(o.numel() for o in outs if isinstance(o, torch.Tensor))
            self.elems += sum(t.numel() for t in flat if t.numel() > 1000)
        return out


def _block_traffic(cfg: GPTConfig, tp: int) -> int:
    torch.manual_seed(0)
    block = Block(cfg) if tp == 1 else TPBlock(cfg, tp, None)  # group None: a shard's own work
    x = torch.randn(4, cfg.seq_len, cfg.hidden, requires_grad=True)
    with _Traffic() as t:
        block(x).sum().backward()
    return t.elems


def test_tp_shard_of_elementwise_traffic_matches_the_runtime_block():
    for hidden in (64, 128):
        cfg = GPTConfig(vocab=64, seq_len=32, layers=1, hidden=hidden, heads=4)
        measured = _block_traffic(cfg, 2) / _block_traffic(cfg, 1)
        f = F.TP_SHARDED_ELEMS
        assert abs(((1 - f) + f / 2) - measured) < 0.02, (hidden, measured)


def test_features_unchanged_at_tp1_and_sharded_at_tp2():
    one = F.mb_features(8, 64, 2, 64, 4, 256, 1, 1, tp=1)
    two = F.mb_features(8, 64, 2, 64, 4, 256, 1, 1, tp=2)
    tok = 8 * 64
    a = F.ATTN_SCORE_ELEMS
    assert one["elems"] == tok * (2 * (20.0 * 64 + a * 4 * 64) + 3.0 * 256 + 2.0 * 64)
    saved = tok * 2 * 20.0 * 64 * F.TP_SHARDED_ELEMS / 2 + tok * 2 * a * 4 * 64 / 2
    copies = tok * 2 * F.TP_COPY_ELEMS * 64
    assert abs((one["elems"] - two["elems"]) - (saved - copies)) < 1e-6


def test_tp_copies_of_what_a_block_all_reduces_match_the_runtime_block():
    """In a real tensor-parallel group the block copies every activation it all-reduces
    (forward) and every gradient (backward); with the all-reduce itself made the
    identity (the sum of one shard), the extra element traffic over the shard's own work
    is TP_COPY_ELEMS per token and hidden unit."""
    from agent.runtime.parallel import comm

    orig = comm.all_reduce
    comm.all_reduce = lambda t, group=None: t  # the autograd functions look it up at call time
    try:
        for hidden in (64, 128):
            cfg = GPTConfig(vocab=64, seq_len=32, layers=1, hidden=hidden, heads=4)
            counts = []
            for group in (None, object()):  # None: no copies; any other group: the runtime's path
                torch.manual_seed(0)
                block = TPBlock(cfg, 2, group)
                x = torch.randn(4, cfg.seq_len, hidden, requires_grad=True)  # fresh: no gradient to accumulate into
                with _Traffic() as t:
                    block(x).sum().backward()
                counts.append(t.elems)
            per = (counts[1] - counts[0]) / (x.shape[0] * cfg.seq_len * hidden)
            assert per == F.TP_COPY_ELEMS, (hidden, per)
    finally:
        comm.all_reduce = orig
