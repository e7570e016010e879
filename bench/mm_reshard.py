"""Disaggregated encoder/LLM with grouped reordering and adaptive resharding versus the
coupled layout (after MegaScale-Omni).

    python -m bench.mm_reshard [--ranks 2] [--steps 16] [--trials 3] [--device cpu|cuda] [--json out.json]

Coupled: every rank runs the encoder and the LLM on its own contiguous slice of the
batch (plain data parallelism, plain loader). Disaggregated: the loader reorders samples
within groups of steps, each step's layout (which ranks encode, which run the LLM, in
what ratio) is chosen from the measured cost model, and encoder outputs are resharded so
every LLM rank gets balanced work. The modality mix shifts during the run (text-heavy →
image-heavy). Every variant trains the same samples over the run (reordering only moves
samples between steps of a group) from the same weights, in the same ranks, interleaved
trial by trial; the figure is the run's total wall time (median over trials), with a
CPU-time critical path beside it (robust to other tenants preempting the ranks) and the
plan's noise-free imbalance under the cost model. JSON: ``speedup_vs_coupled`` (wall),
``speedup_vs_coupled_cpu_critical_path``, ``run_s`` per variant; under the FLOP cost model,
``model_speedup_vs_coupled`` (the head plan's) and ``model_ceiling_vs_coupled`` (any plan's:
coupled's busiest rank over a perfect, padding-free split of the same samples).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist

from agent.runtime.model import GPTConfig
from agent.runtime.multimodal.data import SyntheticData
from agent.runtime.multimodal.disagg import CostModel, DistEngine, plan_items
from agent.runtime.multimodal.launch import run_ranks
from agent.runtime.multimodal.models import MMModel
from agent.runtime.multimodal.reorder import batches
from agent.runtime.multimodal.reshard import Layout, choose_layout, coupled_plan, decoupled_plan
from tessera.spec.multimodal import validate_multimodal

GPT = GPTConfig(vocab=512, seq_len=96, layers=3, hidden=192, heads=6)

VARIANTS = {
    # name: (reorder, planner)
    "coupled": (False, "coupled"),
    "coupled + reorder": (True, "coupled"),
    "disagg 1:1 fixed": (False, "disjoint"),
    "disagg + reorder + adaptive": (True, "adaptive"),
}
HEAD = "disagg + reorder + adaptive"  # the plan measured against "coupled" (speedup_vs_coupled)


def _mm(steps: int, micro: int, group: int) -> dict:
    return validate_multimodal({
        "image": {"size": 32, "patch": 4, "pool": 8},
        "encoder": {"layers": 3, "hidden": 128, "heads": 4},
        "data": {"max_images": 4, "min_text": 16, "max_text": 64},
        "mix": [{"step": 0, "image_prob": 0.1}, {"step": max(1, steps - 1), "image_prob": 0.9}],
        "micro_batches": micro,
        "reorder": {"group_batches": group},
    })


def _plan(planner, items, world, micro):
    if planner == "coupled":
        return coupled_plan(items, world, micro)
    if planner == "disjoint":
        return decoupled_plan(items, Layout((0,), tuple(range(1, world))), micro)
    layout = choose_layout(sum(i.enc for i in items), sum(i.llm for i in items), world, micro)
    return decoupled_plan(items, layout, micro)


def model_imbalance(plan, items, world) -> tuple[float, float]:
    """(busiest rank's load, mean rank load) of a plan under the cost model, counting
    LLM padding (a micro-batch costs its sample count x its longest sequence on a rank)
    and each rank's encoder jobs. Noise-free: what the plan alone makes possible."""
    by = {it.id: it for it in items}
    load = [0.0] * world
    for mp in plan.micro:
        for r in range(world):
            mine = [by[s] for s in mp.ids if mp.llm_owner[s] == r]
            if mine:
                load[r] += len(mine) * max(it.llm for it in mine)
            load[r] += sum(by[s].enc for s in mp.ids if mp.enc_owner.get(s) == r)
    return max(load), sum(it.enc + it.llm for it in items) / world


def _variant(rank, world, name, mm, steps, batch, device):
    reorder, planner = VARIANTS[name]
    data = SyntheticData(mm, GPT.vocab, GPT.seq_len, batch, seed=0)
    torch.manual_seed(0)
    model = MMModel(GPT, mm).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eng = DistEngine(model, opt, data, rank, world)
    cost = CostModel.from_flops(model)
    # Reordering balances the cost model's loads; it is computed once up front like a
    # loader's prefetch and the same for every variant that reorders.
    load = lambda i: (lambda it: (it.enc, it.llm))(cost.item(data.meta(i), data.per_image, data.per_audio))  # noqa: E731
    order = list(batches(steps, batch, load, mm["reorder"]["group_batches"], world, enabled=reorder))
    # The noise-free figure uses the FLOP cost model (the same for every variant).
    flops = CostModel.from_flops(model)
    model_load = [0.0, 0.0]
    for ids in order:
        items = plan_items(data, ids, flops)
        mx, mean = model_imbalance(_plan(planner, items, world, mm["micro_batches"]), items, world)
        model_load[0] += mx
        model_load[1] += mean
    layouts, losses, busy, cpu = Counter(), [], [], []
    dist.barrier()
    t0 = time.perf_counter()
    for step, ids in enumerate(order):
        items = plan_items(data, ids, cost)
        plan = _plan(planner, items, world, mm["micro_batches"])
        layouts[("shared " if set(plan.layout.enc_ranks) & set(plan.layout.llm_ranks) else "") + plan.layout.ratio] += 1
        c0 = time.thread_time()
        st = eng.step(ids, plan, cost)
        cpu.append(time.thread_time() - c0)
        w = st.modules["work"]
        cost.observe(w["enc_s"], w["enc_units"], w["llm_s"], w["llm_tokens"], first=(step == 0))
        losses.append(st.loss)
        busy.append(sum(v for m in ("encoder", "llm") for k, v in st.modules.get(m, {}).items() if k in ("forward", "backward")))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    return (time.perf_counter() - t0, losses, dict(layouts), sorted(i for b in order for i in b), busy,
            model_load[0] / model_load[1], cpu)


def _rank_main(rank, world, steps, batch, micro, group, trials, device, partial=None):
    mm = _mm(steps, micro, group)
    dev = torch.device(device)
    if dev.type == "cuda":
        # One GPU per rank where there are enough; else ranks share GPU 0 (gloo then
        # stages embeddings through host memory; NCCL refuses two ranks on one GPU).
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    out = {n: {"wall": [], "losses": None, "layouts": None, "ids": None, "busy": [], "model": None, "cpu": []}
           for n in VARIANTS}
    # Untimed warm-up (allocator, kernels, gloo pairs) so the first timed variant pays no
    # one-off costs; and each trial starts at another variant, so none is always first.
    _variant(rank, world, HEAD, mm, 2, batch, dev)
    names = list(VARIANTS)
    for t in range(trials):
        for name in names[t % len(names):] + names[:t % len(names)]:
            wall, losses, layouts, ids, busy, model, cpu = _variant(rank, world, name, mm, steps, batch, dev)
            out[name]["wall"].append(wall)
            out[name]["cpu"].append(cpu)
            out[name]["busy"].extend(busy)
            out[name].update(losses=losses, layouts=layouts, ids=ids, model=model)
            if rank == 0 and partial:  # rank 0's wall times so far: a step timeout keeps every variant run
                from bench._partial import write_json

                walls = {k: v["wall"] for k, v in out.items() if v["wall"]}
                sofar = ({"speedup_vs_coupled": statistics.median(walls["coupled"]) / statistics.median(walls[HEAD])}
                         if "coupled" in walls and HEAD in walls else {})
                write_json(partial, {**run_info(world, device), "steps": steps, "batch": batch,
                                     "trials_done": min(len(v["wall"]) for v in out.values()),
                                     "run_s_trials": walls, **sofar,
                                     "layouts": {k: v["layouts"] for k, v in out.items()}}, complete=False, indent=2)
    return out


def run_info(world: int, device: str) -> dict:
    """Where the ranks ran: on CUDA, how many GPUs they had (ranks beyond the GPU count
    share GPU 0.. round-robin, time-sharing it: no MPS, gloo through host memory)."""
    info = {"ranks": world, "device": device}
    if device.startswith("cuda"):
        gpus = torch.cuda.device_count()
        info.update(gpus=gpus, ranks_per_gpu=-(-world // max(1, gpus)),
                    note="ranks time-share one GPU (no MPS); gloo stages tensors through host memory"
                    if world > gpus else "one GPU per rank; gloo stages tensors through host memory")
    return info


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="steps per reordering group")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    from bench._partial import NO_CUDA, write_json

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        raise SystemExit(2)
    allres = run_ranks(a.ranks, _rank_main, a.steps, a.batch, a.micro_batches, a.group, a.trials, a.device,
                       os.path.abspath(a.json) if a.json else None)
    res = allres[0]
    # Load imbalance: per step, the busiest rank's compute over the mean rank's (1.00 = even).
    imb = {}
    for k in VARIANTS:
        per_step = list(zip(*[r[k]["busy"] for r in allres]))
        imb[k] = statistics.mean(max(s) / (sum(s) / len(s)) for s in per_step if sum(s) > 0)
    # Honesty checks: every variant trained exactly the same samples.
    ids = {tuple(v["ids"]) for v in res.values()}
    assert len(ids) == 1, "variants saw different samples"
    med = {k: statistics.median(v["wall"]) for k, v in res.items()}
    base = med["coupled"]
    # Noise-robust companion to wall time on a shared machine: each step's critical path
    # in CPU seconds (the busiest rank's main-thread CPU time; a preempted rank accrues
    # none), summed over the run; median over trials. Blind to time spent waiting.
    # On CUDA the main thread's CPU time is no critical path (backward runs on autograd's
    # device thread, and synchronize spins): not reported there.
    cuda = a.device.startswith("cuda")
    crit = {k: (None if cuda else statistics.median(sum(max(r[k]["cpu"][t][s] for r in allres)
                                                        for s in range(len(res[k]["cpu"][t])))
                                                    for t in range(a.trials))) for k in VARIANTS}
    print(f"mm_reshard: {a.ranks} ranks ({a.device}{'' if cuda else ', 1 thread each'}), {a.steps} steps x batch {a.batch}, "
          f"{a.micro_batches} micro-batches, image_prob 0.1 -> 0.9, {a.trials} trials")
    print(f"{'variant':<30}{'run s':>8}{'min-max s':>12}{'samples/s':>11}{'speedup':>9}{'cpu-crit s':>11}{'speedup':>9}"
          f"{'imbal.':>8}{'model':>7}  {'final loss':>10}  layouts used (steps)")
    for k, v in med.items():
        r = res[k]
        spread = f"{min(r['wall']):.2f}-{max(r['wall']):.2f}"
        cc = f"{crit[k]:>11.2f}{crit['coupled'] / crit[k]:>8.2f}x" if crit[k] else f"{'-':>11}{'-':>9}"
        print(f"{k:<30}{v:>8.2f}{spread:>12}{a.steps * a.batch / v:>11.1f}{base / v:>8.2f}x{cc}"
              f"{imb[k]:>8.2f}{r['model']:>7.2f}  {r['losses'][-1]:>10.4f}  {r['layouts']}")
    print("run s: wall time of the run, median over trials (min-max). cpu-crit s: per step the busiest rank's CPU "
          "seconds, summed (median over trials). imbal.: measured busiest rank's compute / mean rank's, per step. "
          "model: the plan's padded cost (FLOP model) over the run, busiest rank / ideal even split; coupled's "
          "model over a variant's is the most that better balance alone can buy.")
    out = {
        **run_info(a.ranks, a.device),
        "steps": a.steps,
        "batch": a.batch,
        "run_s": med,
        "layouts": {k: v["layouts"] for k, v in res.items()},
        "run_s_trials": {k: v["wall"] for k, v in res.items()},
        "cpu_critical_path_s": crit,
        "speedup_vs_coupled_cpu_critical_path": None if cuda else crit["coupled"] / crit[HEAD],
        "imbalance": imb,
        "model_imbalance": {k: v["model"] for k, v in res.items()},
        "final_loss": {k: v["losses"][-1] for k, v in res.items()},
        "speedup_vs_coupled": base / med[HEAD],
        # Noise-free, from the FLOP cost model: what the head plan's balance buys over
        # coupled, and the most any plan could (perfect balance, no padding: coupled's
        # busiest rank over the even split of the same work).
        "model_speedup_vs_coupled": res["coupled"]["model"] / res[HEAD]["model"],
        "model_ceiling_vs_coupled": res["coupled"]["model"],
    }
    cp = out["speedup_vs_coupled_cpu_critical_path"]
    print(f"speedup_vs_coupled = {out['speedup_vs_coupled']:.2f}x (wall); "
          f"{'-' if cp is None else f'{cp:.2f}x'} (CPU critical path); "
          f"cost model: {out['model_speedup_vs_coupled']:.2f}x, at most {out['model_ceiling_vs_coupled']:.2f}x "
          f"for any plan of these samples on {a.ranks} ranks; "
          f"load average {os.getloadavg()[0]:.1f}")
    write_json(a.json, out, complete=True, indent=2)
    return out


if __name__ == "__main__":
    main()
