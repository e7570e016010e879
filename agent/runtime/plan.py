"""Parallel plan of one GPT job and its rank layout. Pure: no torch, no I/O.

A plan is ``dp x tp x pp`` ranks plus the number of micro-batches each data-parallel
replica splits its share of the global batch into. Rank layout (tensor-parallel
fastest, then data-parallel, then pipeline stage)::

    rank = pp_idx * (dp * tp) + dp_idx * tp + tp_idx

so the ranks of one tensor-parallel group are consecutive (cheapest links: the
same node / NVLink island), and rank 0 is stage 0, replica 0, shard 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tessera.errors import SpecError


@dataclass(frozen=True)
class Plan:
    """``dp * tp * pp`` ranks; every field >= 1."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict | None, field: str = "workload.plan") -> "Plan":
        """Parse a plan section (missing keys default to 1); SpecError on bad values."""
        d = d or {}
        if not isinstance(d, dict):
            raise SpecError(field, "must be a mapping")
        unknown = set(d) - {"dp", "tp", "pp", "micro_batches"}
        if unknown:
            raise SpecError(f"{field}.{sorted(unknown)[0]}", "unknown plan field")
        vals = {}
        for k in ("dp", "tp", "pp", "micro_batches"):
            v = d.get(k, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"{field}.{k}", f"must be an integer >= 1, got {v!r}")
            vals[k] = v
        return Plan(**vals)


@dataclass(frozen=True)
class Coord:
    """Position of one rank in the plan's grid."""

    dp: int
    tp: int
    pp: int


def rank_of(plan: Plan, c: Coord) -> int:
    """Global rank of a grid position (see the module docstring for the layout)."""
    return c.pp * (plan.dp * plan.tp) + c.dp * plan.tp + c.tp


def coord_of(plan: Plan, rank: int) -> Coord:
    """Inverse of :func:`rank_of`; ValueError when rank is outside the world."""
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} outside world of {plan.world_size}")
    pp, rest = divmod(rank, plan.dp * plan.tp)
    dp, tp = divmod(rest, plan.tp)
    return Coord(dp=dp, tp=tp, pp=pp)


def tp_groups(plan: Plan) -> list[list[int]]:
    """Ranks that shard the same layers (one group per (pp, dp)); same order on every rank."""
    return [[rank_of(plan, Coord(d, t, p)) for t in range(plan.tp)] for p in range(plan.pp) for d in range(plan.dp)]


def dp_groups(plan: Plan) -> list[list[int]]:
    """Ranks that hold the same shard and average gradients (one group per (pp, tp))."""
    return [[rank_of(plan, Coord(d, t, p)) for d in range(plan.dp)] for p in range(plan.pp) for t in range(plan.tp)]


def pp_groups(plan: Plan) -> list[list[int]]:
    """Ranks that form one pipeline, stage order (one group per (dp, tp))."""
    return [[rank_of(plan, Coord(d, t, p)) for p in range(plan.pp)] for d in range(plan.dp) for t in range(plan.tp)]


def stage_layers(layers: int, pp: int) -> list[range]:
    """Split ``layers`` blocks into ``pp`` contiguous, non-empty stages.

    Earlier stages get the remainder because the last stage also runs the head and loss.
    """
    if pp < 1 or layers < pp:
        raise ValueError(f"cannot split {layers} layers into {pp} stages")
    base, extra = divmod(layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def batch_rows(plan: Plan, batch_size: int, dp_idx: int, micro: int) -> slice:
    """Rows of the global batch that replica ``dp_idx`` uses for micro-batch ``micro``.

    Replica d owns the contiguous block d of the global batch; it is cut into
    ``micro_batches`` equal micro-batches. Together the rows of all replicas and
    micro-batches cover the global batch exactly once, which is what makes any plan
    compute the same gradient as one process.
    """
    per_replica = batch_size // plan.dp
    per_micro = per_replica // plan.micro_batches
    start = dp_idx * per_replica + micro * per_micro
    return slice(start, start + per_micro)


def replica_rows(plan: Plan, batch_size: int, dp_idx: int) -> slice:
    """All rows of the global batch that replica ``dp_idx`` trains on (its micro-batches, in order)."""
    per_replica = batch_size // plan.dp
    return slice(dp_idx * per_replica, (dp_idx + 1) * per_replica)


def validate(plan: Plan, *, layers: int, heads: int, hidden: int, batch_size: int, world_size: int) -> None:
    """SpecError (with the field at fault) unless the plan fits the model, batch and world."""
    if plan.world_size != world_size:
        raise SpecError("workload.plan", f"dp*tp*pp = {plan.world_size} but dist.world_size = {world_size}")
    if batch_size % (plan.dp * plan.micro_batches):
        raise SpecError(
            "workload.batch_size",
            f"{batch_size} is not divisible by dp*micro_batches = {plan.dp * plan.micro_batches}",
        )
    if heads % plan.tp:
        raise SpecError("workload.plan.tp", f"model.heads ({heads}) is not divisible by tp ({plan.tp})")
    if (4 * hidden) % plan.tp or hidden % plan.tp:
        raise SpecError("workload.plan.tp", f"model.hidden ({hidden}) is not divisible by tp ({plan.tp})")
    if layers < plan.pp:
        raise SpecError("workload.plan.pp", f"model.layers ({layers}) < pp ({plan.pp}): a stage would be empty")
