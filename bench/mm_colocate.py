"""Colocated encoder+LLM under quotas versus temporal multiplexing (after Mosaic).

    python -m bench.mm_colocate [--device cpu|cuda] [--steps 6] [--trials 3] [--json out.json]

Temporal: per micro-batch, encoder forward, LLM forward+backward, encoder backward, one
after another, each with the whole device (CUDA: the default stream; CPU: all cores as
intra-op threads, and also one thread — the faster temporal run is the baseline, so a
badly threaded baseline never inflates the speedup). Colocated:
the same micro-batches pipelined with the encoder and the LLM on their own quota (CPU:
disjoint core sets + per-thread intra-op budgets, pinned ("hard") or not ("soft");
CUDA: a stream each with priorities), for every quota split in the sweep; the best
split is the plan's. Also colocated as two processes, encoder | LLM, each owning its
module (Mosaic's form; CPU: a core set each; CUDA: an MPS SM share each — under an MPS
daemon, which bench/gpu/run.sh provides), all of its trials in one launch after the
first trial of the others. Same samples, same
initial weights, same number of steps; the other variants interleave trial by trial in one run so
machine noise hits them alike; median over trials of the mean step time after a warm-up
step, timed around a device synchronize. JSON: ``speedup_vs_temporal`` (best plan vs
the baseline), ``step_s`` per variant.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from agent.runtime.model import GPTConfig
from agent.runtime.multimodal.data import SyntheticData
from agent.runtime.multimodal.disagg import CostModel, DistEngine, plan_items
from agent.runtime.multimodal.engine import ColocatedEngine, split_cpus
from agent.runtime.multimodal.launch import run_ranks
from agent.runtime.multimodal.models import MMModel
from agent.runtime.multimodal.reshard import Layout, decoupled_plan
from tessera.spec.multimodal import validate_multimodal

MM = {
    "image": {"size": 32, "patch": 4, "pool": 8},
    "encoder": {"layers": 3, "hidden": 128, "heads": 4},
    "data": {"max_images": 4, "min_text": 16, "max_text": 64},
    "mix": [{"step": 0, "image_prob": 0.7}],
    "micro_batches": 4,
}
GPT = GPTConfig(vocab=512, seq_len=96, layers=3, hidden=192, heads=6)
# On a GPU the CPU sizes are launch-bound noise; a larger model (same shapes of work:
# 16 LLM tokens per image, up to 4 images, 16..64 text tokens) keeps both streams busy.
MM_CUDA = {
    "image": {"size": 64, "patch": 8, "pool": 4},
    "encoder": {"layers": 6, "hidden": 512, "heads": 8},
    "data": {"max_images": 4, "min_text": 16, "max_text": 64},
    "mix": [{"step": 0, "image_prob": 0.7}],
    "micro_batches": 4,
}
GPT_CUDA = GPTConfig(vocab=4096, seq_len=160, layers=6, hidden=768, heads=12)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(mm, gpt, device, batches, quota, concurrent, micro, threads=None, pin=True):
    """Mean step seconds (after one warm-up step) and per-step losses of one variant,
    from fresh weights (seed 0). ``threads``: intra-op threads of the temporal run (CPU)."""
    torch.manual_seed(0)
    model = MMModel(gpt, mm).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, losses = [], []
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with ColocatedEngine(model, opt, quota, micro, concurrent=concurrent, pin=pin) as eng:
            for i, b in enumerate(batches):
                _sync(device)
                t0 = time.perf_counter()
                st = eng.step(b)
                _sync(device)  # the step's queued kernels count (CUDA is asynchronous)
                if i:  # first step warms up allocators / thread pools / kernels
                    times.append(time.perf_counter() - t0)
                losses.append(st.loss)
    finally:
        torch.set_num_threads(saved)
    return statistics.mean(times), losses


def _proc_rank(rank, world, mm, gpt, device, batch, steps, trials, quota, micro, cpus):
    """One process of the two-process colocated plan (after Mosaic): rank 0 the encoders
    and projectors, rank 1 the LLM, each on its own quota — CPU: its own core set
    (``split_cpus``) and intra-op threads; CUDA: its own MPS share of the SMs
    (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, set before this process touches CUDA; it binds
    only when an MPS control daemon serves the client, else the two time-slice). Each
    updates only the module it owns (``DistEngine(owned=True)``); embeddings and their
    gradients cross per micro-batch, the encoder one micro-batch ahead. Same samples and
    initial weights as the single-process variants. Returns (per-trial mean step seconds
    after one warm-up step, losses of the first trial's steps)."""
    enc, llm = split_cpus(cpus, quota)
    if device == "cpu":
        mine = enc if rank == 0 else llm
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
    else:
        share = quota if rank == 0 else 1.0 - quota
        os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, min(100, round(100 * share))))
    dev = torch.device(device)
    data = SyntheticData(mm, gpt.vocab, gpt.seq_len, batch, seed=0)
    torch.manual_seed(0)
    model = MMModel(gpt, mm).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eng = DistEngine(model, opt, data, rank, world, owned=True)
    cost = CostModel.from_flops(model)
    layout = Layout((0,), (1,))
    per_trial, losses = [], []
    for t in range(trials):
        # Every trial trains the same batches again (from the weights it has reached).
        times = []
        for s in range(steps + 1):
            ids = list(range(s * batch, (s + 1) * batch))
            plan = decoupled_plan(plan_items(data, ids, cost), layout, micro)
            _sync(dev)
            t0 = time.perf_counter()
            st = eng.step(ids, plan, cost)
            _sync(dev)
            if s:
                times.append(time.perf_counter() - t0)
            if t == 0:
                losses.append(st.loss)
        per_trial.append(statistics.mean(times))
    return per_trial, losses


def _distinct(quotas: list[float], key) -> list[float]:
    """The first quota of each distinct ``key(quota)`` (the plan it gives), in order."""
    out: dict = {}
    for q in quotas:
        out.setdefault(key(q), q)
    return list(out.values())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--batch", type=int, default=None, help="samples per step [16 on cpu, 32 on cuda]")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--quotas", default="0.25,0.5,0.75")
    ap.add_argument("--no-soft", action="store_true", help="CPU: sweep pinned (hard) quotas only")
    ap.add_argument("--no-procs", action="store_true", help="skip the two-process (encoder | LLM) plans")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from bench._partial import NO_CUDA, write_json

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(a.device)
    mm_raw, gpt = (MM_CUDA, GPT_CUDA) if device.type == "cuda" else (MM, GPT)
    if a.batch is None:
        a.batch = 32 if device.type == "cuda" else 16
    mm = validate_multimodal(mm_raw)
    data = SyntheticData(mm, gpt.vocab, gpt.seq_len, a.batch, seed=0)
    batches = [[data.sample(i) for i in range(s * a.batch, (s + 1) * a.batch)] for s in range(a.steps + 1)]
    cpus = sorted(os.sched_getaffinity(0))
    quotas = [float(q) for q in a.quotas.split(",")]
    bad = [q for q in quotas if not 0.0 < q < 1.0]
    if bad:
        ap.error(f"--quotas: each encoder share must be in (0, 1), got {bad}")
    # Two-process plans: a CPU quota is a core split (the same split runs once); on CUDA
    # each quota is its own MPS share, so every one runs.
    def split(q):
        return tuple(map(tuple, split_cpus(cpus, q)))

    proc_quotas = _distinct(quotas, (lambda q: q) if device.type == "cuda" else split)
    # Quotas that give the same plan run once. CPU: a quota is a core split; CUDA:
    # within one process it only decides which stream has the higher priority.
    quotas = _distinct(quotas, split if device.type == "cpu" else (lambda q: q >= 0.5))

    # Temporal baselines. On CUDA: the default stream. On CPU "the whole device" is every
    # core as intra-op threads, but on a small or shared machine one thread can be faster
    # (OpenMP threads spin and fight), so both run and the FASTER is the baseline: the
    # speedup is never inflated by a badly threaded baseline.
    # Each temporal variant: (intra-op threads or None, micro-batches). On CUDA a step of
    # these sizes is launch-bound, and a serial run gains nothing from micro-batches (they
    # exist for the pipeline): the serial run with ONE micro-batch (fewer, larger kernels)
    # runs too, and again the faster one is the baseline.
    temporal = {"temporal": (None, a.micro_batches)}
    if device.type == "cpu":
        temporal = {f"temporal {len(cpus)} threads": (len(cpus), a.micro_batches)}
        if len(cpus) > 1:
            temporal["temporal 1 thread"] = (1, a.micro_batches)
    elif a.micro_batches > 1:
        temporal["temporal 1 micro-batch"] = (None, 1)
    # Colocated plans: (quota, pinned). CPU quotas come hard (pinned core sets) and soft
    # (thread budgets only); on CUDA pinning means nothing, so only the quota varies.
    plans = {f"colocated q={q}": (q, True) for q in quotas}
    if device.type == "cpu" and not a.no_soft:
        plans.update({f"colocated q={q} soft": (q, False) for q in quotas})
    procs = {} if a.no_procs or (device.type == "cpu" and len(cpus) < 2) else \
        {f"colocated 2 procs q={q}": q for q in proc_quotas}
    samples: dict[str, list[float]] = {k: [] for k in [*temporal, *plans, *procs]}
    errors: dict[str, str] = {}  # a two-process plan that failed to run (e.g. no MPS client possible)
    losses: dict[str, list[float]] = {}
    head = {"device": a.device, "cpus": len(cpus), "batch": a.batch, "micro_batches": a.micro_batches,
            "steps": a.steps, "trials": a.trials,
            "colocation": ("cuda streams in one process, priority only (the quota picks the stream with the "
                           "higher priority; no SM share)") if device.type == "cuda" else "cpu core sets",
            "colocation_2procs": ("encoder and LLM in two processes (DistEngine owned=True), "
                                  + (("MPS SM shares (an MPS daemon serves the clients)"
                                      if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else
                                      "no MPS daemon: the two processes time-slice the GPU")
                                     if device.type == "cuda" else "a core set each")
                                  + "; embeddings and gradients over gloo; all trials in one launch")
            if procs else None}

    def sofar() -> dict:  # the headline from the trials so far (partial JSON under a time limit)
        med = {k: statistics.median(v) for k, v in samples.items() if v}
        tb = [k for k in temporal if k in med]
        co = [k for k in med if k.startswith("colocated")]
        if not tb or not co:
            return {}
        b, c = min(tb, key=med.get), min(co, key=med.get)
        return {"step_s": med, "baseline": b, "best_plan": c, "speedup_vs_temporal": med[b] / med[c]}

    for trial in range(a.trials):
        for k, (th, micro) in temporal.items():
            t, losses[k] = _run(mm, gpt, device, batches, 0.5, False, micro, th)
            samples[k].append(t)
            write_json(a.json, {**head, "trials_done": trial, "step_s_trials": samples, **sofar()},
                       complete=False, indent=2)
        for k, (q, pin) in plans.items():
            t, losses[k] = _run(mm, gpt, device, batches, q, True, a.micro_batches, pin=pin)
            samples[k].append(t)
            write_json(a.json, {**head, "trials_done": trial + (k == list(plans)[-1]), "step_s_trials": samples,
                                **sofar()}, complete=False, indent=2)
        if trial == 0:
            # Two-process plans: every trial in one launch (starting processes costs
            # seconds), right after the first trial of the others, so that a run cut
            # short by a time limit still holds a baseline and these.
            for k, q in list(procs.items()):
                try:
                    enc_side, llm_side = run_ranks(2, _proc_rank, mm, gpt, a.device, a.batch, a.steps, a.trials, q,
                                                   a.micro_batches, cpus)
                except RuntimeError as e:  # recorded; the other plans still run and report
                    errors[k] = str(e)[-2000:]
                    print(f"{k}: failed, recorded under 'errors':\n{errors[k]}", file=sys.stderr)
                    del procs[k], samples[k]
                    continue
                # A step ends in an all-reduce both join: the slower side's time is the step's.
                samples[k] = [max(x, y) for x, y in zip(enc_side[0], llm_side[0])]
                losses[k] = enc_side[1]
                write_json(a.json, {**head, "trials_done": trial + 1, "step_s_trials": samples, "errors": errors,
                                    **sofar()}, complete=False, indent=2)

    final = sofar()
    med, base_name, best = final["step_s"], final["baseline"], final["best_plan"]
    base = med[base_name]
    ref = losses[base_name]
    max_loss_diff = max(abs(x - y) for k in losses for x, y in zip(losses[k], ref))
    load = os.getloadavg()[0]
    print(f"mm_colocate on {a.device} ({len(cpus)} cpus, load average {load:.1f} at the end), batch {a.batch}, "
          f"{a.micro_batches} micro-batches, {a.steps} timed steps x {a.trials} trials (median of per-trial mean step time)")
    print(f"{'variant':<27}{'enc/llm quota':<16}{'step ms':>10}{'samples/s':>12}{'speedup':>10}")
    for k, v in med.items():
        if k in temporal:
            th, micro = temporal[k]
            quota = f"whole device, {micro} mb" if device.type == "cuda" else f"serial, {th} thr"
        elif k in procs:
            q = procs[k]
            e, l_ = split_cpus(cpus, q)
            quota = f"MPS {round(100 * q)}/{round(100 * (1 - q))}%" if device.type == "cuda" else f"{e}/{l_} procs"
        else:
            q, pin = plans[k]
            e, l_ = split_cpus(cpus, q)
            if device.type == "cuda":
                quota = f"streams, prio {'enc' if q >= 0.5 else 'llm'}"
            else:
                quota = f"{e}/{l_}" if pin else f"{len(e)}/{len(l_)} thr"
        print(f"{k:<27}{quota:<16}{v * 1e3:>10.1f}{a.batch / v:>12.1f}{base / v:>9.2f}x")
    out = {
        **head,
        "load_average": load,
        "step_s_trials": samples,
        "step_s": med,
        "baseline": base_name,
        "best_plan": best,
        "speedup_vs_temporal": base / med[best],
        "speedup_vs_temporal_per_variant": {k: base / v for k, v in med.items()},
        "max_loss_diff_vs_temporal": max_loss_diff,
        "errors": errors,
    }
    print(f"baseline: {base_name}; best: {best}  speedup_vs_temporal = {out['speedup_vs_temporal']:.2f}x  "
          f"(loss |diff| vs baseline <= {max_loss_diff:.1e})")
    write_json(a.json, out, complete=True, indent=2)
    return out


if __name__ == "__main__":
    main()
