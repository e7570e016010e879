"""Encoder→LLM resharding plans and the adaptive encoder:LLM split. Pure: no torch, no I/O.

A *layout* names the ranks that run the encoder and the ranks that run the LLM (they may
overlap when ``allow_shared``; disjoint sets are MegaScale-Omni's disaggregated layout).
A *plan* for one step says, for every micro-batch, which rank encodes each sample's
media and which rank runs the LLM on it; every (encoder rank → LLM rank) pair then
exchanges exactly the embeddings of the samples it shares, forward, and their gradients
backward. Every rank computes the same plan from the same inputs, so no plan is sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent.runtime.multimodal.reorder import balanced_bins, chunk_sizes


@dataclass(frozen=True)
class Layout:
    enc_ranks: tuple[int, ...]
    llm_ranks: tuple[int, ...]

    @property
    def ratio(self) -> str:
        return f"{len(self.enc_ranks)}:{len(self.llm_ranks)}"


@dataclass(frozen=True)
class Item:
    """What the planner knows of a sample: id, encoder load, LLM load, has media."""

    id: int
    enc: float
    llm: float

    @property
    def has_media(self) -> bool:
        return self.enc > 0


@dataclass
class MicroPlan:
    ids: list[int]  # the micro-batch's samples, ascending
    enc_owner: dict[int, int] = field(default_factory=dict)  # media samples only
    llm_owner: dict[int, int] = field(default_factory=dict)  # every sample

    def transfers(self) -> dict[tuple[int, int], list[int]]:
        """(encoder rank, LLM rank) -> ids whose embeddings go that way, ascending.
        Includes src == dst pairs (a local hand-over, no communication)."""
        out: dict[tuple[int, int], list[int]] = {}
        for sid in self.ids:
            if sid in self.enc_owner:
                out.setdefault((self.enc_owner[sid], self.llm_owner[sid]), []).append(sid)
        return out

    def moved(self) -> set[int]:
        """Ids whose embeddings cross ranks (what resharding actually ships)."""
        return {s for s, r in self.enc_owner.items() if self.llm_owner[s] != r}


@dataclass
class StepPlan:
    layout: Layout
    micro: list[MicroPlan]


def coupled_plan(batch: list[Item], world: int, micro_batches: int) -> StepPlan:
    """Plain data parallelism: rank r takes the r-th contiguous chunk of the batch and runs
    encoder and LLM on it; nothing is resharded."""
    sizes = chunk_sizes(len(batch), world)
    micro = [MicroPlan(ids=[]) for _ in range(micro_batches)]
    pos = 0
    for r, n in enumerate(sizes):
        chunk = batch[pos:pos + n]
        pos += n
        cpos = 0
        for j, m in enumerate(chunk_sizes(n, micro_batches)):
            for it in chunk[cpos:cpos + m]:
                micro[j].ids.append(it.id)
                micro[j].llm_owner[it.id] = r
                if it.has_media:
                    micro[j].enc_owner[it.id] = r
            cpos += m
    for mp in micro:
        mp.ids.sort()
    return StepPlan(Layout(tuple(range(world)), tuple(range(world))), micro)


def assign(items: list[Item], layout: Layout, min_gain: float = 0.05) -> tuple[dict[int, int], dict[int, int]]:
    """Balance one micro-batch over the layout (a rank holding both roles carries the sum).

    Disjoint or partly overlapping roles: longest job first onto the least-loaded eligible
    rank (LLM jobs over llm_ranks, encoder jobs over enc_ranks); ties go to the rank that
    holds the sample's other half, then the lowest rank. Identical role sets: whole
    samples first (no transfer at all), then encoder jobs move off the most-loaded rank
    while a move cuts its load by more than ``min_gain`` of it — each move is one
    resharded embedding, worth it only when it buys real balance."""
    ranks_all = sorted(set(layout.enc_ranks) | set(layout.llm_ranks))
    load: dict[int, float] = {r: 0.0 for r in ranks_all}
    enc_owner: dict[int, int] = {}
    llm_owner: dict[int, int] = {}
    if set(layout.enc_ranks) == set(layout.llm_ranks):
        for it in sorted(items, key=lambda it: (-(it.enc + it.llm), it.id)):
            r = min(ranks_all, key=lambda q: (round(load[q], 12), q))
            llm_owner[it.id] = r
            if it.has_media:
                enc_owner[it.id] = r
            load[r] += it.enc + it.llm
        cost = {it.id: it.enc for it in items}
        while len(ranks_all) > 1:
            hi = max(ranks_all, key=lambda q: (load[q], -q))
            lo = min(ranks_all, key=lambda q: (load[q], q))
            gap = load[hi] - load[lo]
            # Best single move: brings the pair closest to even, never past it.
            movable = [s for s, r in enc_owner.items() if r == hi and 0 < cost[s] < gap]
            if not movable:
                break
            s = min(movable, key=lambda s: (abs(gap - 2 * cost[s]), s))
            if min(cost[s], gap - cost[s]) <= min_gain * load[hi]:
                break
            enc_owner[s] = lo
            load[hi] -= cost[s]
            load[lo] += cost[s]
        return enc_owner, llm_owner
    jobs = [(it.llm, "llm", it.id) for it in items] + [(it.enc, "enc", it.id) for it in items if it.has_media]
    jobs.sort(key=lambda j: (-j[0], j[1], j[2]))
    for cost_, role, sid in jobs:
        ranks = layout.llm_ranks if role == "llm" else layout.enc_ranks
        other = enc_owner if role == "llm" else llm_owner
        r = min(ranks, key=lambda q: (round(load[q] + cost_, 12), other.get(sid) != q, q))
        (llm_owner if role == "llm" else enc_owner)[sid] = r
        load[r] += cost_
    return enc_owner, llm_owner


def decoupled_plan(batch: list[Item], layout: Layout, micro_batches: int) -> StepPlan:
    """Balance the whole batch over the layout's encoder and LLM ranks (``assign``), then
    cut each LLM rank's samples into ``micro_batches`` chunks; a sample's media are
    encoded in the micro-batch its LLM work is in. Balancing the step, not each
    micro-batch, matters: ranks only wait for each other at transfers and at the step's
    all-reduce, and a small micro-batch cannot be split evenly.

    How a rank's samples become micro-batches depends on the layout. Shared (every rank
    runs both roles): only the step's total matters, so samples are bucketed by LLM
    length (shortest first) — a micro-batch is padded to its longest sequence, and
    similar lengths waste the least. Disjoint: encoder and LLM ranks form a pipeline
    whose stages should be even per micro-batch, so chunks balance both loads."""
    enc_owner, llm_owner = assign(batch, layout)
    shared = set(layout.enc_ranks) == set(layout.llm_ranks)
    micro = [MicroPlan(ids=[]) for _ in range(micro_batches)]
    for r in layout.llm_ranks:
        mine = [it for it in batch if llm_owner.get(it.id) == r]
        if not mine:
            continue
        sizes = chunk_sizes(len(mine), min(micro_batches, len(mine)))
        if shared:
            order = sorted(range(len(mine)), key=lambda i: (mine[i].llm, mine[i].id))
            bins, pos = [], 0
            for n in sizes:
                bins.append(order[pos:pos + n])
                pos += n
        else:
            bins = balanced_bins([it.enc for it in mine], [it.llm for it in mine], sizes)
        for j, b in enumerate(bins):
            for i in b:
                sid = mine[i].id
                micro[j].ids.append(sid)
                micro[j].llm_owner[sid] = r
                if sid in enc_owner:
                    micro[j].enc_owner[sid] = enc_owner[sid]
    for mp in micro:
        mp.ids.sort()
    return StepPlan(layout, [mp for mp in micro if mp.ids] or [MicroPlan(ids=[])])


def candidate_layouts(world: int, allow_shared: bool) -> list[Layout]:
    """Disjoint k:(world-k) splits (encoder on the low ranks), plus all-ranks-both if
    allowed. A single rank can only be shared."""
    out = [Layout(tuple(range(k)), tuple(range(k, world))) for k in range(1, world)]
    if allow_shared or world == 1:
        out.append(Layout(tuple(range(world)), tuple(range(world))))
    return out


def predict_time(layout: Layout, enc_total: float, llm_total: float, micro_batches: int) -> float:
    """Step time of a layout under perfect balance. A rank with both roles runs them in
    turn; disjoint stages pipeline over micro-batches, paying the smaller stage once per
    micro-batch of fill/drain (``max + min / M``)."""
    ne, nl = len(layout.enc_ranks), len(layout.llm_ranks)
    shared = set(layout.enc_ranks) & set(layout.llm_ranks)
    if shared:
        # Overlapping sets: the total work spreads over the union of ranks.
        return (enc_total + llm_total) / len(set(layout.enc_ranks) | set(layout.llm_ranks))
    e, l_ = enc_total / ne, llm_total / nl
    return max(e, l_) + min(e, l_) / micro_batches


def choose_layout(
    enc_total: float,
    llm_total: float,
    world: int,
    micro_batches: int,
    allow_shared: bool = True,
    encoder_ranks: int | None = None,
) -> Layout:
    """The candidate with the least predicted step time (first on ties). ``encoder_ranks``
    pins a disjoint split instead (the manifest said so)."""
    if encoder_ranks is not None and world > 1:
        k = min(max(encoder_ranks, 1), world - 1)
        return Layout(tuple(range(k)), tuple(range(k, world)))
    cands = candidate_layouts(world, allow_shared)
    return min(cands, key=lambda L: predict_time(L, enc_total, llm_total, micro_batches))
