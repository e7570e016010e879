"""The estimator interface the policy sees, and a table-backed implementation.

The policy never measures anything: it asks an estimator. The controller passes the
estimator service's model snapshot; the simulator passes measured tables, optionally
with injected error. Anything with these methods works (duck typing, see ``Estimator``).

Model keys are ``family_params_batch`` (e.g. ``bert_2.6B_256``), as in Arena's tables.
A key ``fixed:SECONDS`` names a job whose iteration takes SECONDS on one device of any
type and cannot span devices (small jobs from traces that carry no model name).
"""

from __future__ import annotations

import math
import random
from typing import Mapping, Protocol

FIXED_PREFIX = "fixed:"


class Estimator(Protocol):
    """What a policy may ask. Every method is pure and deterministic."""

    def iter_time(self, model: str, gpu_type: str, n_nodes: int, gpus_per_node: int) -> float | None:
        """Seconds per iteration of ``model`` on that shape under its best plan; None = infeasible."""

    def colocation_slowdown(self, members: int, fused: bool = False) -> float:
        """Factor on each member's iteration time when ``members`` jobs share a device
        (within their quotas). ``fused``: LoRA tasks fused in one executor on one backbone."""


def config_key(gpu_type: str, n_nodes: int, gpus_per_node: int) -> str:
    """Arena's table key, e.g. ``a40:2x2``."""
    return f"{gpu_type}:{n_nodes}x{gpus_per_node}"


def parse_config_key(key: str) -> tuple[str, int, int]:
    """Inverse of ``config_key``."""
    gpu, shape = key.split(":")
    n, g = shape.split("x")
    return gpu, int(n), int(g)


def fixed_model(seconds: float) -> str:
    """Model key of a job with a fixed single-device iteration time."""
    return f"{FIXED_PREFIX}{seconds:g}"


class SharingModel:
    """Throughput under sharing, stated as two numbers so it can be read and varied.

    ``interference``: each extra co-runner on a device adds this fraction to every
    member's iteration time (separate executors, quotas summing to <= 1; Gavel's and
    Blox's co-location measurements put typical pairs at 5-30 %).
    ``fused_step``: the same for LoRA tasks fused into one executor on one frozen
    backbone: one process, one batched backbone pass, no context switches between
    executors, so the per-member cost is lower (MuxTune reports 2.33x the throughput of
    separate HF-PEFT executors); fused members also need less quota (see
    ``multiplex.FUSED_DEMAND_DISCOUNT``).
    """

    def __init__(self, interference: float = 0.10, fused_step: float = 0.05):
        self.interference = interference
        self.fused_step = fused_step

    def colocation_slowdown(self, members: int, fused: bool = False) -> float:
        if members <= 1:
            return 1.0
        if fused:
            return 1.0 + self.fused_step * (members - 1)
        return 1.0 + self.interference * (members - 1)


class TableEstimator(SharingModel):
    """Answers from a measured table ``{model: {"gpu:NxG": seconds}}``.

    ``error`` > 0 multiplies every entry by a deterministic log-normal factor
    (sigma = ``error``, seeded by ``seed`` and the entry), which is how the simulator
    gives the policy estimates that differ from the ground truth.
    """

    def __init__(self, table: Mapping[str, Mapping[str, float]], error: float = 0.0, seed: int = 0,
                 interference: float = 0.10, fused_step: float = 0.05):
        super().__init__(interference, fused_step)
        self._table = table
        self._error = error
        self._seed = seed
        self._memo: dict[tuple, float | None] = {}

    def models(self) -> tuple[str, ...]:
        return tuple(self._table)

    def configs(self, model: str) -> tuple[tuple[str, int, int], ...]:
        """Every measured configuration of ``model`` (lets the grid skip unmeasured cells)."""
        return tuple(parse_config_key(k) for k in self._table.get(model, {}))

    def iter_time(self, model: str, gpu_type: str, n_nodes: int, gpus_per_node: int) -> float | None:
        k = (model, gpu_type, n_nodes, gpus_per_node)
        if k in self._memo:
            return self._memo[k]
        t = self._lookup(model, gpu_type, n_nodes, gpus_per_node)
        if t is not None and self._error > 0:
            rng = random.Random(f"{self._seed}|{model}|{config_key(gpu_type, n_nodes, gpus_per_node)}")
            t *= math.exp(rng.gauss(0.0, self._error))
        self._memo[k] = t
        return t

    def _lookup(self, model: str, gpu_type: str, n_nodes: int, gpus_per_node: int) -> float | None:
        if model.startswith(FIXED_PREFIX):
            return float(model[len(FIXED_PREFIX):]) if n_nodes * gpus_per_node == 1 else None
        t = self._table.get(model, {}).get(config_key(gpu_type, n_nodes, gpus_per_node))
        return t if t is not None and t > 0 else None  # Arena's tables mark infeasible with -1
