"""Trace-driven simulator over the same policy code the controller runs. See README.md."""

from .engine import Overheads, SimError, SimResult, Simulator
from .metrics import summarize
from .traces import (SimJob, cluster_nodes, convert_openb, convert_philly, load_arena_trace, load_cluster,
                     load_iter_times, synthetic_trace)

__all__ = ["Overheads", "SimError", "SimJob", "SimResult", "Simulator", "cluster_nodes", "convert_openb",
           "convert_philly", "load_arena_trace", "load_cluster", "load_iter_times", "summarize",
           "synthetic_trace"]
