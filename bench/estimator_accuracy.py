"""Accuracy of the performance model against real training steps of the runtime.

    python -m bench.estimator_accuracy [--json PATH] [--device cpu|cuda] [--quick]

1. Cheap profiles (the only thing the model is fitted from): two GPT modules at twelve
   (batch, seq, quota, micro-batch) points in one profiling process, a colocation
   profile per mode (split cores / shared core: one module alone, then with its twin
   beside it, then alone again — in one process),
   and the gloo loopback communication micro-benchmark with its synchronisation rows
   (2 processes).
2. A held-out grid of real configurations (no grid point is a profile point): other
   batches and sequence lengths, unseen model sizes and vocabularies, 2-thread
   quotas, gradient accumulation, colocation pairs, dp=2 / pp=2 / tp=2 over 2 gloo
   ranks — each run with ``agent.runtime`` (real steps; median after warm-up) —
   and the non-gpt workloads the estimator answers from their own step shape
   (``workload_peft``: multi-task LoRA, ``workload_multimodal``: colocated encoder +
   LLM): each shape profiled by a short run at quota 1 (its profile points built by
   the estimator's own ``profile_labels`` -> ``run_key`` -> ``profiles`` path, filed
   under ``shape_key``), held out as longer runs at quotas 1 and 2.
3. MAPE per category, single-device (one device, colocation included) and
   multi-rank, and the profiling cost: device-seconds of the profiles versus of
   measuring the whole grid. Beside each MAPE, the grid's own truth noise
   (:func:`truth_noise`, ``noise %``; JSON ``truth_noise_single`` / ``_multi``): how far
   a re-measurement of the grid would differ from this one on this host, the score of
   a perfect model — a run's MAPE is read against it.

Profiles and grid points are measured by one protocol (WARMUP + MEASURED steps,
median; ROUNDS rounds, the mean of the least disturbed half of them), and each round
shuffles the profiling tasks in among the grid points (fixed seed): on this shared VM a
core's speed drifts by 20-40% over seconds, and profiles taken in one burst would carry
one draw of that drift into every estimate (see ``measure``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import statistics
import sys
import time

from agent.runtime.heap import heap_mode
from tessera.perfmodel import (Candidate, ComputeSample, PerfModel, fit_comm, fit_compute, fit_interference,
                               fit_rank_interference)
from tessera.perfmodel.priors import CONF_TOLERANCE

DEVICE = "cpu"
LINK = "loopback-gloo"

# Models: name -> (layers, hidden, heads, vocab, seq_len). A and B are profiled.
MODELS = {
    "A": (2, 64, 4, 256, 64),
    "B": (4, 128, 4, 256, 64),
    "C": (3, 96, 4, 256, 64),      # unseen: between A and B
    "D": (6, 64, 4, 512, 128),     # unseen: deeper, larger vocab, longer context
    "E": (2, 192, 4, 256, 64),     # unseen: wider than anything profiled
    "F": (5, 80, 4, 256, 64),      # unseen: deeper than B, width between A and C
}
PROFILED = ("A", "B")

# (model, batch, seq, quota, micro_batches): profile points per module.
PROFILE_POINTS = [
    ("A", 4, 32, 1, 1), ("A", 16, 64, 1, 1), ("A", 32, 32, 1, 1), ("A", 8, 64, 1, 2),
    ("A", 8, 64, 1, 1), ("A", 8, 64, 2, 1),
    ("B", 2, 32, 1, 1), ("B", 8, 32, 1, 1), ("B", 8, 32, 1, 4), ("B", 4, 16, 1, 1), ("B", 4, 64, 1, 1),
    ("B", 4, 64, 2, 1),
]  # batch, seq, model size, micro-batches; each 2-core or several-micro-batch point right
# after its twin (the per-micro-batch cost at 2 and at 4 micro-batches: the grid runs both)
# (in one process, seconds apart: the quota's speed-up is not confounded with the
# host's drift, which decides the Amdahl fraction p for every estimate)
COLO_PROFILE = ("A", 8, 64)  # alone, with its twin, alone again: one run per mode (colocation_profile)
# Rank profiles (since 2026-12-07, sixteenth session): per round one short real run of a
# multi-rank plan over 2 gloo ranks on cores 0 and 1 (mode, model, batch, seq, plan,
# micro_batches), measured like a grid point; its g (tessera.perfmodel.
# fit_rank_interference) prices the multi-rank plans of its mode whose ranks share the
# CPU — since 2026-12-07's twenty-second session the mode of its plan: this pipeline's
# "pipeline" prices pp = 2 plans, and dp / tp plans are priced by their straggler wait
# (comm.CommFit.straggle) and the split pair's g (until then its "ranks" priced every
# multi-rank plan: dp / tp +3.7 / +8.5 % mean signed over the 15 AMD runs s27b-s32b). A rank
# computes slower beside its peers than the same work alone (a dp rank 1.08x, a pipeline
# stage 1.14-1.20x on the 2-vCPU host; the split pair of two independent jobs ~1.0x):
# every multi-rank category read 5-14 % low in the mean. One pipeline of the profiled
# module A (its two stages do A 8x64's work, a profile point), ~0.55 device-s a round;
# not a grid point (a unit test checks it). Tried in the first run (s27a): a second
# reference, A 16x32 at dp = 2, for a "ranks" mode of its own beside "pipeline" — its
# 9-ms steps were bimodal over the rounds (8.7-8.8 ms in 2 rounds, 12.8-15.9 in 7), its g
# read 0.37 where the pipeline's read 0.07 and every dp / tp row went +15-18 % high, and
# the two runs cost 1.1 device-s a round (cost ratio 9.4x).
RANK_PROFILES = [("pipeline", "A", 8, 64, {"pp": 2}, 1)]

# One protocol for profiles and grid points alike: WARMUP + MEASURED steps per run,
# ROUNDS runs at different times (interleaved); median step of a run, mean of the least
# disturbed half of the rounds (step_time). Warm-up: a fresh process's steps 2-4 are
# still ~5-10% slow (first-touch of its heap), where a profiling process's later points
# start warm.
WARMUP, MEASURED = 3, 5
# A profiling process's points after its first start warm (heap touched, allocator and
# kernels up): 2 warm-up steps there gave the same least-disturbed medians as 3 for
# all 12 points (within 0.3 %; 1 step: up to +1.2 %; 3 profiling runs, 2026-12-04),
# and save ~5 % of the profiles' device time.
WARM_WARMUP = 2
# Steps of the twin (after its warm-up) per mode: the window in which X's steps count as
# together. Time slicing quantises a shared core's steps (X's ran 20-32 ms where alone it
# ran 12): with the twin's MEASURED steps X measured 4 together steps, and one round's
# interference g scattered by sd 0.062 over 8 profiles (2026-12-05, sixth session); with
# 2 * MEASURED, 9-10 steps and sd 0.011 (mean 0.081 against 0.097). Every shared pair's
# estimate carries that scatter, and the median over 5 rounds did not remove it (run
# s17b: rows 0.015, 0.09, -0.036, 0.388, -0.017 -> g 0.015, the ten shared rows -1 ...
# -12 %). Split cores scatter less (sd 0.03-0.05) and hold two cores: MEASURED there.
COLO_TOGETHER = {"shared": 2 * MEASURED, "split": MEASURED}
# Rounds of profiles and grid alike (the profiles' device time grows with the grid's:
# the cost ratio stays). Five until 2026-12-06: on the noisy 2-vCPU AMD host the five
# 9-round runs s19f, s22a-d, re-fitted from 5 / 7 / 9 of their own rounds (the
# profiles, comm rows, colocation pairs and the grid's truth alike: ``python -m
# bench.estimator_refit --rounds K``), read single-device 7.41 / 6.12 / 5.35 % and
# multi-rank 10.34 / 9.24 / 8.76 %; the 26 quiet Intel runs s17a-s18x3 from 3 / 4 / 5
# of their 5 rounds 4.56 / 4.40 / 4.10 %. Both the truth and the profiles are means of a
# few disturbed draws; more rounds average more of them. A run takes ~1.7x as long
# (442-510 s for s22a-d). 18 since 2026-12-08 (twenty-third session): the three runs
# measured at 18 (AMD s32e, s32f; Intel s33e), re-fitted from 5 / 9 / 13 / all 18 of their
# rounds, read single-device 5.34 / 5.04 / 4.86 / 4.86, 7.56 / 6.01 / 5.34 / 4.81 and
# 4.38 / 3.98 / 3.83 / 3.78 %, multi-rank 7.94 / 6.30 / 5.51 / 4.83, 9.46 / 7.54 / 6.29 /
# 5.80 and 4.00 / 3.68 / 3.60 / 3.37 %: at 9 rounds the measurement's own noise was still
# 0.2-1.2 points of single-device and 0.3-1.7 of multi-rank MAPE. A run takes ~2x as
# long (s33e 753 s on the Intel host, s32e-f 719-830 s on the AMD one); it prints its
# progress after every round. ``--rounds 9`` is the previous protocol.
ROUNDS = 18
# Bootstrap resamples of a grid point's rounds for its truth noise (:func:`truth_noise`).
TRUTH_NOISE_BOOTS = 200
# A held-out colocated pair of unequal modules: each runs WARMUP + PAIR_MEASURED steps,
# so that the slower one still measures >= MEASURED steps (>= 2 up to a 2.6x speed
# ratio) before the faster one ends the window in which both run
# (bench._measure.run_jobs); with MEASURED each, the slower one's window held 0-2 steps.
PAIR_MEASURED = 2 * MEASURED
COMM_SIZES = [64 << 10, 512 << 10, 4 << 20]
# Only the ops the estimates price (tp / dp all-reduces, pipeline sends); all_gather and
# broadcast were ~half the comm profile's cost and priced nothing. Their time goes into
# more reps of the two that matter: a blocking op was bimodal here (0.3 ms or 3-4 ms
# until 2026-12-05, when gloo's loop threads went SCHED_BATCH: tessera.gloo), and 4 reps
# per size and round once caught only the fast mode (every tp estimate halved).
COMM_OPS = ("all_reduce", "send_recv")
# Each rep times the op alone after its compute chunk (profilerd.commbench), no
# compute-alone run beside it: 12 reps cost about what 8 did (16 took 1.0 device-s per
# round against 0.8). 8 since 2026-12-07 (sixteenth session), to make room for the rank
# profiles: a table took 0.94-1.04 device-s a round at 8 (runs s27b-d) against 1.32-1.47
# at 12 (s26a-c; the sync, resume and refill rows scale with the reps too).
COMM_REPS = 8

# Non-gpt workloads (estimated from their own step shape, tessera.perfmodel.workload):
# name -> (category, job manifest). Each is profiled like a profiling job of the
# controller (controller.profiling.profile_doc: the job's own workload, WARMUP +
# MEASURED steps, one device, quota 1) and held out as WARMUP + WORKLOAD_MEASURED-step runs at
# quotas WORKLOAD_QUOTAS (threads; cores 0..q-1). Model "A"-sized, a few steps each.
WORKLOAD_QUOTAS = (1, 2)
# Held-out runs: WARMUP + this many steps (the profile: WARMUP + MEASURED). Their step
# time depends on the data (variable-length LoRA tasks, a modality mix): over 12 steps
# one data draw (seed 1) of the temporal peft shape ran 7.7 ms where seeds 2-4 ran
# 6.9-7.1 ms (each the faster of 2 runs, 2026-12-05); over 24 steps the four draws
# spanned 6.8-7.1 ms. The truth is the job's step time, not one short draw's.
WORKLOAD_MEASURED = 24


def _tiny_model(vocab: int = 256) -> dict:
    layers, hidden, heads, _, seq_len = MODELS["A"]
    return {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "seq_len": seq_len}


WORKLOADS = {
    "peft-spatial": ("workload_peft", {
        "type": "peft", "model": _tiny_model(), "steps": 100, "batch_size": 8, "learning_rate": 0.01, "seed": 0,
        "peft": {"mode": "spatial", "chunk_size": 64, "tasks": [
            {"name": "t0", "rank": 8, "target_modules": ["qkv", "proj", "fc", "out"],
             "dataset": {"distribution": "longtail"}},
            {"name": "t1", "rank": 4, "target_modules": ["qkv", "proj"], "dataset": {"min_len": 16, "max_len": 48}},
            {"name": "t2", "rank": 16, "target_modules": ["fc", "out"], "batch_size": 2},
            {"name": "t3", "rank": 2, "target_modules": ["qkv", "out"], "dataset": {"min_len": 4, "max_len": 24}}]}}),
    "peft-temporal": ("workload_peft", {
        "type": "peft", "model": _tiny_model(), "steps": 100, "batch_size": 8, "learning_rate": 0.01, "seed": 0,
        "peft": {"mode": "temporal", "chunk_size": 64, "tasks": [
            {"name": "t0", "rank": 8, "target_modules": ["qkv", "proj", "fc", "out"],
             "dataset": {"distribution": "longtail"}},
            {"name": "t1", "rank": 4, "target_modules": ["qkv", "fc"], "dataset": {"max_len": 32}}]}}),
    "mm-colocated": ("workload_multimodal", {
        "type": "multimodal", "model": _tiny_model(vocab=128), "steps": 100, "batch_size": 8,
        "learning_rate": 0.003, "seed": 0,
        "multimodal": {"mode": "colocated", "micro_batches": 2, "image": {"size": 32, "patch": 8, "pool": 4},
                       "encoder": {"layers": 1, "hidden": 64, "heads": 4},
                       "audio": {"enabled": True, "frames": 32, "frame_dim": 16, "pool": 4},
                       "data": {"max_images": 2, "max_audio": 1, "min_text": 8, "max_text": 40},
                       "mix": [{"step": 0, "image_prob": 0.2, "audio_prob": 0.1},
                               {"step": 60, "image_prob": 0.8, "audio_prob": 0.3}],
                       "colocated": {"encoder_quota": 0.5}}}),
}


def workload_doc(name: str, steps: int | None = None) -> dict:
    """The validated (normalised) job manifest of workload shape ``name`` on one cpu
    device, ``steps`` steps (every peft task too) when given."""
    from tessera import manifest

    w = json.loads(json.dumps(WORKLOADS[name][1]))
    if steps is not None:
        w["steps"] = steps
        for t in (w.get("peft") or {}).get("tasks", ()):
            t.pop("steps", None)
    return manifest.validate({"apiVersion": manifest.API_VERSION, "name": "bench-" + name, "tenant": "bench",
                              "workload": w, "resources": {"devices": 1, "device_kind": DEVICE}})


def workload_profile(name: str) -> dict:
    """The workload of shape ``name``'s profiling job, as the controller submits it
    (``controller.profiling.profile_doc`` of the held-out job, WARMUP + MEASURED steps)."""
    from controller.profiling import profile_doc

    return profile_doc(workload_doc(name), WARMUP + MEASURED)[0]["workload"]


def workload_module(name: str) -> str:
    """The module key of shape ``name`` (``tessera.modelkey.shape_key`` on 1 device)."""
    from tessera.modelkey import shape_key

    return shape_key(workload_doc(name)["workload"], 1)


def workload_heldout(name: str) -> dict:
    """The workload of a held-out run of shape ``name``: the job's step shape (its
    modality schedule at its run mean, as the profile) for WARMUP + WORKLOAD_MEASURED
    steps with another seed (other data than the profile's); filed under the same
    ``shape_key`` (checked)."""
    from tessera.modelkey import shape_key

    w = json.loads(json.dumps(workload_profile(name)))
    w.update(steps=WARMUP + WORKLOAD_MEASURED, checkpoint_every=0, seed=1)
    for t in (w.get("peft") or {}).get("tasks", ()):
        t["steps"] = w["steps"]
    if shape_key(w, 1) != workload_module(name):
        raise AssertionError(f"held-out run of {name} is not filed under the job's shape key")
    return w


def workload_job(name: str, q: int) -> dict:
    """A grid job of workload shape ``name`` at quota ``q`` (q threads on cores 0..q-1)."""
    w = workload_doc(name)["workload"]
    return {"shape": name, "type": w["type"], "module": workload_module(name), "model": name,
            "batch": w["batch_size"], "seq": w["model"]["seq_len"], "q": q, "m": w["plan"]["micro_batches"],
            "plan": {}, "cores": [list(range(q))]}


def workload_points(name: str, runs: list[list[float]]) -> list:
    """Profile points (``tessera.perfmodel.ProfilePoint``) of shape ``name`` from its
    profiling runs (per-step times, one list per round), through the estimator's own
    path: each step is a measurement labelled as the agent labels it
    (``tessera.modelkey.profile_labels`` of the profiling job's runtime spec), keyed by
    ``estimator.models.run_key`` and reduced by ``estimator.models.profiles`` (for these
    workloads the mean step after its warm-up steps). Like the gpt profiles, its seconds
    are :func:`step_time` of the rounds' values (its spread and steps: the least
    disturbed round's)."""
    from types import SimpleNamespace

    from estimator.models import profiles, run_key
    from tessera.modelkey import profile_labels

    spec = {"workload": workload_profile(name), "threads": 1, "dist": {"rank": 0, "world_size": 1},
            "profiling": True}  # as the controller launches a profiling job (controller.core._launch)
    labels = {**profile_labels(spec, DEVICE), "rank": "0"}
    got = []
    for r, steps in enumerate(runs):
        per_run: dict[tuple, dict[int, float]] = {}
        for k, t in enumerate(steps):
            key = run_key(SimpleNamespace(job_id=f"bench-profile-{name}-{r}", labels=labels, step_time_s=t))
            if key is None:
                raise AssertionError(f"the estimator takes no profile from {name}'s steps (labels {labels})")
            per_run.setdefault(key, {})[k + 1] = t
        got += profiles(per_run)[:1]
    if not got:
        return []
    best = min(got, key=lambda p: p.median_s).point()
    return [dataclasses.replace(best, seconds=step_time([p.median_s for p in got]))]


def model_dict(name: str) -> dict:
    layers, hidden, heads, vocab, seq_len = MODELS[name]
    return {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "seq_len": seq_len}


def grid(quick: bool) -> list[dict]:
    """Held-out configurations; each: category, jobs (model, batch, seq, plan, cores)."""
    g: list[dict] = []

    def single(cat, model, batch, seq, q=1, m=1):
        g.append({"category": cat, "jobs": [{"model": model, "batch": batch, "seq": seq, "q": q, "m": m,
                                             "plan": {}, "cores": [list(range(q))]}]})

    for b, s in [(8, 48), (24, 64), (12, 16), (2, 64), (48, 32), (4, 64), (16, 32), (32, 16)]:
        single("single_batch_seq", "A", b, s)
    for b, s in [(12, 64), (16, 48), (2, 64), (6, 16), (24, 32), (4, 32), (12, 16), (8, 48)]:
        single("single_batch_seq", "B", b, s)
    for name, pts in {"C": [(8, 64), (4, 32), (16, 48), (12, 32)], "D": [(4, 128), (8, 64), (2, 96), (4, 64)],
                      "E": [(8, 64), (4, 32), (16, 32), (8, 32)], "F": [(8, 64), (4, 32), (16, 48)]}.items():
        for b, s in pts:
            single("single_model_size", name, b, s)
    for name, b, s in [("A", 16, 64), ("B", 8, 64), ("C", 8, 64), ("E", 8, 48), ("B", 16, 32), ("D", 8, 64),
                       ("A", 32, 48), ("E", 4, 64), ("C", 16, 32), ("F", 8, 64)]:
        single("single_quota2", name, b, s, q=2)
    for name, b, s, m in [("A", 16, 64, 4), ("B", 16, 64, 4), ("C", 8, 64, 2), ("D", 8, 64, 2), ("E", 8, 32, 4),
                          ("A", 32, 32, 4), ("B", 8, 64, 2), ("C", 16, 48, 4), ("E", 16, 32, 2), ("D", 4, 128, 2)]:
        single("single_microbatch", name, b, s, m=m)
    for mode, cores in (("colocate_shared", [[0], [0]]), ("colocate_split", [[0], [1]])):
        for (m1, b1, s1), (m2, b2, s2) in [(("A", 16, 64), ("B", 4, 64)), (("C", 8, 64), ("C", 8, 64)),
                                           (("B", 8, 32), ("E", 4, 64)), (("D", 4, 64), ("A", 8, 32)),
                                           (("E", 8, 32), ("C", 4, 64))]:
            g.append({"category": mode, "jobs": [
                {"model": m1, "batch": b1, "seq": s1, "q": 1, "m": 1, "plan": {}, "cores": [cores[0]]},
                {"model": m2, "batch": b2, "seq": s2, "q": 1, "m": 1, "plan": {}, "cores": [cores[1]]}]})

    for name in WORKLOADS:
        for q in WORKLOAD_QUOTAS:
            g.append({"category": WORKLOADS[name][0], "jobs": [workload_job(name, q)]})

    def multi(cat, model, batch, seq, dp=1, tp=1, pp=1, m=1):
        g.append({"category": cat, "jobs": [{"model": model, "batch": batch, "seq": seq, "q": 1, "m": m,
                                             "plan": {"dp": dp, "tp": tp, "pp": pp, "micro_batches": m},
                                             "cores": [[0], [1]]}]})

    for name, b, s in [("A", 16, 64), ("B", 8, 64), ("C", 16, 32), ("D", 8, 64), ("E", 8, 64), ("A", 32, 32),
                       ("B", 4, 64), ("C", 8, 64), ("F", 8, 64)]:
        multi("multi_dp2", name, b, s, dp=2)
    # Data parallelism with gradient accumulation (each replica runs m micro-batches,
    # then one bucketed all-reduce): the composition no dp point above tested.
    for name, b, s, m in [("B", 16, 64, 2), ("D", 16, 64, 2), ("F", 16, 32, 4)]:
        multi("multi_dp2", name, b, s, dp=2, m=m)
    for name, b, s, m in [("A", 16, 64, 1), ("A", 16, 64, 4), ("B", 8, 64, 2), ("C", 16, 64, 4), ("D", 8, 96, 4),
                          ("E", 8, 64, 2), ("B", 16, 32, 4), ("E", 16, 32, 4), ("D", 4, 64, 2), ("F", 8, 64, 2)]:
        multi("multi_pp2", name, b, s, pp=2, m=m)
    for name, b, s in [("A", 16, 64), ("B", 8, 64), ("E", 8, 32), ("C", 8, 64), ("D", 4, 64), ("F", 8, 32),
                       ("C", 16, 32)]:
        multi("multi_tp2", name, b, s, tp=2)
    if quick:
        # Two points per category keep every category in the table.
        kept: dict[str, list[dict]] = {}
        for x in g:
            kept.setdefault(x["category"], []).append(x)
        g = [x for xs in kept.values() for x in xs[:2]]
    random.Random(7).shuffle(g)
    return g


def candidate(job: dict, colocated: int = 1, oversub: float = 1.0) -> Candidate:
    if job.get("shape"):  # a peft / multimodal job: estimated from its own step shape's profiles
        md = workload_doc(job["shape"])["workload"]["model"]
        return Candidate(device_type=DEVICE, layers=md["layers"], hidden=md["hidden"], heads=md["heads"],
                         vocab=md["vocab"], seq_len=md["seq_len"], batch=job["batch"], seq=job["seq"],
                         micro_batches=job["m"], quota=job["q"], link=LINK, module=job["module"],
                         colocated=colocated, oversubscription=oversub)
    layers, hidden, heads, vocab, seq_len = MODELS[job["model"]]
    p = job["plan"]
    world = p.get("dp", 1) * p.get("tp", 1) * p.get("pp", 1)
    if world > 1 and colocated == 1:
        # The ranks share this one CPU, each on its own core: colocated with each other —
        # a pp = 2 plan priced by the rank profile's mode "pipeline", a dp / tp plan by the
        # split pair's g (tessera.perfmodel.interference_mode; a run stored before rank
        # profiles: "split" for all, like two jobs on cores 0 and 1).
        colocated = world
    return Candidate(device_type=DEVICE, layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len,
                     batch=job["batch"], seq=job["seq"], dp=p.get("dp", 1), tp=p.get("tp", 1), pp=p.get("pp", 1),
                     micro_batches=job["m"], quota=job["q"], link=LINK, module=job["model"],
                     colocated=colocated, oversubscription=oversub)


def workload(model: str, batch: int, seq: int, m: int, steps: int, plan: dict | None = None) -> dict:
    md = model_dict(model)
    # The runtime trains on seq_len tokens: a shorter sequence is a model with a
    # shorter context (same weights shape apart from the position table).
    md["seq_len"] = seq
    return {"model": md, "batch_size": batch, "steps": steps,
            "plan": {"dp": 1, "tp": 1, "pp": 1, "micro_batches": m, **(plan or {})}}


def _profile_tasks(workloads: bool = False) -> list[tuple]:
    """The cheap profiles of one round: one profiling process (every point of both
    modules, each on its quota), the colocation profile (per mode, one module alone,
    beside its twin, alone again), the communication micro-benchmark and the rank
    profiles (``RANK_PROFILES``: one short 2-rank run each); with ``workloads`` the
    profiling runs of the peft / multimodal shapes of the grid (one fresh process each,
    as the controller's profiling jobs)."""
    return [("prof",), ("colo",), ("comm",), ("ranks",)] + ([("wprof",)] if workloads else [])


def _workload_child(spec: dict, cores: list[int], path: str) -> None:
    """A forked executor of a peft / multimodal spec pinned to ``cores``: per ``progress``
    event of the workload's step (``module`` = its type) a stamp (``bench._measure._stamp``:
    wall, CPU, every thread's on-CPU time and wait) and the step's ``step_time_s``."""
    code = 1
    gc.freeze()  # what the fork inherited is never collected here (agent.runtime.parallel.launch._rank_main)
    try:
        import torch

        from agent.runtime.__main__ import resolve
        from agent.runtime.report import Reporter
        from bench._measure import _stamp, dump_on_timeout
        from tessera.log import quiet

        # The runners' info lines (task added / ended) would flood the table's terminal.
        quiet()
        dump_on_timeout()
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(int(spec["threads"]))
        wtype = spec["workload"]["type"]
        rec: dict = {"stamps": [_stamp()], "step_s": [], "errors": []}

        class Capture(Reporter):
            def event(self, kind: str, **fields) -> None:
                if kind == "progress" and fields.get("module") == wtype:
                    rec["stamps"].append(_stamp())
                    rec["step_s"].append(float(fields["step_time_s"]))
                elif kind == "error":
                    rec["errors"].append(str(fields.get("message")))

        code = int(resolve(wtype)(spec, Capture(stream=open(os.devnull, "w"))))
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rec, f)
    finally:
        os._exit(code)


def run_workload(workload: dict, cores: list[int], warmup: int, timeout_s: float = 300.0) -> dict:
    """One real run of a peft / multimodal workload (``agent.runtime``'s runner for its
    type, a forked process pinned to ``cores``, ``threads`` = one per core; rank 0 of 1,
    no checkpoints). Returns as ``bench._measure.run_jobs`` per job: ``step_s`` (median
    after ``warmup`` steps of each step's ``step_time_s`` less the run-queue wait other
    tenants caused during it), ``wall_s`` (median raw ``step_time_s``), ``cpu_util``,
    ``steps`` (every step's corrected time, warm-up included), ``raw_steps`` (measured
    steps, raw), ``device_s`` (the run's wall time times its cores).

    The wait of a step is, as for a gpt run, ``bench._measure.foreign_wait``: the
    largest over the process's threads less what its own other threads ran (a
    colocated multimodal step's encoder and LLM workers share a core at quota 1 by
    design: waiting on each other is the configuration, not noise)."""
    import multiprocessing as mp
    import tempfile

    from bench._measure import _join, _series, less_wait, step_faults, step_waits

    ctx = mp.get_context("fork")
    spec = {"job_id": "bench-" + workload["type"], "workload": workload, "threads": len(cores),
            "checkpoint_dir": None, "dist": {"rank": 0, "world_size": 1}}
    t_begin = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-wl-") as tmp:
        path = os.path.join(tmp, "run")
        p = ctx.Process(target=_workload_child, args=(spec, list(cores), path), daemon=True)
        p.start()
        _join([p], timeout_s, [workload["type"]])
        rec = json.load(open(path, encoding="utf-8"))
    wall = time.monotonic() - t_begin
    if rec["errors"] or len(rec["step_s"]) <= warmup:
        raise RuntimeError(f"{workload['type']} run: {len(rec['step_s'])} steps, errors {rec['errors']}")
    series = _series(rec["stamps"])
    t, cpu = series[:2]
    corr, util = [], []
    for k, raw in enumerate(rec["step_s"]):
        corr.append(less_wait(raw, step_waits(series, float(t[k]), float(t[k + 1]))))
        util.append(float(cpu[k + 1] - cpu[k]) / max(float(t[k + 1] - t[k]), 1e-9))
    return {"step_s": statistics.median(corr[warmup:]), "wall_s": statistics.median(rec["step_s"][warmup:]),
            "cpu_util": statistics.median(util[warmup:]), "steps": corr, "raw_steps": rec["step_s"][warmup:],
            "device_s": wall * len(cores), "faults": step_faults(rec["stamps"], warmup)}


def point_key(point: tuple) -> str:
    """A profile point's key in the JSON's ``profile_rounds`` / ``profile_mb_frac_rounds``:
    its (model, batch, seq, quota, micro_batches) joined by "/" (e.g. "A/4/32/1/1")."""
    return "/".join(map(str, point))


def kept_rounds(rounds: list[float]) -> list[int]:
    """Indices of the rounds a point keeps: the least disturbed half (rounded up), by
    their values. The host's disturbances (other tenants, other VMs sharing the
    physical core's caches) only ever slow a run down and come and go over seconds."""
    n = (len(rounds) + 1) // 2
    return sorted(range(len(rounds)), key=lambda k: rounds[k])[:n]


def step_time(rounds: list[float]) -> float:
    """The statistic of a point, profiles and grid alike: the median step of each
    round's run, then the mean of the least disturbed half of the rounds
    (:func:`kept_rounds`; 3 of 5). Within a run the median keeps the configuration's
    own step-to-step variation (time slicing of a shared core, a 2-thread quota) that a
    lower quantile would cut away. Across rounds, the least disturbed one alone (the
    statistic until 2026-12-05) is the extreme of five draws: re-computed from the
    per-round values of the 26 stored runs s14i-s16j, profiles and grid alike, the mean
    of the three least disturbed took the gpt single-device rows (colocated pairs aside:
    those runs kept no per-job rounds) from 4.52 to 4.21 % MAPE (<= 4 % in 9 -> 14 runs),
    multi-rank 5.15 -> 5.11, peft / multimodal 6.99 -> 7.03, with the same model; better
    in 15 of the 17 runs since s15a, worse in 6 of the 9 older ones."""
    return float(statistics.fmean(rounds[k] for k in kept_rounds(rounds)))


def grid_values(job_rounds: list[tuple]) -> dict:
    """A grid point's ``measured`` and ``raw`` per job from its rounds (``job_rounds``:
    per round, (step times, raw times) of its jobs): the mean over the kept rounds
    (:func:`kept_rounds` of ``rounds``, each round's step times summed — a colocated
    pair's rounds are kept or dropped as a whole: its two times belong together)."""
    sums = [sum(steps) for steps, _ in job_rounds]
    keep = kept_rounds(sums)
    jobs = len(job_rounds[0][0])
    return {"measured": [statistics.fmean(job_rounds[k][0][j] for k in keep) for j in range(jobs)],
            "raw": [statistics.fmean(job_rounds[k][1][j] for k in keep) for j in range(jobs)], "rounds": sums}


def _resampled(job_rounds: list, boots: int, seed: int) -> list[list[float]] | None:
    """Per bootstrap resample of a point's rounds (drawn with replacement; ``boots`` of
    them, deterministic for ``seed``): per job, ``grid_values(resample) /
    grid_values(rounds) - 1``. None with fewer than 2 rounds (nothing to resample)."""
    if len(job_rounds) < 2:
        return None
    rng = random.Random(seed)
    full = grid_values(job_rounds)["measured"]
    return [[b / f - 1.0 for b, f in zip(grid_values([job_rounds[rng.randrange(len(job_rounds))]
                                                       for _ in job_rounds])["measured"], full)]
            for _ in range(boots)]


def truth_noise(job_rounds: list, boots: int = TRUTH_NOISE_BOOTS, seed: int = 0) -> list[float] | None:
    """How reproducible a grid point's measured value is, per job (percent): the mean
    over ``boots`` bootstrap resamples of its rounds of ``|grid_values(resample) -
    grid_values(rounds)| / grid_values(rounds)``. It is the error a perfect model would
    score against this run's truth from the host's noise alone (about what a
    re-measurement of the point would differ by), so that a run's MAPE can be read
    against its host: the grid's single-device rows read 1.3-3.2 % on the Intel hosts of
    the 2026-12-05/06 runs s17a-s18x3 and 3.5-5.6 % on the AMD host of s19a-f
    (``bench.estimator_refit``). None with one round."""
    devs = _resampled(job_rounds, boots, seed)
    if devs is None:
        return None
    return [100.0 * sum(abs(d[j]) for d in devs) / boots for j in range(len(devs[0]))]


def measurement_spread(rounds: list[float], boots: int = TRUTH_NOISE_BOOTS, seed: int = 0) -> float:
    """A profile point's ``ComputeSample.spread``: the relative sd of its value
    (:func:`step_time` of ``rounds``) over bootstrap resamples of the rounds — how far
    another measurement by this protocol would land. 0 with one round (not known)."""
    devs = _resampled([([x], [x]) for x in rounds], boots, seed)
    return math.sqrt(sum(d[0] ** 2 for d in devs) / boots) if devs else 0.0


def point_stats(rounds: list[float], mb_fracs: list[float | None]) -> dict:
    """A profile point's measured fields of its ``ComputeSample`` from its rounds (median
    step of each round's run) and each round's forward + backward share of the step (None
    where a round did not measure it): ``seconds`` (:func:`step_time`), ``mb_seconds``
    (``seconds`` times the mean share over the kept rounds that measured it; 0 when none
    did) and ``spread`` (:func:`measurement_spread`)."""
    sec = step_time(rounds)
    fracs = [mb_fracs[k] for k in kept_rounds(rounds) if mb_fracs[k]]
    frac = statistics.fmean(fracs) if fracs else 0.0
    return {"seconds": sec, "mb_seconds": sec * frac if frac else 0.0, "spread": measurement_spread(rounds)}


def comm_kept(rows: list[dict]) -> list[dict]:
    """The comm rows the model is fitted from (all rounds' rows in, the JSON keeps them
    all): of each (op, world, bytes) of an op's table, the rows of the least disturbed
    half of the rounds (:func:`kept_rounds`, as for every profile and grid point); the
    sync and resume rows all (their fit is relative, over chunk lengths). Each row is
    already the mean of ``COMM_REPS`` calls, so an op that is bimodal call by call
    (``profilerd.commbench``) is priced by its mean within a round; what the rounds
    differ by is the host: in run s22b two of nine rounds ran a 64 KiB all-reduce in
    2.0 and 3.1 ms where the other seven took 0.38-0.69 ms, and the mean over all nine
    set the all-reduce latency to 0.49 ms (every tp = 2 plan +19-55 %). Until
    2026-12-06 every round's rows were fitted (the least disturbed *one* round, before
    that, kept only the fast mode: every multi-rank estimate ~1-2 ms short). Re-fitted
    over the stored runs (``bench.estimator_refit``): multi-rank 4.56 -> 4.49 % on the 26
    Intel runs s17a-s18x3, 10.26 -> 9.85 % on the 20 AMD runs s19a-s22b (multi_tp2 12.06
    -> 9.31; multi_pp2 9.92 -> 10.52, 5.18 -> 5.41)."""
    by: dict[tuple, list[dict]] = {}
    out = []
    for r in rows:
        if r["op"] in COMM_OPS:
            by.setdefault((r["op"], r["world"], r["bytes"]), []).append(r)
        else:
            out.append(r)
    for rs in by.values():
        out += [rs[k] for k in sorted(kept_rounds([float(r["seconds"]) for r in rs]))]
    return out


def fit_model(samples: list[ComputeSample], comm_rows: list[dict], pairs: list[dict], wpoints: list,
              interference_ref: dict, rank_profiles: list[dict] | None = None) -> PerfModel:
    """The model the benchmark fits from its profiles — :func:`measure`'s, and every re-fit
    of a stored run (``bench.estimator_refit``): the compute curve from ``samples``, the
    comm table from ``comm_rows`` (:func:`comm_kept`), interference from the colocation
    ``pairs``, the peft / multimodal points ``wpoints`` as they are; ``interference_ref``
    (device type -> the pair module's shape) as given; then the rank modes' interference
    from ``rank_profiles`` (JSON ``rank_profiles``: per reference ``mode``, ``job`` and its
    ``rounds``; its time is :func:`step_time` of them, as for any point) against that
    model (``tessera.perfmodel.fit_rank_interference``). Runs stored before the rank
    profiles have none: their multi-rank plans take the split pair's g, as they did."""
    model = PerfModel(version=1, compute={DEVICE: fit_compute(DEVICE, samples)},
                      comm={LINK: fit_comm(LINK, comm_kept(comm_rows))}, interference={DEVICE: fit_interference(pairs)},
                      interference_ref=interference_ref, profiles={DEVICE: wpoints} if wpoints else {})
    return with_rank_profiles(model, rank_profiles)


def with_rank_profiles(model: PerfModel, rank_profiles: list[dict] | None) -> PerfModel:
    """``model`` with the rank modes' interference fitted from ``rank_profiles`` (JSON
    ``rank_profiles``; a reference's time is :func:`step_time` of its rounds, leaving out a
    round whose runs failed — None, ``rank_skipped``) against ``model``'s own terms
    (``tessera.perfmodel.fit_rank_interference``); ``model`` as it is without any."""
    rows = [{"mode": r["mode"], "candidate": dataclasses.asdict(candidate(r["job"])), "seconds": step_time(got)}
            for r in rank_profiles or [] for got in [[x for x in r["rounds"] if x is not None]] if got]
    gs = fit_rank_interference(model, rows)
    if not gs:
        return model
    return dataclasses.replace(model, interference={**model.interference, **{
        dev: {**model.interference.get(dev, {}), **g} for dev, g in gs.items()}})


def rank_profile_jobs() -> list[tuple[str, dict]]:
    """(mode, job) of each rank profile (``RANK_PROFILES``), jobs as in :func:`grid`: two
    ranks of one core each, cores 0 and 1."""
    return [(mode, {"model": n, "batch": b, "seq": s, "q": 1, "m": m, "plan": {**plan, "micro_batches": m},
                    "cores": [[0], [1]]}) for mode, n, b, s, plan, m in RANK_PROFILES]


def cores_held(jobs: list[dict]) -> int:
    """How many distinct cores ``jobs`` (each with ``cores``: one core list per rank)
    hold together: the device-seconds of a run are its wall time times these."""
    return len({c for j in jobs for rc in j["cores"] for c in rc})


def profile_with_retry(call, held: int, pcost: dict, key: str, what: str, tries: int = 2,
                       device_s=lambda res: res["device_s"]):
    """``call()`` (a run of a profile or of a grid point), tried again when it raises
    RuntimeError (a run that got too few steps or whose process failed, e.g. under a
    burst of other work on the host) — one failed run no longer ends a 9-minute
    benchmark. Every attempt's device time counts in ``pcost[key]``: a successful one's
    ``device_s(result)`` (default: its ``device_s``), a failed one's wall time times the
    ``held`` cores; the last attempt's error propagates."""
    for attempt in range(tries):
        t0 = time.monotonic()
        try:
            res = call()
        except RuntimeError as e:
            pcost[key] += (time.monotonic() - t0) * held
            if attempt + 1 >= tries:
                raise
            print(f"{what} failed ({e}); trying again", file=sys.stderr)
            continue
        pcost[key] += device_s(res)
        return res
    raise ValueError(f"tries: {tries}, expected >= 1")


def round_progress(r: int, rounds: int, elapsed_s: float, cost: dict) -> str:
    """The progress line printed (stderr) after round ``r`` (0-based) of ``rounds``:
    rounds done, wall time so far, the time left at this pace, and the round's
    device-seconds of profiles and of the grid (``cost``: one ``cost_rounds`` entry)."""
    done = r + 1
    left = elapsed_s / done * (rounds - done)
    prof = sum(v for k, v in cost.items() if k != "grid")
    return (f"round {done}/{rounds} done: {elapsed_s:.0f} s so far, ~{left / 60:.1f} min left; this round "
            f"{prof:.1f} device-s of profiles, {cost.get('grid', 0.0):.1f} of grid")


def colocation_with_retry(profile, wl: dict, cores: list[list[int]], pcost: dict, tries: int = 2,
                          **kw) -> dict:
    """``profile(wl, cores, WARMUP, MEASURED, **kw)`` (bench._measure.colocation_profile)
    through :func:`profile_with_retry`: too few alone or together steps (the twin ran
    more than 2x slower than planned) is tried again; device time in
    ``pcost["colocation"]``."""
    held = len(set(cores[0]) | set(cores[1]))
    return profile_with_retry(lambda: profile(wl, cores, WARMUP, MEASURED, **kw), held, pcost, "colocation",
                              f"colocation profile on cores {cores}", tries)


def rank_profile_or_skip(run, job: dict, wl: dict, pcost: dict, skipped: list[dict], r: int) -> float | None:
    """One round's run of a rank profile (``run`` = bench._measure.run_jobs on ``wl`` over
    ``job``'s cores) through :func:`profile_with_retry` (device time in ``pcost["ranks"]``):
    its step time, or None when every try failed — that round then has no value of this
    rank profile (``skipped`` gets ``{"plan", "round", "error"}``, JSON ``rank_skipped``;
    :func:`with_rank_profiles` uses the other rounds) rather than the whole run ending."""
    held = cores_held([job])
    res = _or_skip(lambda: profile_with_retry(lambda: run([{"workload": wl, "cores": job["cores"]}], WARMUP)[0],
                                              held, pcost, "ranks", f"rank profile {job['plan']}"),
                   skipped, {"plan": job["plan"], "round": r}, f"rank profile ({job['plan']}, round {r})")
    return None if res is None else res["step_s"]


def _or_skip(call, skipped: list[dict], entry: dict, what: str) -> dict | None:
    """``call()``, or None when it raises RuntimeError (every try of a profile failed):
    ``skipped`` gets ``entry`` with the ``error``, and the run goes on without it."""
    try:
        return call()
    except RuntimeError as e:
        print(f"{what} skipped: {e}", file=sys.stderr)
        skipped.append({**entry, "error": str(e)})
        return None


def colocation_or_skip(profile, wl: dict, cores: list[list[int]], pcost: dict, skipped: list[dict], mode: str,
                       r: int, **kw) -> dict | None:
    """:func:`colocation_with_retry`, or None when every try failed (a long burst of other
    work on the host): that round then has no pair of this ``mode`` — its device time is
    counted, the fit uses the other rounds' pairs, ``skipped`` gets ``{"mode", "round",
    "error"}`` (JSON ``colocation_skipped``) — rather than the whole run ending on it."""
    return _or_skip(lambda: colocation_with_retry(profile, wl, cores, pcost, **kw), skipped,
                    {"mode": mode, "round": r}, f"colocation profile ({mode}, round {r})")


def measure(points: list[dict], rounds: int) -> tuple[PerfModel, dict, list[dict], float]:
    """Profiles and held-out grid, measured the same way and interleaved in time.

    Every profile point and every grid point is a run of the runtime with the same
    warm-up and measured steps (other tenants' run-queue wait subtracted per step),
    repeated in ``rounds`` rounds; its value is :func:`step_time` of its rounds.
    Within a round the profiling process, the colocation profile and the comm
    micro-benchmark are shuffled in among the grid points (fixed seed), so that
    profiles and grid see the same host: on this shared 2-core VM a core's speed
    drifts by 20-40% over seconds, and profiles measured in one burst inherit one draw
    of that drift for the whole fit. Only the profiles are fitted; the grid is only
    compared against.

    Returns (model, profile info with cost, measured grid points, grid device-seconds).
    """
    from bench._measure import colocation_profile, comm_table, profile_points, run_jobs

    steps = WARMUP + MEASURED
    pcost = {"compute": 0.0, "colocation": 0.0, "comm": 0.0, "ranks": 0.0}
    rank_jobs = rank_profile_jobs()
    rank_rounds: list[list[float | None]] = [[] for _ in rank_jobs]  # per reference: its step time per round
    rank_skipped: list[dict] = []  # rounds whose rank profile failed twice (JSON ``rank_skipped``)
    # peft / multimodal shapes of the grid: one profiling run each per round.
    shapes = list(dict.fromkeys(j["shape"] for pt in points for j in pt["jobs"] if j.get("shape")))
    wprof: dict[str, list[list[float]]] = {name: [] for name in shapes}
    wall_wl = 0.0  # wall time of the peft / multimodal runs (profiles and grid)
    if shapes:
        from agent.runtime.__main__ import resolve

        pcost["workload"] = 0.0
        for wt in {WORKLOADS[name][1]["type"] for name in shapes}:
            resolve(wt)  # imported once here: no forked run counts the import as device time
    alone: dict[tuple, list[float]] = {}
    alone_fb: dict[tuple, list[float | None]] = {}  # per round: forward + backward share of the step
    alone_faults: dict[tuple, list[float | None]] = {}  # per round: minor page faults per measured step
    pairs: list[dict] = []  # one colocation row per mode and round; fit_interference takes the median g
    # Per colocation profile, X's and its twin's step boundaries (not a model input: kept in
    # the JSON, ``colocation_steps``, to read how two busy cores' steps slow together).
    colo_steps: list[dict] = []
    colo_skipped: list[dict] = []  # rounds whose colocation profile failed twice (JSON ``colocation_skipped``)
    comm_runs: list[list[dict]] = []
    gcost = {"grid": 0.0}  # device-seconds of the grid's runs, failed attempts included
    job_rounds: list[list[tuple]] = [[] for _ in points]  # per round: (step times, raw times) of its jobs
    faults: list[list[list]] = [[] for _ in points]  # per round: minor page faults per measured step of its jobs
    util: list[list[float]] = [[] for _ in points]
    colo = {"shared": [[0], [0]], "split": [[0], [1]]}
    n, b, s_ = COLO_PROFILE
    # Per round, the device-seconds of each kind of profile and of the grid (JSON
    # ``cost_rounds``): a cost ratio that moves between runs says which run of which round.
    cost_rounds: list[dict] = []

    def totals() -> dict:
        return {**pcost, "grid": gcost["grid"]}

    t_rounds = time.monotonic()
    for r in range(rounds):
        tasks = [("grid", i) for i in range(len(points))] + _profile_tasks(bool(shapes))
        random.Random(100 + r).shuffle(tasks)
        before = totals()
        for task in tasks:
            t_task = time.monotonic()
            if task[0] == "prof":
                pts = PROFILE_POINTS
                warm = [WARMUP] + [WARM_WARMUP] * (len(pts) - 1)
                runs = [(workload(pn, pb, ps, pm, w + MEASURED), list(range(int(pq))))
                        for (pn, pb, ps, pq, pm), w in zip(pts, warm)]
                meds, _ = profile_with_retry(lambda: profile_points(runs, warm), max(len(c) for _, c in runs),
                                             pcost, "compute", f"profile points (round {r})",
                                             device_s=lambda res: res[1])
                for pt, x in zip(pts, meds):
                    alone.setdefault(pt, []).append(x["step_s"])
                    alone_fb.setdefault(pt, []).append(x.get("mb_frac"))
                    alone_faults.setdefault(pt, []).append(x.get("faults"))
            elif task[0] == "colo":
                # Alone and together in one process, seconds apart (bench._measure.
                # colocation_profile): the ratio is the interference, not the drift of
                # the host between two runs (which the old alone-then-pair runs measured).
                for mode in ("shared", "split"):
                    res = colocation_or_skip(colocation_profile, workload(n, b, s_, 1, steps), colo[mode], pcost,
                                             colo_skipped, mode, r, together=COLO_TOGETHER[mode])
                    if res is None:
                        continue
                    pairs.append({"mode": mode, "colocated": 2, "oversubscription": 2.0 if mode == "shared" else 1.0,
                                  "alone_s": res["alone_s"], "together_s": res["together_s"], "round": r})
                    colo_steps.append({"mode": mode, "round": r, "x_t": res["x_t"], "y_t": res["y_t"]})
            elif task[0] == "wprof":
                # The controller's profiling job of each shape: its own workload, WARMUP +
                # MEASURED steps, quota 1, a fresh process.
                for name in shapes:
                    res = profile_with_retry(lambda: run_workload(workload_profile(name), [0], WARMUP), 1, pcost,
                                             "workload", f"{name} profile (round {r})")
                    wprof[name].append(res["steps"])
            elif task[0] == "ranks":
                # A multi-rank plan's ranks beside each other, measured like a grid point
                # (None for a round whose runs failed twice: rank_skipped).
                for k, (_, j) in enumerate(rank_jobs):
                    rank_rounds[k].append(rank_profile_or_skip(
                        run_jobs, j, workload(j["model"], j["batch"], j["seq"], j["m"], steps, j["plan"]), pcost,
                        rank_skipped, r))
            elif task[0] == "comm":
                rows, _ = profile_with_retry(lambda: comm_table(sizes=COMM_SIZES, reps=COMM_REPS, ops=COMM_OPS), 2,
                                             pcost, "comm", f"comm table (round {r})", device_s=lambda res: res[1])
                comm_runs.append(rows)
            else:
                i = task[1]
                pj = points[i]["jobs"]
                if pj[0].get("shape"):
                    def call():
                        return [run_workload(workload_heldout(pj[0]["shape"]), pj[0]["cores"][0], WARMUP)]
                else:
                    n_steps = steps if len(pj) == 1 else WARMUP + PAIR_MEASURED
                    jobs = [{"workload": workload(j["model"], j["batch"], j["seq"], j["m"], n_steps, j["plan"]),
                             "cores": j["cores"]} for j in pj]

                    def call():
                        return run_jobs(jobs, WARMUP)
                res = profile_with_retry(call, cores_held(pj), gcost, "grid", f"grid point {i} ({points[i]['category']}, "
                                         f"round {r})", device_s=lambda rs: sum(x["device_s"] for x in rs))
                job_rounds[i].append(([x["step_s"] for x in res], [x["wall_s"] for x in res]))
                faults[i].append([x.get("faults") for x in res])
                util[i] += [x["cpu_util"] for x in res if x["cpu_util"] is not None]
            if task[0] == "wprof" or (task[0] == "grid" and points[task[1]]["jobs"][0].get("shape")):
                wall_wl += time.monotonic() - t_task
        cost_rounds.append({k: round(v - before.get(k, 0.0), 4) for k, v in totals().items()})
        print(round_progress(r, rounds, time.monotonic() - t_rounds, cost_rounds[-1]), file=sys.stderr, flush=True)
    samples = []
    for (pn, pb, ps, pq, pm), ts in alone.items():
        layers, hidden, heads, vocab, _ = MODELS[pn]
        samples.append(ComputeSample(module=pn, rows=pb, seq=ps, layers=layers, hidden=hidden, heads=heads,
                                     vocab=vocab, q=pq, micro_batches=pm, seq_len=ps,
                                     **point_stats(ts, alone_fb[(pn, pb, ps, pq, pm)])))
    comm_rows = [row for run in comm_runs for row in run]
    wpoints = [pt for name in shapes for pt in workload_points(name, wprof[name])]
    rank_profiles = [{"mode": mode, "job": j, "rounds": rr} for (mode, j), rr in zip(rank_jobs, rank_rounds)]
    model = fit_model(samples, comm_rows, pairs, wpoints,
                      {DEVICE: {"layers": MODELS[n][0], "hidden": MODELS[n][1], "heads": MODELS[n][2],
                                "vocab": MODELS[n][3], "rows": b, "seq": s_}}, rank_profiles)
    measured = [{**pt, **grid_values(jr), "job_rounds": [list(x) for x in jr],
                 "cpu_util": statistics.median(u) if u else None, "faults_rounds": fr,
                 "faults_per_step": faults_median([f for jobs in fr for f in jobs])}
                for pt, jr, u, fr in zip(points, job_rounds, util, faults)]
    prof = {"cost": pcost, "cost_rounds": cost_rounds, "samples": len(samples), "comm_rows": comm_rows, "pairs": pairs,
            "colocation_steps": colo_steps, "colocation_skipped": colo_skipped, "rank_profiles": rank_profiles,
            "rank_skipped": rank_skipped,
            "profile_samples": [dict(x.__dict__) for x in samples],
            "profile_rounds": {point_key(k): v for k, v in alone.items()},
            "profile_mb_frac_rounds": {point_key(k): v for k, v in alone_fb.items()},
            "profile_faults_rounds": {point_key(k): v for k, v in alone_faults.items()},
            "workload_profiles": [p.to_dict() for p in wpoints], "workload_wall_s": wall_wl,
            "workload_profile_rounds": {name: wprof[name] for name in shapes}}
    return model, prof, measured, gcost["grid"]


def faults_median(values: list) -> float | None:
    """Median of the fault counts that were measured (None entries: a run whose stamps
    carried none); None when there are none."""
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def evaluate(model: PerfModel, measured: list[dict]) -> dict:
    cands, truth, raw, cats, noise = [], [], [], [], []
    for pt in measured:
        jobs = pt["jobs"]
        # Runs stored before 2026-12-05 kept no per-job rounds: no truth noise there.
        tn = truth_noise(pt["job_rounds"]) if pt.get("job_rounds") else None
        noise += tn if tn is not None else [None] * len(jobs)
        if len(jobs) > 1:
            shared = jobs[0]["cores"] == jobs[1]["cores"]
            for j, t, w in zip(jobs, pt["measured"], pt["raw"]):
                cands.append(candidate(j, colocated=2, oversub=2.0 if shared else 1.0))
                truth.append(t)
                raw.append(w)
                cats.append(pt["category"])
        else:
            cands.append(candidate(jobs[0]))
            truth.append(pt["measured"][0])
            raw.append(pt["raw"][0])
            cats.append(pt["category"])
    # Seq shorter than the model's context: the runtime trains a model of context seq.
    cands = [Candidate(**{**c.__dict__, "seq_len": c.seq}) for c in cands]
    t0 = time.perf_counter()
    ests = model.estimate_batch(cands)
    eval_s = time.perf_counter() - t0
    rows = []
    for c, e, t, w, cat, tn in zip(cands, ests, truth, raw, cats, noise):
        rows.append({"category": cat, "module": c.module, "batch": c.batch, "seq": c.seq, "quota": c.quota,
                     "dp": c.dp, "tp": c.tp, "pp": c.pp, "micro_batches": c.micro_batches,
                     "colocated": c.colocated, "measured_s": t, "measured_raw_s": w,
                     "estimated_s": e.seconds if e.ok else None, "status": e.status,
                     "confidence": e.confidence, "rel_std": e.rel_std if e.ok else None,
                     "reason": "" if e.ok else e.reason,
                     "ape": abs(e.seconds - t) / t * 100 if e.ok else None,
                     "ape_raw": abs(e.seconds - w) / w * 100 if e.ok else None, "truth_noise": tn})
    return {"rows": rows, "eval_s": eval_s}


def extra_step_device_s(measured: list[dict], rounds: int) -> float:
    """Device-seconds the grid spent on measured steps beyond the profiles' ``MEASURED``
    per point: a colocated pair measures ``PAIR_MEASURED`` steps (its slower job's step
    time, on the cores the pair holds), a peft / multimodal held-out run
    ``WORKLOAD_MEASURED`` (on its quota's cores), every round. An estimate from each
    point's kept rounds' mean raw step time: what the grid would have cost measured with
    the profiles' step counts is ``grid_device_s`` less this (JSON
    ``profiling_cost_ratio_same_steps``), the comparison at one protocol."""
    extra = 0.0
    for p in measured:
        jobs = p["jobs"]
        if len(jobs) == 2:
            extra += (PAIR_MEASURED - MEASURED) * max(p["raw"]) * cores_held(jobs) * rounds
        elif jobs[0].get("shape"):
            extra += (WORKLOAD_MEASURED - MEASURED) * p["raw"][0] * len(jobs[0]["cores"][0]) * rounds
    return extra


def mape(rows: list[dict], key: str = "ape") -> float | None:
    v = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(v) if v else None


def calibration(rows: list[dict]) -> dict | None:
    """How well the estimates' uncertainty matched their errors over ``rows`` with an
    estimate: ``within_tolerance`` (the share whose error was within the confidence's
    tolerance, ``CONF_TOLERANCE``: 10 %), ``mean_confidence`` (what the estimates
    claimed for that: equal to it when calibrated) and ``rms_z`` (root mean square of
    error / ``rel_std``: 1 when calibrated, above 1 over-confident). None without rows."""
    ok = [r for r in rows if r.get("ape") is not None and r.get("rel_std")]
    if not ok:
        return None
    return {"within_tolerance": sum(r["ape"] <= CONF_TOLERANCE * 100 for r in ok) / len(ok),
            "mean_confidence": statistics.fmean(r["confidence"] for r in ok),
            "rms_z": math.sqrt(statistics.fmean((r["ape"] / 100 / r["rel_std"]) ** 2 for r in ok))}


def calibration_line(single: dict | None, multi: dict | None) -> str:
    """One printed line of :func:`calibration` for single-device and multi-rank rows."""
    def one(name: str, c: dict | None) -> str:
        if c is None:
            return f"{name} -"
        return (f"{name} {c['within_tolerance'] * 100:.0f} % of rows within {CONF_TOLERANCE * 100:.0f} % at mean "
                f"confidence {c['mean_confidence']:.2f} (RMS error / rel_std {c['rms_z']:.2f})")
    return "calibration: " + one("single-device", single) + "; " + one("multi-rank", multi)


def host_info(cpuinfo: str = "/proc/cpuinfo", cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> dict:
    """What the run ran on: CPU model, usable CPUs, and core 0's caches as sysfs names
    them (e.g. ``{"L1d": "48K", "L2": "2048K"}``); a part /proc or /sys does not say is
    left out (a cache index missing a file is skipped). Runs of different sessions may
    land on different machines: stored runs are compared with their hardware known."""

    def read(path: str) -> str:
        with open(path, encoding="utf-8") as f:
            return f.read()

    from agent.devices import _cpu_model

    out: dict = {"cpus": len(os.sched_getaffinity(0))}
    model = _cpu_model(cpuinfo, default="")
    if model:
        out["cpu_model"] = model
    caches = {}
    try:
        for idx in sorted(os.listdir(cache_dir)):
            d = os.path.join(cache_dir, idx)
            try:
                level, kind, size = (read(os.path.join(d, k)).strip() for k in ("level", "type", "size"))
            except OSError:
                continue
            caches[f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")] = size
    except OSError:
        pass
    out["caches"] = caches
    return out


def _loadavg() -> list[str]:
    try:
        return open("/proc/loadavg").read().split()[:3]
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true", help="two grid points per category (< 2 minutes)")
    ap.add_argument("--rounds", type=int, default=None, metavar="N",
                    help=f"rounds of profiles and grid, interleaved (default {ROUNDS}; 1 with --quick)")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.json:  # found out now, not after a 12-minute run
        d = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(d) or not os.access(d, os.W_OK) or os.path.isdir(args.json):
            ap.error(f"--json {args.json}: cannot write there ({d} is not a writable directory, or the path is one)")
    from tessera.log import quiet, restore

    # Every forked rank logs "joined" at info: ~1,000 lines a run that buried the table.
    saved = quiet()
    try:
        return run_benchmark(args)
    finally:
        restore(saved)


def run_benchmark(args) -> int:
    """The benchmark for parsed, checked arguments (``main``): the GPU variant, or the CPU
    grid measured, fitted, printed and written. Returns the exit status."""
    if args.device == "cuda":
        return main_cuda(args)
    t0 = time.monotonic()
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    load0 = _loadavg()
    points = grid(args.quick)
    model, prof, measured, grid_cost = measure(points, rounds)
    fit = model.compute[DEVICE]
    print(f"profiles: {prof['samples']} compute points, 2 colocation pairs, {len(prof['comm_rows'])} comm rows, "
          f"{len(prof['workload_profiles'])} peft/multimodal shapes; "
          f"fit {fit.status} rel_sigma={fit.rel_sigma:.3f} p={fit.p:.2f} {fit.reason}; "
          f"sync {model.comm[LINK].sync}; interference {model.interference.get(DEVICE)}", file=sys.stderr)
    res = evaluate(model, measured)
    # Host contention: CPU time / wall time of single-thread, single-rank grid steps
    # (1.0 on an idle host; 0.3 means other tenants took 70% of our core).
    utils = [pt["cpu_util"] for pt in measured if pt["cpu_util"] is not None and len(pt["jobs"]) == 1
             and pt["jobs"][0]["q"] == 1 and not pt["jobs"][0]["plan"] and not pt["jobs"][0].get("shape")]
    contention = statistics.median(utils) if utils else None
    load = _loadavg()
    rows = res["rows"]
    cats = sorted({r["category"] for r in rows})
    single = [r for r in rows if not r["category"].startswith("multi_")]
    multi = [r for r in rows if r["category"].startswith("multi_")]
    prof_cost = sum(prof["cost"].values())
    out = {
        "device": args.device, "quick": args.quick,
        "mape_single": mape(single), "mape_multi": mape(multi),
        # Rows the model gave no estimate for (insufficient_data): not in any MAPE above,
        # so counted here — a run with any is not a full result (printed as such).
        "failed_single": sum(r["estimated_s"] is None for r in single),
        "failed_multi": sum(r["estimated_s"] is None for r in multi),
        # Against raw wall times, other tenants' load included (see bench/_measure.py).
        "mape_single_raw": mape(single, "ape_raw"), "mape_multi_raw": mape(multi, "ape_raw"),
        # The grid's own reproducibility (truth_noise): what a perfect model would score.
        "truth_noise_single": mape(single, "truth_noise"), "truth_noise_multi": mape(multi, "truth_noise"),
        # Did the estimates' confidence match their errors (calibration)?
        "calibration_single": calibration(single), "calibration_multi": calibration(multi),
        # Profiles and grid were measured with the same warm-up and measured steps per
        # point (but for the grid's colocated pairs and peft / multimodal runs, below) and
        # the same number of rounds: the ratio is the same per round and over all rounds.
        "profiling_cost_ratio": grid_cost / prof_cost if prof_cost else None,
        # The same with the grid's pairs and peft / multimodal runs costed at the profiles'
        # measured steps (they measure 10 / 24; extra_step_device_s): one protocol.
        "profiling_cost_ratio_same_steps": (grid_cost - extra_step_device_s(measured, rounds)) / prof_cost
        if prof_cost else None,
        "profile_device_s": prof_cost, "grid_device_s": grid_cost, "profile_cost": prof["cost"],
        "profile_device_s_per_round": prof_cost / rounds, "grid_device_s_per_round": grid_cost / rounds,
        "cost_rounds": prof.get("cost_rounds", []),
        "categories": {c: {"mape": mape([r for r in rows if r["category"] == c]),
                           "mape_raw": mape([r for r in rows if r["category"] == c], "ape_raw"),
                           "n": sum(r["category"] == c for r in rows),
                           "failed": sum(r["category"] == c and r["estimated_s"] is None for r in rows),
                           "max_ape": max((r["ape"] for r in rows if r["category"] == c and r["ape"] is not None),
                                          default=None),
                           "mean_confidence": statistics.fmean(r["confidence"] for r in rows
                                                               if r["category"] == c and r["estimated_s"] is not None)
                           if any(r["category"] == c and r["estimated_s"] is not None for r in rows) else None,
                           "truth_noise": mape([r for r in rows if r["category"] == c], "truth_noise"),
                           "faults_per_step": faults_median([p["faults_per_step"] for p in measured
                                                             if p["category"] == c])}
                       for c in cats},
        "host_cpu_util": contention, "host_loadavg": load, "host_loadavg_start": load0, "host": host_info(),
        # The executors' heap policy (agent.runtime.heap) and what it left: minor page
        # faults per measured step, median over the grid's points and over the profile points.
        "heap": heap_mode(), "faults_per_step_grid": faults_median([p["faults_per_step"] for p in measured]),
        "faults_per_step_profiles": faults_median([faults_median(v) for v in prof["profile_faults_rounds"].values()]),
        "rounds": rounds,
        "warmup_steps": WARMUP, "profile_warm_warmup_steps": WARM_WARMUP, "measured_steps": MEASURED,
        # Run-to-run spread of the grid: per point, (slowest - fastest round) / fastest.
        "round_spread_median": statistics.median((max(p["rounds"]) - min(p["rounds"])) / min(p["rounds"])
                                                 for p in measured) if rounds > 1 else None,
        "estimate_batch_s": res["eval_s"], "grid_points": len(rows),
        "model": model.to_dict(), "rows": rows, "profile_samples": prof["profile_samples"],
        "colocation_pairs": prof["pairs"], "colocation_steps": prof["colocation_steps"],
        "colocation_skipped": prof["colocation_skipped"], "rank_profiles": prof.get("rank_profiles", []),
        "rank_skipped": prof.get("rank_skipped", []),
        "comm_rows": prof["comm_rows"], "profile_rounds": prof["profile_rounds"],
        "profile_mb_frac_rounds": prof["profile_mb_frac_rounds"], "profile_faults_rounds": prof["profile_faults_rounds"],
        "workload_profiles": prof["workload_profiles"], "workload_profile_rounds": prof["workload_profile_rounds"],
        "workload_wall_s": prof["workload_wall_s"],
        "grid_rounds": [{"category": p["category"], "jobs": p["jobs"], "rounds": p["rounds"],
                         "job_rounds": p["job_rounds"], "faults_rounds": p["faults_rounds"]} for p in measured],
        "wall_s": time.monotonic() - t0,
    }
    for c in cats:
        out[c] = out["categories"][c]["mape"]
    if args.json:  # first: whatever the table below meets, the measurements are kept
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    pct = lambda v, w=7: f"{'-':>{w}}" if v is None else f"{v:>{w}.2f}"  # noqa: E731
    print(f"{'category':<20} {'n':>3} {'MAPE %':>7} {'max %':>7} {'raw %':>7} {'conf':>5} {'noise %':>7} failed")
    for c in cats:
        v = out["categories"][c]
        print(f"{c:<20} {v['n']:>3} {pct(v['mape'])} {pct(v['max_ape'])} {pct(v['mape_raw'])} "
              f"{pct(v['mean_confidence'], 5)} {pct(v['truth_noise'])} {v['failed'] or ''}")
    print(f"{'single-device':<20} {len(single):>3} {pct(out['mape_single'])} {'':>7} {pct(out['mape_single_raw'])} "
          f"{'':>5} {pct(out['truth_noise_single'])} {out['failed_single'] or ''}")
    print(f"{'multi-rank':<20} {len(multi):>3} {pct(out['mape_multi'])} {'':>7} {pct(out['mape_multi_raw'])} "
          f"{'':>5} {pct(out['truth_noise_multi'])} {out['failed_multi'] or ''}")
    if out["failed_single"] or out["failed_multi"]:
        print(f"NOT A FULL RESULT: the model gave no estimate for {out['failed_single']} single-device and "
              f"{out['failed_multi']} multi-rank rows (insufficient_data; their reasons are in the JSON rows); "
              "the MAPEs above leave them out")
    print("noise %: the grid's own reproducibility (bootstrap of each point's rounds) — what a perfect model "
          "would score on this host")
    print(calibration_line(out["calibration_single"], out["calibration_multi"]))
    print(f"profiling cost per round: {prof_cost / rounds:.1f} device-s of profiles "
          f"({', '.join(f'{k} {v / rounds:.1f}' for k, v in prof['cost'].items())}) vs {grid_cost / rounds:.1f} "
          f"device-s to measure the grid: {out['profiling_cost_ratio']:.1f}x less ({rounds} rounds of both; "
          f"{out['profiling_cost_ratio_same_steps']:.1f}x with the grid's pairs and peft/multimodal runs at the "
          f"profiles' {MEASURED} measured steps); "
          f"wall {out['wall_s']:.0f} s (peft/multimodal runs {out['workload_wall_s']:.1f} s of it)")
    spread = out["round_spread_median"]
    print(f"host: CPU/wall of single-core steps {contention if contention is None else round(contention, 2)}, "
          f"load average {' '.join(load0)} (start) {' '.join(load)} (end); median spread of a grid point over "
          f"rounds {spread if spread is None else f'{spread * 100:.1f}%'}; "
          f"estimate_batch of {len(rows)}: {res['eval_s'] * 1e3:.1f} ms")
    fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    grid_f = [p["faults_per_step"] for p in measured if p["faults_per_step"] is not None]
    print(f"page faults per measured step (heap {out['heap']}, agent.runtime.heap): grid median "
          f"{fmt(out['faults_per_step_grid'])} (max {fmt(max(grid_f) if grid_f else None)}), profile points median "
          f"{fmt(out['faults_per_step_profiles'])}")
    return 0


# ----------------------------------------------------------------------------- cuda
# One GPU under MPS: quota = CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (10-100 %), the model's q
# is the SM share in (0, 1]. Models big enough that a step is not only launch overhead.
GPU_MODELS = {
    "A": (4, 256, 8, 8192, 256),
    "B": (8, 512, 8, 8192, 256),
    "C": (6, 384, 8, 8192, 256),    # unseen: between A and B
    "E": (4, 768, 12, 8192, 256),   # unseen: wider than anything profiled
}
# (model, batch, seq, quota %, micro_batches); one profiling process per quota level.
GPU_PROFILE = [
    ("A", 8, 256, 100, 1), ("A", 32, 128, 100, 1), ("A", 16, 256, 100, 2), ("A", 16, 64, 100, 1),
    ("A", 8, 256, 30, 1), ("A", 32, 128, 30, 1), ("A", 8, 256, 60, 1),
    ("B", 4, 256, 100, 1), ("B", 16, 128, 100, 1), ("B", 8, 256, 100, 2), ("B", 4, 256, 30, 1), ("B", 16, 128, 30, 1),
    ("B", 4, 256, 60, 1),
]  # three quota levels: the fit can place a saturation point q_sat (0.6 or 1.0)
# Colocation profiles of A (8, 256): split 30 % + 30 % and shared 100 % + 100 % (alone
# times are the profile points at those quotas).
GPU_COLO_PROFILE = (("split", 30), ("shared", 100))
GPU_WARMUP, GPU_MEASURED = 3, 6


def gpu_grid() -> list[dict]:
    """Held-out GPU configurations: quotas 10-100 %, other batches, unseen models,
    micro-batches, colocated pairs (split: quotas sum <= 100 %; shared: > 100 %)."""
    g = []

    def single(cat, model, batch, seq, q, m=1):
        g.append({"category": cat, "jobs": [{"model": model, "batch": batch, "seq": seq, "q": q, "m": m}]})

    for q in (10, 20, 50, 70):
        single("gpu_single_quota", "A", 16, 256, q)
        single("gpu_single_quota", "B", 8, 256, q)
    for model, b, s, q in (("C", 8, 256, 50), ("C", 8, 256, 100), ("E", 8, 128, 20), ("E", 8, 128, 100)):
        single("gpu_single_model_size", model, b, s, q)
    for model, b, s in (("A", 24, 192), ("B", 12, 128), ("B", 2, 256)):
        single("gpu_single_batch_seq", model, b, s, 100)
    single("gpu_single_microbatch", "A", 32, 256, 100, m=4)
    single("gpu_single_microbatch", "C", 16, 128, 50, m=2)
    for cat, pair in (("gpu_colocate_split", ((("A", 16, 256), 50), (("B", 8, 256), 50))),
                      ("gpu_colocate_split", ((("C", 8, 256), 40), (("C", 8, 256), 60))),
                      ("gpu_colocate_shared", ((("A", 16, 256), 100), (("B", 8, 256), 100)))):
        g.append({"category": cat, "jobs": [{"model": m, "batch": b, "seq": s, "q": q, "m": 1}
                                            for (m, b, s), q in pair]})
    return g


def gpu_workload(model: str, batch: int, seq: int, m: int, steps: int) -> dict:
    layers, hidden, heads, vocab, _ = GPU_MODELS[model]
    return {"model": {"layers": layers, "hidden": hidden, "heads": heads, "vocab": vocab, "seq_len": seq},
            "batch_size": batch, "steps": steps, "plan": {"dp": 1, "tp": 1, "pp": 1, "micro_batches": m}}


def gpu_candidate(job: dict, colocated: int = 1, oversub: float = 1.0) -> Candidate:
    layers, hidden, heads, vocab, _ = GPU_MODELS[job["model"]]
    return Candidate(device_type="gpu", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=job["seq"],
                     batch=job["batch"], seq=job["seq"], micro_batches=job["m"], quota=job["q"] / 100.0,
                     module=job["model"], colocated=colocated, oversubscription=oversub)


def main_cuda(args) -> int:
    """The GPU variant (run by bench/gpu/run.sh with an MPS daemon up); see GPU_* above.

    Bounded by run.sh's step timeout: the JSON is rewritten after every phase (profile
    quota, colocation pair, grid group) with ``"complete": false`` until the end, and a
    phase whose processes fail (RuntimeError from run_groups) is recorded under
    ``errors`` and skipped, the rest still runs."""
    from bench._partial import NO_CUDA, cuda_missing, write_json

    if cuda_missing():  # probed in a child: this process must not touch CUDA before spawning
        print(NO_CUDA, file=sys.stderr)
        return 2
    if not os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        print("warning: CUDA_MPS_PIPE_DIRECTORY unset; quotas only apply under an MPS daemon "
              "(bench/gpu/run.sh starts one)", file=sys.stderr)
    from bench._measure_gpu import run_groups

    t0 = time.monotonic()
    steps = GPU_WARMUP + GPU_MEASURED
    cost = {"compute": 0.0, "colocation": 0.0}
    alone: dict[tuple, float] = {}
    errors: list[dict] = []
    pairs: list[dict] = []
    points = gpu_grid()
    grid_cost = 0.0

    def attempt(phase: str, groups: list[dict]) -> list[dict] | None:
        try:
            return run_groups(groups, GPU_WARMUP)
        except RuntimeError as e:
            errors.append({"phase": phase, "error": str(e)[-800:]})
            print(f"{phase}: {e}", file=sys.stderr)
            return None

    def partial(done: str) -> None:
        write_json(args.json, {"device": "cuda", "phase_done": done, "errors": errors,
                               "profile_alone_s": [{"point": list(k), "step_s": v} for k, v in alone.items()],
                               "profile_cost": cost, "colocation_pairs": pairs, "grid_device_s": grid_cost,
                               "grid_measured": [pt for pt in points if "measured" in pt],
                               "wall_s": time.monotonic() - t0}, complete=False)

    for q in sorted({p[3] for p in GPU_PROFILE}):
        pts = [p for p in GPU_PROFILE if p[3] == q]
        res = attempt(f"profile q={q}", [{"quota": q, "workloads": [gpu_workload(n, b, s, m, steps)
                                                                      for n, b, s, _, m in pts]}])
        if res:
            cost["compute"] += res[0]["device_s"]
            for pt, x in zip(pts, res[0]["results"]):
                alone[pt] = x["step_s"]
        partial(f"profile q={q}")
    samples = []
    for (n, b, s, q, m), t in alone.items():
        layers, hidden, heads, vocab, _ = GPU_MODELS[n]
        samples.append(ComputeSample(module=n, rows=b, seq=s, layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                                     q=q / 100.0, seconds=t, micro_batches=m, seq_len=s))
    for mode, q in GPU_COLO_PROFILE:
        if ("A", 8, 256, q, 1) not in alone:
            errors.append({"phase": f"colocation {mode}", "error": "skipped: its alone profile point failed"})
            continue
        res = attempt(f"colocation {mode}", [{"quota": q, "workloads": [gpu_workload("A", 8, 256, 1, steps)]}] * 2)
        if res:
            cost["colocation"] += sum(r["device_s"] for r in res)
            pairs.append({"mode": mode, "colocated": 2, "oversubscription": max(1.0, 2 * q / 100.0),
                          "alone_s": alone[("A", 8, 256, q, 1)],
                          "together_s": statistics.median(r["results"][0]["step_s"] for r in res)})
        partial(f"colocation {mode}")
    singles = [pt for pt in points if len(pt["jobs"]) == 1]
    for q in sorted({pt["jobs"][0]["q"] for pt in singles}):
        mine = [pt for pt in singles if pt["jobs"][0]["q"] == q]
        res = attempt(f"grid q={q}", [{"quota": q, "workloads": [gpu_workload(j["model"], j["batch"], j["seq"], j["m"], steps)
                                                                   for pt in mine for j in pt["jobs"]]}])
        if res:
            grid_cost += res[0]["device_s"]
            for pt, x in zip(mine, res[0]["results"]):
                pt["measured"] = [x["step_s"]]
        partial(f"grid q={q}")
    for i, pt in enumerate(points):
        if len(pt["jobs"]) > 1:
            res = attempt(f"grid {pt['category']} #{i}",
                          [{"quota": j["q"], "workloads": [gpu_workload(j["model"], j["batch"], j["seq"], j["m"], steps)]}
                           for j in pt["jobs"]])
            if res:
                grid_cost += sum(r["device_s"] for r in res)
                pt["measured"] = [r["results"][0]["step_s"] for r in res]
            partial(f"grid {pt['category']} #{i}")
    try:
        model = PerfModel(version=1, compute={"gpu": fit_compute("gpu", samples)},
                          interference={"gpu": fit_interference(pairs)})
    except Exception as e:  # noqa: BLE001 - too few profile points survived: keep the measurements
        errors.append({"phase": "fit", "error": repr(e)[-800:]})
        partial("fit failed")
        print(f"fit failed: {e!r}", file=sys.stderr)
        return 1
    fit = model.compute["gpu"]
    print(f"gpu profiles: {len(samples)} points, fit {fit.status} rel_sigma={fit.rel_sigma:.3f} p={fit.p:.2f} "
          f"q_sat={fit.q_sat} {fit.reason}", file=sys.stderr)
    cands, truth, cats = [], [], []
    for pt in points:
        over = sum(j["q"] for j in pt["jobs"]) / 100.0
        for j, t in zip(pt["jobs"], pt.get("measured", [])):
            cands.append(gpu_candidate(j, len(pt["jobs"]), over if over > 1 else 1.0))
            truth.append(t)
            cats.append(pt["category"])
    ests = model.estimate_batch(cands)
    rows = [{"category": cat, "module": c.module, "batch": c.batch, "seq": c.seq, "quota": c.quota,
             "micro_batches": c.micro_batches, "colocated": c.colocated, "measured_s": t,
             "estimated_s": e.seconds if e.ok else None, "status": e.status, "confidence": e.confidence,
             "ape": abs(e.seconds - t) / t * 100 if e.ok else None} for c, e, t, cat in zip(cands, ests, truth, cats)]
    prof_cost = sum(cost.values())
    out = {"device": "cuda", "mape_single": mape(rows),
           "profiling_cost_ratio": grid_cost / prof_cost if prof_cost else None,
           "profile_device_s": prof_cost, "grid_device_s": grid_cost, "profile_cost": cost,
           "categories": {c: {"mape": mape([r for r in rows if r["category"] == c]),
                              "n": sum(r["category"] == c for r in rows)} for c in sorted(set(cats))},
           "model": model.to_dict(), "rows": rows, "colocation_pairs": pairs,
           "profile_samples": [dict(x.__dict__) for x in samples], "errors": errors,
           "wall_s": time.monotonic() - t0}
    print(f"{'category':<24} {'n':>3} {'MAPE %':>7}")
    for c, v in out["categories"].items():
        print(f"{c:<24} {v['n']:>3} {v['mape'] if v['mape'] is not None else float('nan'):>7.2f}")
    print(f"{'single GPU (all)':<24} {len(rows):>3} {out['mape_single'] or float('nan'):>7.2f}")
    ratio = out["profiling_cost_ratio"]
    print(f"profiling cost: {prof_cost:.1f} GPU-s vs {grid_cost:.1f} GPU-s for the grid: "
          f"{ratio if ratio is None else round(ratio, 1)}x less; wall {out['wall_s']:.0f} s; "
          f"{len(errors)} failed phases")
    write_json(args.json, out, complete=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
