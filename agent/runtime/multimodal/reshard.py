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


def assign(items: list[Item], layout: Layout) -> tuple[dict[int, int], dict[int, int]]:
    """Balance one micro-batch over the layout: LLM work over llm_ranks, encoder work over
    enc_ranks, jointly (a rank holding both roles carries the sum). Longest job first onto
    the least-loaded eligible rank; ties go to the rank that also holds the sample's other
    half (saves a transfer), then to the lowest rank."""
    load: dict[int, float] = {r: 0.0 for r in set(layout.enc_ranks) | set(layout.llm_ranks)}
    jobs = [(it.llm, "llm", it.id) for it in items] + [(it.enc, "enc", it.id) for it in items if it.has_media]
    jobs.sort(key=lambda j: (-j[0], j[1], j[2]))
    enc_owner: dict[int, int] = {}
    llm_owner: dict[int, int] = {}
    for cost, role, sid in jobs:
        ranks = layout.llm_ranks if role == "llm" else layout.enc_ranks
        other = enc_owner if role == "llm" else llm_owner
        r = min(ranks, key=lambda q: (round(load[q] + cost, 12), other.get(sid) != q, q))
        (llm_owner if role == "llm" else enc_owner)[sid] = r
        load[r] += cost
    return enc_owner, llm_owner


def decoupled_plan(batch: list[Item], layout: Layout, micro_batches: int) -> StepPlan:
    """Split the batch into equal-count micro-batches of balanced load, then balance each
    over the layout's encoder and LLM ranks (resharding encoder outputs as needed)."""
    bins = balanced_bins([i.enc for i in batch], [i.llm for i in batch], chunk_sizes(len(batch), micro_batches))
    micro = []
    for b in bins:
        items = [batch[i] for i in b]
        enc_owner, llm_owner = assign(items, layout)
        micro.append(MicroPlan(sorted(it.id for it in items), enc_owner, llm_owner))
    return StepPlan(layout, micro)


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
