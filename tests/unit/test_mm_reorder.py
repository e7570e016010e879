"""Grouped reordering keeps each epoch's sample set and balances load."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.runtime.multimodal.reorder import balanced_bins, batches, chunk_sizes, group_ranks, reorder_group


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


def _cost(i):
    return (float((i * 7) % 5), float(10 + (i * 13) % 31))


def test_resume_under_another_world_size_mid_group():
    # Reviewer repro: 8 steps of 8, groups of 4; stop after step 2 at world 2, resume at world 4.
    full = list(batches(8, 8, _cost, 4, ranks=2))
    done = full[:2]
    resumed = list(batches(8, 8, _cost, 4, ranks=4, start_step=2, resume_ranks=group_ranks(2, 4, ranks=2)))
    assert resumed[:2] == full[2:4]  # the interrupted group finishes in its saved order
    assert resumed[2:] == list(batches(8, 8, _cost, 4, ranks=4, start_step=4))  # later groups: new world size
    seen = sorted(i for b in done + resumed for i in b)
    assert seen == list(range(64))  # no sample twice, none skipped


@settings(max_examples=150, deadline=None)
@given(
    steps=st.integers(1, 13),
    batch=st.integers(1, 8),
    group=st.integers(1, 5),
    worlds=st.lists(st.integers(1, 4), min_size=2, max_size=4),
    cuts=st.lists(st.integers(0, 13), min_size=3, max_size=3),
)
def test_chained_resumes_under_changing_world_sizes_see_each_sample_once(steps, batch, group, worlds, cuts):
    # A run relaunched several times, each time with another world size, at arbitrary steps.
    stops = sorted({min(c, steps) for c in cuts[: len(worlds) - 1]})
    bounds = [0, *stops, steps]
    seen, resume, start_prev = [], None, 0
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        ranks = worlds[k % len(worlds)]
        part = list(batches(steps, batch, _cost, group, ranks, start_step=a, resume_ranks=resume))[: b - a]
        seen += part
        resume = group_ranks(b, group, ranks, a, resume)  # what the checkpoint at step b saves
    assert len(seen) == steps
    assert sorted(i for bt in seen for i in bt) == list(range(steps * batch))


def test_group_ranks_without_saved_order_is_the_current_world():
    assert group_ranks(6, 4, ranks=3) == 3
    assert group_ranks(6, 4, ranks=3, start_step=5, resume_ranks=2) == 2  # still in the resumed group
    assert group_ranks(8, 4, ranks=3, start_step=5, resume_ranks=2) == 3  # next group: this run's order
    assert group_ranks(6, 4, ranks=3, start_step=4, resume_ranks=2) == 3  # resumed on a boundary


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
