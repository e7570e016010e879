"""The Tessera policy: grid search with adaptive parallelism, elasticity and multiplexing.

Objective: minimise average JCT, with a bound on waiting (hence on p99 JCT). Each round:

1. every job's grid (cached per model) gives its allowed cells: any device type, between
   half and all of the requested count (shrink at most 2x);
2. jobs are ordered by estimated remaining work on their preferred cell (remaining
   iterations x iteration time x devices, divided by the tenant weight: shortest
   remaining work first); a running job counts at ``preempt_ratio`` of its remaining
   work, so only a job with less than half of it preempts it; a job waiting longer than
   ``wait_bound_s`` goes first, in arrival order (bounded waiting);
3. in that order each job keeps its devices, or takes the best free cell (ranked by
   iteration time x devices**beta: faster, but not at any cost in devices), or takes
   the devices of lower-priority running jobs (preempt; the victims move or wait);
4. idle devices then go to placed jobs whose remaining time drops by ``move_gain`` after
   paying the restart cost (expand, type change, migrate);
5. with multiplexing, jobs that underuse a device are packed on shared devices (LoRA
   tasks on one backbone fused), multimodal jobs get module quotas and encoder:LLM
   resharding, and colocation quotas are repartitioned as measured load shifts.
"""

from __future__ import annotations

from dataclasses import replace

from .engine import Strategy, run_round
from .grid import GridCache
from .types import ScheduleReply, ScheduleRequest

TESSERA = Strategy(order="srpw", cells="elastic", rank="balanced", beta=0.5, preempt=True,
                   preempt_ratio=0.5, expand=True, multiplex=True, shrink_limit=2.0,
                   restart_cost_s=60.0, move_gain=0.15, wait_bound_s=30 * 86400.0)


class TesseraPolicy:
    """Tessera's scheduler. ``multiplexing=False`` gives the ablation without sharing."""

    def __init__(self, multiplexing: bool = True, **overrides):
        self.strategy = replace(TESSERA, multiplex=multiplexing, **overrides)
        self.name = "tessera" if multiplexing else "tessera-nomux"
        self._cache = GridCache()

    def schedule(self, request: ScheduleRequest) -> ScheduleReply:
        return run_round(request, self.strategy, self._cache)
