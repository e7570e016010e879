"""Arena-style grid: per job, cells of (device type, count and shape, pipeline stages).

A cell is one resource shape ``gpu_type : n_nodes x gpus_per_node`` with the best plan
the estimator knows for it and its estimated seconds per iteration. The grid of a model
depends only on the model, the cluster's shape and the estimator, so it is computed once
and cached across rounds and across jobs of the same model; that, plus dropping dominated
cells, is what keeps a round fast at 10,000 GPUs (the search is over a handful of cells
per job, not over device subsets).
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import NodeView

# Largest device count a single job may span; bounds the enumeration when the estimator
# cannot list its measured configurations.
MAX_CELL_DEVICES = 64


@dataclass(frozen=True, order=True)
class Cell:
    """One grid cell; ordering is by estimated iteration time first."""

    iter_time: float
    gpu_type: str
    n_nodes: int
    gpus_per_node: int
    stages: int = 0

    @property
    def count(self) -> int:
        return self.n_nodes * self.gpus_per_node

    def label(self) -> str:
        return f"{self.gpu_type}:{self.n_nodes}x{self.gpus_per_node}"


ClusterShape = tuple[tuple[str, int, int], ...]  # (gpu_type, ready nodes, max devices per node)


def cluster_shape(nodes: tuple[NodeView, ...]) -> ClusterShape:
    """Device types of the ready nodes with their node count and largest node size."""
    acc: dict[str, list[int]] = {}
    for n in nodes:
        if not n.ready:
            continue
        per: dict[str, int] = {}
        for d in n.devices:
            per[d.model] = per.get(d.model, 0) + 1
        for m, c in per.items():
            a = acc.setdefault(m, [0, 0])
            a[0] += 1
            a[1] = max(a[1], c)
    return tuple((m, a[0], a[1]) for m, a in sorted(acc.items()))


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def candidate_shapes(estimator, model: str, shape: ClusterShape) -> list[tuple[str, int, int]]:
    """Shapes worth asking about: the estimator's measured configs when it can list them,
    else power-of-two node counts and per-node counts that the cluster can host."""
    limits = {t: (n, g) for t, n, g in shape}
    listed = getattr(estimator, "configs", None)
    if listed is not None and not model.startswith("fixed:"):
        return [(t, n, g) for t, n, g in listed(model)
                if t in limits and n <= limits[t][0] and g <= limits[t][1]]
    out = []
    for t, nodes, per in shape:
        for g in _pow2_upto(per):
            for n in _pow2_upto(nodes):
                if n * g <= MAX_CELL_DEVICES:
                    out.append((t, n, g))
    return out


def build_grid(estimator, model: str, shape: ClusterShape) -> tuple[Cell, ...]:
    """All feasible cells of ``model`` on this cluster, fastest first, with dominated
    cells removed (same type, at least as many devices, not faster)."""
    plan_of = getattr(estimator, "stages", None)
    cells = []
    for t, n, g in candidate_shapes(estimator, model, shape):
        it = estimator.iter_time(model, t, n, g)
        if it is None or it <= 0:
            continue
        stages = plan_of(model, t, n, g) if plan_of else 0
        cells.append(Cell(it, t, n, g, stages))
    return prune_dominated(cells)


def prune_dominated(cells: list[Cell]) -> tuple[Cell, ...]:
    """Drop a cell when a cell of the same type uses no more devices and is at least as fast."""
    keep = []
    for c in sorted(cells, key=lambda c: (c.gpu_type, c.count, c.iter_time, c.n_nodes)):
        if any(k.gpu_type == c.gpu_type and k.count <= c.count and k.iter_time <= c.iter_time for k in keep):
            continue
        keep.append(c)
    return tuple(sorted(keep))


class GridCache:
    """Grids per (model, cluster shape) for one estimator; reset when the estimator changes."""

    def __init__(self) -> None:
        self._est = None
        self._grids: dict[tuple[str, ClusterShape], tuple[Cell, ...]] = {}
        self._nodes: tuple | None = None
        # Per-policy memo of allowed/ranked cells, keyed by (id(grid), request shape);
        # entries hold their grid so a recycled id can never alias.
        self.memo: dict = {}

    def shape(self, nodes: tuple[NodeView, ...]) -> ClusterShape:
        """``cluster_shape(nodes)``, remembered for the same ``nodes`` object."""
        if self._nodes is None or self._nodes[0] is not nodes:
            self._nodes = (nodes, cluster_shape(nodes))
        return self._nodes[1]

    def get(self, estimator, model: str, shape: ClusterShape) -> tuple[Cell, ...]:
        if estimator is not self._est:
            self._est, self._grids, self.memo = estimator, {}, {}
        key = (model, shape)
        g = self._grids.get(key)
        if g is None:
            g = self._grids[key] = build_grid(estimator, model, shape)
        return g
