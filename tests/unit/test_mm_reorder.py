"""Grouped reordering keeps each epoch's sample set and balances load."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.runtime.multimodal.reorder import balanced_bins, batches, chunk_sizes, reorder_group


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.tuples(st.integers(0, 8), st.integers(1, 64)), min_size=1, max_size=60),
    n_batches=st.integers(1, 5),
    ranks=st.integers(1, 4),
)
def test_reorder_group_is_a_permutation(loads, n_batches, ranks):
    n = len(loads) - len(loads) % n_batches or n_batches
    loads = (loads * n)[:n]
    ids = list(range(100, 100 + n))
    out = reorder_group(ids, [a for a, _ in loads], [b for _, b in loads], n_batches, ranks)
    assert len(out) == n_batches
    assert all(len(b) == n // n_batches for b in out)
    assert sorted(i for b in out for i in b) == ids


@settings(max_examples=100, deadline=None)
@given(
    steps=st.integers(1, 13),
    batch=st.integers(1, 8),
    group=st.integers(1, 5),
    ranks=st.integers(1, 3),
    start=st.integers(0, 12),
)
def test_epoch_sees_the_same_samples(steps, batch, group, ranks, start):
    cost = lambda i: (float((i * 7) % 5), float(10 + (i * 13) % 31))  # noqa: E731
    plain = list(batches(steps, batch, cost, group, ranks, enabled=False))
    reordered = list(batches(steps, batch, cost, group, ranks, enabled=True))
    assert len(plain) == len(reordered) == steps
    assert all(len(b) == batch for b in reordered)
    assert sorted(i for b in plain for i in b) == sorted(i for b in reordered for i in b) == list(range(steps * batch))
    # Resuming mid-run yields exactly the tail of the full run.
    start = min(start, steps)
    assert list(batches(steps, batch, cost, group, ranks, enabled=True, start_step=start)) == reordered[start:]


def test_reordering_balances_rank_chunks():
    # Samples with many images cluster at the start: the plain split puts them all on rank 0.
    enc = [8.0] * 8 + [0.0] * 8
    llm = [10.0] * 16
    out = reorder_group(list(range(16)), enc, llm, n_batches=2, ranks=2)
    for batch in out:
        chunks = [batch[:4], batch[4:]]
        assert [sum(enc[i] for i in c) for c in chunks] == [16.0, 16.0]


def test_balanced_bins_respects_sizes():
    bins = balanced_bins([5, 4, 3, 3, 2, 1], [1, 1, 1, 1, 1, 1], [4, 2])
    assert [len(b) for b in bins] == [4, 2]
    assert chunk_sizes(7, 3) == [3, 2, 2]
