"""Trace and cluster readers, and converters from other public traces to ``SimJob``s.

The simulator's native input is Arena's trace CSV (columns ``job_id, submission_time,
num_iteration, model_name, batch_size, num_gpu, gpu_type``; any file with those columns
works, extra columns are ignored) and Arena's cluster JSON (``{gpu: {nodes,
gpus_per_node}}``). Optional columns ``tenant``, ``gpu_fraction``, ``backbone``,
``workload`` and ``encoder_share`` carry Tessera's multiplexing inputs.

Converters map traces without model names onto the measured models: each job gets a
model (chosen deterministically from its id among the models feasible at its requested
shape) and an iteration count such that its runtime on the requested shape equals the
trace's duration. Jobs asking for a fraction of one GPU become ``fixed:1`` jobs (one
second per iteration on any single device; they are not bound by device speed).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import random
from dataclasses import dataclass, replace
from datetime import datetime

from controller.policy.estimator import fixed_model, parse_config_key
from controller.policy.types import DeviceView, NodeView


@dataclass(frozen=True)
class SimJob:
    """One job of a trace. ``model`` keys the iteration-time table (or ``fixed:S``)."""

    job_id: str
    submit: float
    iterations: int
    model: str
    num_gpu: int
    gpu_type: str = ""
    tenant: str = "default"
    gpu_fraction: float = 1.0
    backbone: str = ""
    workload: str = "train"
    encoder_share: float = 0.0


def model_key(model_name: str, batch_size: int | str) -> str:
    """Arena's trace ``bert__2.6B`` + batch 256 -> table key ``bert_2.6B_256``."""
    fam, params = model_name.split("__") if "__" in model_name else (model_name, "")
    return f"{fam}_{params}_{batch_size}" if params else f"{fam}_{batch_size}"


def load_arena_trace(path: str, limit: int | None = None) -> list[SimJob]:
    """Read an Arena-format trace CSV (see module doc), sorted by submission time."""
    jobs = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            jobs.append(SimJob(
                job_id=row["job_id"], submit=float(row["submission_time"]),
                iterations=int(float(row["num_iteration"])),
                model=model_key(row["model_name"], row["batch_size"]),
                num_gpu=int(row["num_gpu"]), gpu_type=row.get("gpu_type", "") or "",
                tenant=row.get("tenant") or "default",
                gpu_fraction=float(row.get("gpu_fraction") or 1.0),
                backbone=row.get("backbone") or "", workload=row.get("workload") or "train",
                encoder_share=float(row.get("encoder_share") or 0.0)))
    jobs.sort(key=lambda j: (j.submit, j.job_id))
    return jobs[:limit] if limit else jobs


def load_iter_times(path: str) -> dict[str, dict[str, float]]:
    """Arena's measured table ``{model: {"gpu:NxG": seconds}}``."""
    with open(path) as f:
        return json.load(f)


def load_cluster(path: str) -> tuple[NodeView, ...]:
    """Arena's cluster JSON -> ready nodes named ``<gpu>-<i>`` with devices ``g<k>``."""
    with open(path) as f:
        spec = json.load(f)
    return cluster_nodes({t: (v["nodes"], v["gpus_per_node"]) for t, v in spec.items()})


def cluster_nodes(spec: dict[str, tuple[int, int]]) -> tuple[NodeView, ...]:
    """Nodes from ``{gpu_type: (nodes, gpus_per_node)}``."""
    out = []
    for t, (n, g) in sorted(spec.items()):
        for i in range(n):
            devs = tuple(DeviceView(f"g{k}", "gpu", t, 0, 100) for k in range(g))
            out.append(NodeView(f"{t}-{i:05d}", devs))
    return tuple(out)


def _h(s: str) -> int:
    return int(hashlib.sha256(s.encode()).hexdigest()[:12], 16)


def _configs_by_count(table) -> dict[int, list[tuple[str, str]]]:
    out: dict[int, list[tuple[str, str]]] = {}
    for m, cfg in sorted(table.items()):
        for k in cfg:
            t, n, g = parse_config_key(k)
            out.setdefault(n * g, []).append((m, k))
    return out


def _model_for(job_id: str, num_gpu: int, duration: float, table, by_count, gpu_type: str = "") -> tuple[str, str, int, int]:
    """Pick (model, gpu_type, count, iterations) so the requested shape runs ``duration``."""
    counts = sorted(by_count)
    c = min(counts, key=lambda x: (abs(math.log2(x) - math.log2(max(num_gpu, 1))), x))
    opts = [(m, k) for m, k in by_count[c] if not gpu_type or k.startswith(gpu_type + ":")] or by_count[c]
    m, k = opts[_h(job_id) % len(opts)]
    t = table[m][k]
    return m, parse_config_key(k)[0], c, max(1, int(round(duration / t)))


def convert_philly(path: str, table, limit: int | None = 2000, seed: int = 0,
                   max_duration: float | None = None) -> list[SimJob]:
    """Pollux's processed Philly table (``timestamp, duration, num_gpus, ...``): submit time
    from the timestamp (relative to the first row kept), model/type from the job's hash."""
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.append(row)
    rows.sort(key=lambda r: r["timestamp"])
    if limit:
        rng = random.Random(seed)
        start = rng.randrange(0, max(1, len(rows) - limit))
        rows = rows[start:start + limit]
    by_count = _configs_by_count(table)
    t0 = datetime.fromisoformat(rows[0]["timestamp"]).timestamp()
    jobs = []
    for i, r in enumerate(rows):
        dur = float(r["duration"])
        if max_duration:
            dur = min(dur, max_duration)
        jid = f"philly-{i:06d}"
        m, t, c, iters = _model_for(jid, int(r["num_gpus"]), max(dur, 60.0), table, by_count)
        jobs.append(SimJob(jid, datetime.fromisoformat(r["timestamp"]).timestamp() - t0, iters, m, c, t,
                           tenant=r.get("cluster", "default") or "default"))
    return jobs


def convert_openb(path: str, table, limit: int | None = None, max_duration: float | None = None) -> list[SimJob]:
    """Alibaba openb pod list (``num_gpu, gpu_milli, creation_time, scheduled_time,
    deletion_time``): GPU pods only; ``gpu_milli < 1000`` on one GPU becomes a fractional
    job (``gpu_fraction``); multi-GPU pods get a measured model as in ``convert_philly``."""
    by_count = _configs_by_count(table)
    jobs = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            n = int(row["num_gpu"] or 0)
            if n < 1:
                continue
            start = float(row.get("scheduled_time") or row["creation_time"] or 0)
            dur = float(row["deletion_time"]) - start
            if dur <= 0:
                continue
            if max_duration:
                dur = min(dur, max_duration)
            frac = int(row["gpu_milli"] or 1000) / 1000.0
            jid = row["name"]
            if n == 1:
                jobs.append(SimJob(jid, float(row["creation_time"]), int(max(1, round(dur))), fixed_model(1.0), 1,
                                   gpu_fraction=min(frac, 1.0)))
            else:
                m, t, c, iters = _model_for(jid, n, dur, table, by_count)
                jobs.append(SimJob(jid, float(row["creation_time"]), iters, m, c, t))
    jobs.sort(key=lambda j: (j.submit, j.job_id))
    return jobs[:limit] if limit else jobs


def synthetic_trace(n_jobs: int, table, gpu_types: list[str], seed: int = 0, span_s: float = 86400.0,
                    max_gpu: int = 16, fractional_share: float = 0.0, lora_share: float = 0.0) -> list[SimJob]:
    """Random jobs over the table's models (tests and the scale benchmark)."""
    rng = random.Random(seed)
    models = sorted(table)
    jobs = []
    for i in range(n_jobs):
        u = rng.random()
        if u < fractional_share:
            jobs.append(SimJob(f"s{i:06d}", rng.uniform(0, span_s), rng.randint(300, 20000), fixed_model(1.0), 1,
                               gpu_fraction=rng.choice([0.2, 0.3, 0.5, 0.7]),
                               backbone=rng.choice(["llama-7b", "llama-13b", ""]) if rng.random() < lora_share else ""))
            continue
        m = rng.choice(models)
        keys = [k for k in table[m] if parse_config_key(k)[1] * parse_config_key(k)[2] <= max_gpu]
        if not keys:
            continue
        t, n, g = parse_config_key(rng.choice(keys))
        if t not in gpu_types:
            t = rng.choice(gpu_types)
        jobs.append(SimJob(f"s{i:06d}", rng.uniform(0, span_s), rng.randint(200, 5000), m, n * g, t,
                           tenant=rng.choice(["a", "b", "c"])))
    jobs.sort(key=lambda j: (j.submit, j.job_id))
    return jobs


def with_tenant(jobs: list[SimJob], tenants: list[str]) -> list[SimJob]:
    """Assign tenants round-robin by job hash (for fairness experiments)."""
    return [replace(j, tenant=tenants[_h(j.job_id) % len(tenants)]) for j in jobs]
