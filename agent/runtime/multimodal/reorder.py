"""Grouped reordering for the data loaders (after MegaScale-Omni). Pure: no torch, no I/O.

Contract: ``reorder_group`` returns a permutation of the group's sample ids cut into
batches (and rank chunks inside each batch) whose loads are balanced; it never adds,
drops or duplicates a sample, so an epoch sees exactly the samples it would have seen
unreordered, only in another order. Balancing is two-dimensional (encoder load:
images/audio, LLM load: tokens) because a batch balanced on one can be skewed on the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence


def chunk_sizes(total: int, parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous chunks of ``total`` items, differing by at most one."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def balanced_bins(
    enc: Sequence[float], llm: Sequence[float], sizes: Sequence[int]
) -> list[list[int]]:
    """Put item ``i`` (loads ``enc[i]``, ``llm[i]``) into bins of exactly ``sizes`` items.

    Greedy longest-first: each item goes to the non-full bin whose normalised load
    ``enc/E + llm/L`` is smallest. Returns indices per bin, each bin sorted ascending.
    """
    n = len(enc)
    if len(llm) != n or sum(sizes) != n:
        raise ValueError(f"{n} items do not fill bins of sizes {list(sizes)}")
    e_tot, l_tot = sum(enc) or 1.0, sum(llm) or 1.0
    weight = [enc[i] / e_tot + llm[i] / l_tot for i in range(n)]
    order = sorted(range(n), key=lambda i: (-weight[i], i))
    bins: list[list[int]] = [[] for _ in sizes]
    e_load = [0.0] * len(sizes)
    l_load = [0.0] * len(sizes)
    for i in order:
        best = min(
            (b for b in range(len(sizes)) if len(bins[b]) < sizes[b]),
            key=lambda b: (max(e_load[b] + enc[i], 0) / e_tot + (l_load[b] + llm[i]) / l_tot, b),
        )
        bins[best].append(i)
        e_load[best] += enc[i]
        l_load[best] += llm[i]
    return [sorted(b) for b in bins]


def reorder_group(
    ids: Sequence[int],
    enc: Sequence[float],
    llm: Sequence[float],
    n_batches: int,
    ranks: int = 1,
) -> list[list[int]]:
    """Cut a group of ``len(ids)`` samples into ``n_batches`` equal batches whose per-rank
    contiguous chunks (``ranks`` per batch, the plain data-parallel split) carry balanced
    encoder and LLM load. Returns the sample ids of each batch, chunk after chunk."""
    if len(ids) % n_batches:
        raise ValueError(f"group of {len(ids)} samples is not {n_batches} equal batches")
    per_batch = len(ids) // n_batches
    sizes = [s for _ in range(n_batches) for s in chunk_sizes(per_batch, ranks)]
    bins = balanced_bins(enc, llm, sizes)
    return [[ids[i] for b in bins[k * ranks:(k + 1) * ranks] for i in b] for k in range(n_batches)]


def batches(
    n_steps: int,
    batch_size: int,
    cost: Callable[[int], tuple[float, float]],
    group_batches: int = 1,
    ranks: int = 1,
    enabled: bool = True,
    start_step: int = 0,
    resume_ranks: int | None = None,
) -> Iterator[list[int]]:
    """Sample ids of steps ``start_step .. n_steps-1``. Unreordered, step ``s`` holds ids
    ``s*B .. s*B+B-1``; reordered, groups of ``group_batches`` consecutive steps exchange
    samples (a trailing partial group is reordered among itself). ``cost(id)`` gives
    (encoder load, LLM load); it must be a pure function of the id.

    Resuming at ``start_step`` yields what a full run would (never adds, drops or
    duplicates a sample of the epoch) provided ``n_steps``, ``batch_size``, ``cost`` and
    ``group_batches`` are those of the run that stopped, and either ``ranks`` is
    unchanged or ``start_step`` starts a group or ``resume_ranks`` is the ``ranks`` that
    ordered the group holding ``start_step`` (:func:`group_ranks`; a group's order
    depends on ``ranks``). With ``resume_ranks`` the interrupted group is finished in its
    saved order and later groups are ordered for ``ranks``."""
    g0 = start_step - start_step % group_batches if enabled else start_step
    for first in range(g0, n_steps, group_batches if enabled else 1):
        k = min(group_batches, n_steps - first) if enabled else 1
        ids = list(range(first * batch_size, (first + k) * batch_size))
        if enabled:
            r = resume_ranks if (first == g0 and first < start_step and resume_ranks is not None) else ranks
            costs = [cost(i) for i in ids]
            group = reorder_group(ids, [c[0] for c in costs], [c[1] for c in costs], k, r)
        else:
            group = [ids]
        for off, batch in enumerate(group):
            if first + off >= start_step:
                yield batch


def group_ranks(
    step: int, group_batches: int, ranks: int, start_step: int = 0, resume_ranks: int | None = None
) -> int:
    """The ``ranks`` that ordered the group holding ``step`` in a run reading
    ``batches(..., group_batches, ranks, start_step=start_step, resume_ranks=resume_ranks)``:
    what a checkpoint taken before ``step`` saves, to be passed back as ``resume_ranks``."""
    if (resume_ranks is not None and start_step % group_batches
            and step // group_batches == start_step // group_batches):
        return resume_ranks
    return ranks
