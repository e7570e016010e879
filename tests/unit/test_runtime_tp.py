"""Tensor-parallel shard rules and the stage module, single process (no comm)."""

from __future__ import annotations

import pytest
import torch

from agent.runtime.model import GPT, GPTConfig
from agent.runtime.parallel import tp as tpmod
from agent.runtime.parallel.stage import StageModule, merge_pieces

CFG = GPTConfig(vocab=32, seq_len=8, layers=2, hidden=16, heads=4)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_unshard_roundtrip_every_param(size):
    torch.manual_seed(0)
    full = GPT(CFG).state_dict()
    for name, t in full.items():
        pieces = [tpmod.shard(name, t, r, size) for r in range(size)]
        assert torch.equal(tpmod.unshard(name, pieces), t), name
        if tpmod.rule(name) is not None and size > 1:
            assert pieces[0].numel() * size == t.numel()


def test_qkv_shard_takes_the_same_heads_of_q_k_and_v():
    h = CFG.hidden
    w = torch.arange(3 * h, dtype=torch.float32)[:, None].repeat(1, h)
    s1 = tpmod.shard("blocks.0.attn.qkv.weight", w, 1, 2)[:, 0]
    half = h // 2
    expect = torch.cat([torch.arange(half, h), torch.arange(h + half, 2 * h), torch.arange(2 * h + half, 3 * h)]).float()
    assert torch.equal(s1, expect)


def test_full_stage_equals_gpt_and_stages_compose():
    torch.manual_seed(0)
    gpt = GPT(CFG)
    sd = gpt.state_dict()
    tokens = torch.randint(CFG.vocab, (2, CFG.seq_len))
    whole = StageModule(CFG, range(2), first=True, last=True)
    whole.load_full(sd)
    assert set(dict(whole.named_parameters())) == set(dict(gpt.named_parameters()))
    assert torch.equal(whole(tokens), gpt(tokens))
    s0 = StageModule(CFG, range(0, 1), first=True, last=False)
    s1 = StageModule(CFG, range(1, 2), first=False, last=True)
    s0.load_full(sd)
    s1.load_full(sd)
    assert torch.allclose(s1(s0(tokens)), gpt(tokens), atol=1e-6)


def test_tp_stage_pieces_merge_back_to_full_state():
    torch.manual_seed(0)
    sd = GPT(CFG).state_dict()
    # group=None: the shard computes its partial sums without communicating, which is
    # all this test needs (the names and shapes of its parameters).
    shards = []
    for r in range(2):
        s = StageModule(CFG, range(2), first=True, last=True, tp=2, tp_rank=r, tp_group=None)
        s.load_full(sd)
        shards.append(s.local_pieces())
    merged = merge_pieces(shards)
    assert merged.keys() == sd.keys()
    assert all(torch.equal(merged[k], sd[k]) for k in sd)


def test_tp_sums_of_partials_equal_full_block_output():
    """Summing the two shards' row-parallel partials reproduces the full MLP."""
    torch.manual_seed(0)
    sd = GPT(CFG).state_dict()
    x = torch.randn(2, CFG.seq_len, CFG.hidden)
    full = GPT(CFG)
    full.load_state_dict(sd)
    ref = full.blocks[0].mlp(x)
    partial = 0
    for r in range(2):
        m = tpmod.TPMLP(CFG, 2, None)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(tpmod.shard(f"blocks.0.mlp.{n}", sd[f"blocks.0.mlp.{n}"], r, 2))
        partial = partial + (m(x) - m.out.bias)
    assert torch.allclose(partial + sd["blocks.0.mlp.out.bias"], ref, atol=1e-5)
