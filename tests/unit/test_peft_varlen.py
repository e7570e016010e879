"""varlen.SegmentLayout: per-sequence attention equals the block-causal masked attention."""

import pytest
import torch
import torch.nn.functional as F

from agent.runtime.model import GPT, GPTConfig
from agent.runtime.peft.packing import block_causal_mask, pack
from agent.runtime.peft.varlen import SegmentLayout


def _masked(qkv: torch.Tensor, heads: int, mask: torch.Tensor) -> torch.Tensor:
    b, t, c3 = qkv.shape
    c = c3 // 3
    q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in qkv.split(c, dim=2))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    return y.transpose(1, 2).reshape(b, t, c)


@pytest.mark.parametrize("ratio", [1.0, 0.7, 0.3])
def test_layout_equals_masked_attention_values_and_gradients(ratio):
    g = torch.Generator().manual_seed(3)
    lens = [[5, 7, 1, 3], [16], [2, 2, 2, 7], [11]]  # rows of one 16-column micro-batch
    w = 16
    seg = torch.full((len(lens), w), -1, dtype=torch.long)
    for r, row in enumerate(lens):
        off = 0
        for k, ln in enumerate(row):
            seg[r, off:off + ln] = k
            off += ln
    real = seg >= 0
    heads, c = 4, 32
    qkv = torch.randn(len(lens), w, 3 * c, generator=g, requires_grad=True)
    qkv2 = qkv.detach().clone().requires_grad_(True)
    lay = SegmentLayout(seg, ratio=ratio)
    assert sorted(lay.lengths) == sorted(x for row in lens for x in row)
    a = lay.attend(qkv, heads)
    b = _masked(qkv2, heads, block_causal_mask(seg))
    torch.testing.assert_close(a[real], b[real], rtol=1e-5, atol=1e-6)
    assert torch.all(a[~real] == 0)
    up = torch.randn(a.shape, generator=g) * real[..., None]  # a loss that reads real tokens only
    (a * up).sum().backward()
    (b * up).sum().backward()
    torch.testing.assert_close(qkv.grad, qkv2.grad, rtol=1e-4, atol=1e-6)


def test_layout_never_lets_a_sequence_see_another():
    # Changing one sequence's tokens changes no other sequence's outputs.
    seqs = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7, 8]), torch.tensor([9, 10])]
    p = pack([(0, seqs)], 16)
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab=32, seq_len=16, layers=2, hidden=16, heads=2)).eval()
    lay = SegmentLayout(p.seg)
    base = m(p.tokens, lay, p.positions)
    t2 = p.tokens.clone()
    t2[p.seg == 1] = 31  # the second sequence
    other = m(t2, lay, p.positions)
    keep = (p.seg >= 0) & (p.seg != 1)
    torch.testing.assert_close(base[keep], other[keep])
    assert not torch.allclose(base[p.seg == 1], other[p.seg == 1])
    # And equals the masked path on every real token.
    torch.testing.assert_close(base[p.seg >= 0], m(p.tokens, p.mask, p.positions)[p.seg >= 0], rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="seg must be"):
        SegmentLayout(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="ratio"):
        SegmentLayout(torch.zeros(1, 4, dtype=torch.long), ratio=0)
    lay = SegmentLayout(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="layout for"):
        lay.attend(torch.zeros(1, 5, 12), 2)
