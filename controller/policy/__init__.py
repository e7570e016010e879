"""Scheduling policies (pure). See types.py for the ``schedule(request) -> reply`` contract."""

from .firstfit import FirstFit
from .types import (
    DeviceView,
    Infeasible,
    JobView,
    NodeView,
    Placement,
    Policy,
    RunningJob,
    ScheduleReply,
    ScheduleRequest,
    Shard,
)

__all__ = [
    "DeviceView", "FirstFit", "Infeasible", "JobView", "NodeView", "Placement", "Policy",
    "RunningJob", "ScheduleReply", "ScheduleRequest", "Shard",
]
