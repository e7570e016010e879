"""Resharding plans: every sample placed once, transfers are exactly the cross-rank media
samples, load is balanced, and the encoder:LLM split follows the modality mix."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.runtime.multimodal.reshard import (
    Item,
    Layout,
    assign,
    candidate_layouts,
    choose_layout,
    coupled_plan,
    decoupled_plan,
)

layouts = st.sampled_from([
    Layout((0,), (1,)), Layout((0, 1), (2,)), Layout((0,), (1, 2, 3)), Layout((0, 1), (0, 1)), Layout((0,), (0,)),
])


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.tuples(st.integers(0, 4), st.integers(2, 50)), min_size=1, max_size=24),
    layout=layouts,
    micro=st.integers(1, 4),
)
def test_plan_places_every_sample_once_and_moves_exactly_cross_rank_media(loads, layout, micro):
    items = [Item(i, float(e), float(t)) for i, (e, t) in enumerate(loads)]
    plan = decoupled_plan(items, layout, micro)
    seen = sorted(i for mp in plan.micro for i in mp.ids)
    assert seen == list(range(len(items)))
    for mp in plan.micro:
        assert set(mp.llm_owner) == set(mp.ids)
        assert set(mp.enc_owner) == {i for i in mp.ids if items[i].has_media}
        assert set(mp.llm_owner.values()) <= set(layout.llm_ranks)
        assert set(mp.enc_owner.values()) <= set(layout.enc_ranks)
        shipped = [i for (src, dst), ids in mp.transfers().items() if src != dst for i in ids]
        assert sorted(shipped) == sorted(mp.moved())
        assert mp.moved() == {i for i in mp.enc_owner if mp.enc_owner[i] != mp.llm_owner[i]}
        every = [i for ids in mp.transfers().values() for i in ids]
        assert sorted(every) == sorted(mp.enc_owner)


def test_disjoint_layout_moves_every_media_sample_and_no_text_sample():
    items = [Item(0, 2.0, 10.0), Item(1, 0.0, 12.0), Item(2, 1.0, 8.0), Item(3, 0.0, 5.0)]
    plan = decoupled_plan(items, Layout((0,), (1, 2)), micro_batches=1)
    mp = plan.micro[0]
    assert mp.moved() == {0, 2}
    assert {d for (_, d) in mp.transfers()} <= {1, 2}


def test_assign_balances_llm_load():
    items = [Item(i, 0.0, float(c)) for i, c in enumerate([9, 7, 6, 5, 4, 3, 2, 1])]
    _, owner = assign(items, Layout((0,), (1, 2)))
    loads = {1: 0.0, 2: 0.0}
    for i, r in owner.items():
        loads[r] += items[i].llm
    assert abs(loads[1] - loads[2]) <= 1.0


def test_shared_layout_prefers_local_handover_on_ties():
    plan = decoupled_plan([Item(0, 1.0, 5.0), Item(1, 1.0, 5.0)], Layout((0, 1), (0, 1)), 1)
    assert plan.micro[0].moved() == set()  # equal loads: each rank encodes what it trains on


def test_coupled_plan_is_contiguous_and_local():
    items = [Item(i, float(i % 2), 10.0) for i in range(8)]
    plan = coupled_plan(items, world=2, micro_batches=2)
    owners = {i: mp.llm_owner[i] for mp in plan.micro for i in mp.ids}
    assert owners == {i: (0 if i < 4 else 1) for i in range(8)}
    assert all(not mp.moved() for mp in plan.micro)


def test_ratio_follows_the_mix():
    # Text-heavy: LLM dominates -> few encoder ranks. Image-heavy: the other way round.
    text_heavy = choose_layout(enc_total=1.0, llm_total=9.0, world=4, micro_batches=4, allow_shared=False)
    image_heavy = choose_layout(enc_total=9.0, llm_total=1.0, world=4, micro_batches=4, allow_shared=False)
    assert text_heavy.ratio == "1:3"
    assert image_heavy.ratio == "3:1"
    assert choose_layout(1.0, 1.0, 4, 4, allow_shared=False, encoder_ranks=2).ratio == "2:2"
    assert choose_layout(5.0, 5.0, 1, 4).ratio == "1:1"  # one rank holds both
    assert len(candidate_layouts(3, allow_shared=True)) == 3


def test_shared_layout_buckets_micro_batches_by_llm_length():
    # Shared roles: a rank's micro-batches hold similar lengths (less padding), shortest first.
    items = [Item(i, 0.0, float(c)) for i, c in enumerate([30, 5, 28, 6, 29, 7, 31, 4])]
    plan = decoupled_plan(items, Layout((0,), (0,)), micro_batches=2)
    assert [sorted(items[i].llm for i in mp.ids) for mp in plan.micro] == [[4, 5, 6, 7], [28, 29, 30, 31]]
    # Disjoint roles: micro-batches balance the pipeline's stages instead.
    plan = decoupled_plan(items, Layout((0,), (1,)), micro_batches=2)
    loads = [sum(items[i].llm for i in mp.ids) for mp in plan.micro]
    assert abs(loads[0] - loads[1]) <= 4
