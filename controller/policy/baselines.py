"""Baseline policies behind the same interface, for the simulator and the benchmarks.

They run on the same engine as Tessera (``engine.run_round``) so only the decisions
differ. Each is a faithful-in-spirit, simplified rendering of the published policy:

- ``FCFSPolicy``: arrival order, exactly the requested device type and count (compact
  shape), never preempts or resizes; a job that does not fit is skipped (backfilling).
- ``GavelPolicy``: heterogeneity-aware (Gavel, OSDI'20) least-attained-service: the
  requested count, on the device type the estimator finds fastest among the free ones;
  round-based, jobs with the least attained service first, preemption allowed.
- ``SiaPolicy``: elastic goodput (Sia, SOSP'23) without job-size knowledge: arrival
  order, each job first gets its most device-efficient cell (any type, up to 2x the
  request), then idle devices go to the jobs whose throughput rises most.
"""

from __future__ import annotations

from .engine import Strategy, run_round
from .grid import GridCache
from .types import ScheduleReply, ScheduleRequest

FCFS = Strategy(order="fifo", cells="requested", rank="compact")
GAVEL = Strategy(order="las", cells="any-type", rank="fastest", preempt=True, preempt_ratio=0.5)
SIA = Strategy(order="fifo", cells="elastic", rank="efficient", shrink_limit=16.0, expand=True,
               expand_factor=2.0, move_gain=0.15)


class _StrategyPolicy:
    strategy: Strategy
    name = ""

    def __init__(self) -> None:
        self._cache = GridCache()

    def schedule(self, request: ScheduleRequest) -> ScheduleReply:
        return run_round(request, self.strategy, self._cache)


class FCFSPolicy(_StrategyPolicy):
    """First come, first served with the requested resources."""

    name, strategy = "fcfs", FCFS


class GavelPolicy(_StrategyPolicy):
    """Gavel-style heterogeneity-aware least attained service."""

    name, strategy = "gavel", GAVEL


class SiaPolicy(_StrategyPolicy):
    """Sia-style elastic goodput, arrival order."""

    name, strategy = "sia", SIA
