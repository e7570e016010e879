"""Chunk packing: bins respect capacity, masks never cross sequences, outputs are isolated."""

from __future__ import annotations

import random

import pytest
import torch

from agent.runtime.model import GPT, GPTConfig
from agent.runtime.peft.packing import block_causal_mask, pack, plan_chunks


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls: intra-op threads only add contention (badly so on a busy machine).
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("seed", range(5))
def test_plan_chunks_fits_every_sequence_once(seed):
    rnd = random.Random(seed)
    lens = [rnd.randint(1, 32) for _ in range(rnd.randint(1, 40))]
    bins = plan_chunks(lens, 32)
    assert sorted(i for b in bins for i in b) == list(range(len(lens)))
    assert all(sum(lens[i] for i in b) <= 32 for b in bins)
    # First-fit decreasing uses at most 11/9 OPT + 1 bins; OPT >= ceil(total / C).
    assert len(bins) <= 11 / 9 * -(-sum(lens) // 32) + 1


def test_plan_chunks_rejects_too_long():
    with pytest.raises(ValueError):
        plan_chunks([5, 33], 32)


def seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (n,), generator=g) for n in lengths]


def test_pack_layout_targets_positions_and_stats():
    a, b = seqs([5, 3, 7]), seqs([4, 10], seed=1)
    p = pack([(0, a), (3, b)], 12)
    assert p.tokens.shape == (p.chunk_slot.numel(), 12)
    assert set(p.chunk_slot.tolist()) == {0, 3}
    st = p.stats
    assert st.real_tokens == 29 and st.pad_chunked == p.tokens.numel() - 29
    assert st.pad_longest == (3 * 7 - 15) + (2 * 10 - 14)
    assert st.pad_removed == st.pad_longest - st.pad_chunked
    # Every sequence appears contiguously with positions 0..n-1 and in-sequence targets.
    found = 0
    for r in range(p.tokens.shape[0]):
        starts = (p.positions[r] == 0).nonzero().flatten().tolist()
        for s in starts:
            if p.token_slot[r, s] < 0:
                continue
            n = 1
            while s + n < 12 and p.positions[r, s + n] == n:
                n += 1
            seq = p.tokens[r, s:s + n]
            src = a if p.chunk_slot[r] == 0 else b
            assert any(torch.equal(seq, x) for x in src)
            assert torch.equal(p.targets[r, s:s + n - 1], seq[1:]) and p.targets[r, s + n - 1] == -100
            found += 1
    assert found == 5
    assert (p.targets[p.token_slot < 0] == -100).all()


def test_mask_is_block_diagonal_causal():
    p = pack([(0, seqs([3, 4, 2, 6]))], 16)
    seg = torch.full(p.tokens.shape, -1)
    for r in range(seg.shape[0]):  # rebuild segment ids from positions
        k = -1
        for c in range(16):
            if p.token_slot[r, c] < 0:
                continue
            if p.positions[r, c] == 0:
                k += 1
            seg[r, c] = k
    m = p.mask
    i, j = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    for r in range(m.shape[0]):
        allowed = (seg[r][:, None] == seg[r][None, :]) & (seg[r][:, None] >= 0) & (j <= i)
        pad_self = (seg[r] < 0)[:, None] & (i == j)
        assert torch.equal(m[r], allowed | pad_self)
    assert m.any(dim=-1).all()  # no empty softmax row


def test_block_causal_mask_small_case():
    seg = torch.tensor([[0, 0, 1, 1, -1]])
    expect = torch.tensor([[1, 0, 0, 0, 0],
                           [1, 1, 0, 0, 0],
                           [0, 0, 1, 0, 0],
                           [0, 0, 1, 1, 0],
                           [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(block_causal_mask(seg)[0], expect)


def test_perturbing_one_sequence_never_changes_another():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=50, seq_len=16, layers=2, hidden=32, heads=4)).eval()
    lengths = [5, 4, 7, 3, 9, 2]
    ss = seqs(lengths)
    p = pack([(0, ss)], 16)
    with torch.no_grad():
        out = model(p.tokens, attn_mask=p.mask, positions=p.positions)
        # Each packed sequence's logits equal the logits of the sequence run alone.
        for r in range(p.tokens.shape[0]):
            for c in range(16):
                if p.positions[r, c] == 0 and p.token_slot[r, c] >= 0:
                    n = 1
                    while c + n < 16 and p.positions[r, c + n] == n:
                        n += 1
                    alone = model(p.tokens[r:r + 1, c:c + n])
                    torch.testing.assert_close(out[r, c:c + n], alone[0], rtol=1e-5, atol=1e-5)
        # Perturb the first sequence of chunk 0 (the victim): no other position may move.
        victim = torch.zeros_like(p.tokens, dtype=torch.bool)
        n = 1
        while n < 16 and p.positions[0, n] == n:
            n += 1
        victim[0, :n] = True
        tok2 = p.tokens.clone()
        tok2[victim] = (tok2[victim] + 7) % 50
        out2 = model(tok2, attn_mask=p.mask, positions=p.positions)
    real_other = (~victim) & (p.token_slot >= 0)
    assert torch.equal(out[real_other], out2[real_other])
    assert not torch.allclose(out[victim], out2[victim])
