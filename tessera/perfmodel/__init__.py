"""Tessera's performance model: pure code (numpy only) shared by estimator and controller.

Parts: ``features`` (FLOPs, memory traffic, parameters of a stage), ``compute``
(fitted compute-time curve per device type), ``comm`` (latency/bandwidth per link
type), ``model`` (snapshot, plan composition, colocation, memory, confidence),
``pipeline`` (the pipeline schedules replayed; ``MAX_PP`` / ``MAX_MICRO_BATCHES``, the
largest plan a candidate may ask for). See docs/estimator.md.

Typical use::

    fit = fit_compute("cpu", samples)                  # estimator, from profiles
    model = PerfModel(version=1, compute={"cpu": fit}, comm={"loopback": fit_comm("loopback", rows)},
                      interference={"cpu": fit_interference(pairs)})
    snap = model.to_dict()                             # served to the controller
    PerfModel.from_dict(snap).estimate_batch([Candidate(...), ...])
"""

from tessera.perfmodel.comm import CommFit, fit_comm
from tessera.perfmodel.compute import ComputeFit, ComputeSample, fit_compute
from tessera.perfmodel.model import (FIT_REV, FORMAT, Candidate, Estimate, PerfModel, ProfilePoint, fit_interference,
                                     fit_rank_interference, interference_mode)
from tessera.perfmodel.pipeline import MAX_MICRO_BATCHES, MAX_PIPELINE_SLOTS, MAX_PP

__all__ = ["Candidate", "CommFit", "ComputeFit", "ComputeSample", "Estimate", "FIT_REV", "FORMAT", "MAX_MICRO_BATCHES", "MAX_PIPELINE_SLOTS", "MAX_PP",
           "PerfModel", "ProfilePoint", "fit_comm", "fit_compute", "fit_interference",
           "fit_rank_interference", "interference_mode"]
