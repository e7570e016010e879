"""Scheduling policies (pure). See types.py for the ``schedule(request) -> reply`` contract."""

from .baselines import FCFSPolicy, GavelPolicy, SiaPolicy
from .estimator import Estimator, SharingModel, TableEstimator
from .firstfit import FirstFit
from .tessera import TesseraPolicy
from .types import (
    ColocationGroup,
    DeviceView,
    Infeasible,
    JobView,
    NodeView,
    Placement,
    Plan,
    Policy,
    Preempt,
    Repartition,
    Reshard,
    Resize,
    RunningJob,
    ScheduleReply,
    ScheduleRequest,
    Shard,
)

__all__ = [
    "ColocationGroup", "DeviceView", "Estimator", "FCFSPolicy", "FirstFit", "GavelPolicy", "Infeasible",
    "JobView", "NodeView", "Placement", "Plan", "Policy", "Preempt", "Repartition", "Reshard", "Resize",
    "RunningJob", "ScheduleReply", "ScheduleRequest", "Shard", "SharingModel", "SiaPolicy",
    "TableEstimator", "TesseraPolicy",
]
