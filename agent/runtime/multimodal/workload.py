"""Executor entry point of the ``multimodal`` workload.

Contract: ``run(spec, reporter) -> int`` trains for ``workload.steps`` steps and returns
0, or reports one ``error`` event (with ``rank``, from whichever rank failed, even one
whose reporter is disabled) and returns 2 (bad spec) / 1 (anything else). ``spec``
is ``{"job_id", "workload": {...}, "dist": {rank, world_size, master_addr, master_port,
backend}, "checkpoint_dir", "threads"}``. Mode ``colocated`` runs on one rank with the
encoder and the LLM on separate quotas; ``disaggregated`` uses every rank of ``dist``,
choosing each step's encoder:LLM split from the measured cost model unless
``disaggregated.encoder_ranks`` pins it. Events: ``start``; per step a ``progress`` with
``module: "multimodal"`` (loss, step_time_s, phases) and one per module (``encoder``,
``llm``) whose phases (forward, backward, communication, idle: time waiting on the other
module) are this process's in colocated mode and summed over all ranks in disaggregated
mode (``ranks`` says over how many); the agent forwards them to profilerd; ``checkpoint``;
``done``. A checkpoint in ``checkpoint_dir`` (written atomically and durably: temp file,
fsync, rename, fsync of the directory) is resumed from. It records the world size that
ordered the data-loader group of its step, so a relaunch with another world size (resize /
reshard / preempt) finishes that group in its saved order and reorders only later groups
for the new size: the epoch still sees each sample exactly once as long as the relaunch
keeps ``steps``, ``batch_size``, ``seed``, the model and ``multimodal.reorder``. A
checkpoint written before that field existed resumes as if its world size were the new
one (exact only when the world size is unchanged or it stopped on a group boundary). On
SIGTERM (``agent.runtime.train.STOP``) every rank leaves after the same step, rank 0
checkpoints, an ``error`` event says so and the exit code is 143 (the controller's
resize / reshard / preempt path relaunches from that checkpoint). A step whose loss or a
gradient is not finite fails before its update (as the gpt workload): ``FloatingPointError``
naming the step, an ``error`` event, exit 1; no checkpoint is written for it, so the last one
stays finite. In disaggregated mode every rank sees the same all-reduced loss and gradients,
so all ranks fail at the same step.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch

from agent.runtime.heap import keep_heap
from agent.runtime.model import GPTConfig
from agent.runtime.multimodal.data import SyntheticData
from agent.runtime.multimodal.disagg import CostModel, DistEngine, init_from_spec, plan_items
from agent.runtime.multimodal.engine import ColocatedEngine, StepStats
from agent.runtime.multimodal.models import MMModel
from agent.runtime.multimodal.reorder import batches, group_ranks
from agent.runtime.multimodal.reshard import choose_layout, decoupled_plan
from agent.runtime.optim import make_adamw
from agent.runtime.report import Reporter
from agent.runtime.threads import ThreadFollower
from tessera.errors import SpecError
from tessera.fsutil import atomic_write
from tessera.spec.multimodal import media_tokens_max, validate_multimodal

CKPT_NAME = "multimodal.pt"
EXIT_TERM = 143  # stopped by SIGTERM after a checkpoint (as agent.runtime.train)


def _stop_agreed(distributed: bool) -> bool:
    """Whether any rank got SIGTERM (``agent.runtime.train.STOP``, set by the entry
    point). Distributed ranks agree in one all-reduce per step, so that every rank leaves
    after the same step and no collective is left waiting."""
    from agent.runtime.train import STOP
    stop = STOP.is_set()
    if not distributed:
        return stop
    import torch.distributed as dist
    t = torch.tensor([1.0 if stop else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0] > 0)


def _checked(step: int, fn, *args):
    """``fn(*args)`` (one engine step); its ``FloatingPointError`` (a non-finite loss or
    gradient, raised before the update) names the 1-based step."""
    try:
        return fn(*args)
    except FloatingPointError as e:
        raise FloatingPointError(f"{e} at step {step + 1}") from None


def _int(wl: dict, name: str, default: int, minimum: int = 1) -> int:
    v = wl.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise SpecError(f"workload.{name}", f"must be an integer >= {minimum}, got {v!r}")
    return v


def parse(workload: dict) -> tuple[GPTConfig, dict, dict]:
    """(model config, validated multimodal section, run params) from a manifest's workload."""
    try:
        cfg = GPTConfig(**(workload.get("model") or {}))
    except (TypeError, ValueError) as e:
        raise SpecError("workload.model", str(e)) from e
    mm = validate_multimodal(workload.get("multimodal"), "workload.multimodal")
    need = media_tokens_max(mm) + mm["data"]["min_text"]
    if need > cfg.seq_len:
        raise SpecError("workload.multimodal.data.max_images",
                        f"largest sample needs {need} positions (media + data.min_text) > model.seq_len {cfg.seq_len}")
    lr = workload.get("learning_rate", 3e-3)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr <= 0:
        raise SpecError("workload.learning_rate", f"must be a positive number, got {lr!r}")
    params = {
        "steps": _int(workload, "steps", 60),
        "batch_size": _int(workload, "batch_size", 8),
        "seed": _int(workload, "seed", 0, minimum=0),
        "learning_rate": float(lr),
        "checkpoint_every": _int(workload, "checkpoint_every", 0, minimum=0),
    }
    return cfg, mm, params


def _phases(st: StepStats) -> dict[str, float]:
    agg = {"forward": 0.0, "backward": 0.0, "communication": 0.0, "optimizer": 0.0}
    for mod, ph in st.modules.items():
        if mod == "work":
            continue
        for k, v in ph.items():
            if k in ("forward", "backward", "communication"):
                agg[k] += v
            elif mod == "optimizer":
                agg["optimizer"] += v
    return agg


def _save(path: str, model: MMModel, opt: torch.optim.Optimizer, step: int, order: dict | None = None) -> None:
    """Write the checkpoint atomically and durably (``tessera.fsutil.atomic_write``): a
    temp file in the same directory, flushed and fsynced, renamed over ``path``, then the
    directory fsynced, so after a crash a reader finds the old or the new checkpoint whole.
    ``order``: ``{"ranks", "group_batches"}`` that ordered the loader group of ``step``."""
    state: dict[str, Any] = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
    if order is not None:
        state["order"] = order
    atomic_write(path, lambda f: torch.save(state, f))  # creates a fresh directory the agent handed over


def _emit_error(reporter: Reporter, rank: int, message: str, **fields: Any) -> None:
    # Errors are reported by every rank (as agent.runtime.train): a failing non-zero rank,
    # whose reporter is disabled, must still be heard.
    (reporter if reporter.enabled else Reporter()).event("error", message=message, rank=rank, **fields)


def run(spec: dict, reporter: Reporter) -> int:
    """Train the multimodal workload described by ``spec``; see the module doc."""
    try:
        rank = int(((spec.get("dist") or {}) if isinstance(spec, dict) else {}).get("rank", 0))
    except (TypeError, ValueError):
        rank = 0
    try:
        return _run(spec, reporter)
    except SpecError as e:
        _emit_error(reporter, rank, str(e), field=e.field)
        return 2
    except Exception as e:  # noqa: BLE001 - the agent needs one event, not only a traceback
        traceback.print_exc(file=sys.stderr)
        _emit_error(reporter, rank, f"{type(e).__name__}: {e}")
        return 1


def _run(spec: dict, reporter: Reporter) -> int:
    wl = spec["workload"]
    cfg, mm, p = parse(wl)
    d = spec.get("dist") or {}
    rank, world = int(d.get("rank", 0)), int(d.get("world_size", 1))
    if mm["mode"] == "colocated" and world != 1:
        raise SpecError("resources.devices", f"colocated mode runs on one device, got world_size {world}")
    keep_heap()
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    follower = ThreadFollower(int(spec.get("threads") or 0))  # disaggregated ranks: intra-op threads
    data = SyntheticData(mm, cfg.vocab, cfg.seq_len, p["batch_size"], p["seed"])
    torch.manual_seed(p["seed"])
    model = MMModel(cfg, mm)
    opt = make_adamw(model.parameters(), lr=p["learning_rate"])
    ckpt_dir = spec.get("checkpoint_dir")
    ckpt = os.path.join(ckpt_dir, CKPT_NAME) if ckpt_dir else None
    start = 0
    resume_ranks: int | None = None  # the world size that ordered the loader group of ``start``
    G = mm["reorder"]["group_batches"]
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        order = state.get("order")  # absent in older checkpoints: order as the new world size
        if isinstance(order, dict) and int(order.get("group_batches", -1)) == G:
            resume_ranks = int(order["ranks"])
    reporter.event("start", job_id=spec.get("job_id"), workload="multimodal", mode=mm["mode"],
                   world_size=world, steps=p["steps"], resumed_from=start)

    ranks = 1 if mm["mode"] == "colocated" else world
    cost = CostModel.from_flops(model)
    # The loader orders by a cost model of its own that never follows measurements: a
    # group's order must be a pure function of the run's spec and world size, so that a
    # resumed run rebuilds it exactly.
    order_cost = CostModel.from_flops(model)

    def load(i: int) -> tuple[float, float]:
        it = order_cost.item(data.meta(i), data.per_image, data.per_audio)
        return it.enc, it.llm

    loader = batches(p["steps"], p["batch_size"], load, G, ranks,
                     mm["reorder"]["enabled"], start_step=start, resume_ranks=resume_ranks)

    def order_at(step: int) -> dict:
        return {"ranks": group_ranks(step, G, ranks, start, resume_ranks), "group_batches": G}
    colo = dist_eng = None
    joined_here = False  # whether this run joined the process group (then it leaves it)
    if mm["mode"] == "colocated":
        colo = ColocatedEngine(model, opt, mm["colocated"]["encoder_quota"], mm["micro_batches"],
                               pin=mm["colocated"]["pin"])
    else:
        joined_here = world > 1 and not torch.distributed.is_initialized()
        init_from_spec(d)
        dist_eng = DistEngine(model, opt, data, rank, world)

    def leave() -> None:
        """Every rank leaves the group it joined together (a barrier, then destroy) instead
        of exiting with it alive: on a loaded host rank 1 once aborted at its exit ("terminate
        called without an active exception", exit 134) while rank 0 was still writing the
        final checkpoint — a process that tears gloo down under a live peer can abort."""
        if joined_here and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()

    dg = mm["disaggregated"]
    pinned = None if dg["encoder_ranks"] == "auto" else dg["encoder_ranks"]
    loss = float("nan")
    stopped_at = 0
    try:
        for step, ids in enumerate(loader, start=start):
            extra: dict[str, Any] = {}
            if colo is not None:
                split = colo.follow_grant()  # the agent may have changed our cores live (UpdateGrant)
                if split is not None:
                    reporter.event("threads", job_id=spec.get("job_id"), threads=len(split[0]) + len(split[1]),
                                   cores=len(colo.cpus), encoder_cores=split[0], llm_cores=split[1], step=step)
                st = _checked(step, colo.step, [data.sample(i) for i in ids])
                extra["encoder_quota"] = mm["colocated"]["encoder_quota"]
            else:
                threads = follower.poll()  # the agent may have changed our cores live (UpdateGrant)
                if threads is not None:
                    reporter.event("threads", job_id=spec.get("job_id"), threads=threads, cores=follower.cores, step=step)
                items = plan_items(data, ids, cost)
                if dg["adaptive"] or step == start or pinned is not None:
                    layout = choose_layout(sum(i.enc for i in items), sum(i.llm for i in items), world,
                                           mm["micro_batches"], dg["allow_shared"], pinned)
                st = _checked(step, dist_eng.step, ids, decoupled_plan(items, layout, mm["micro_batches"]), cost)
                w = st.modules["work"]
                cost.observe(w["enc_s"], w["enc_units"], w["llm_s"], w["llm_tokens"], first=(step == start))
                extra.update(layout=layout.ratio, encoder_ranks=list(layout.enc_ranks), llm_ranks=list(layout.llm_ranks))
            loss = st.loss
            reporter.event("progress", step=step + 1, total=p["steps"], loss=loss, step_time_s=st.wall_s,
                           phases=_phases(st), module="multimodal",
                           images=sum(data.meta(i).n_images for i in ids), **extra)
            # Per-module time and idle time for profilerd. Only rank 0 reports, so a
            # distributed step reports the phases summed over every rank (``st.world``).
            per_mod = st.world or st.modules
            for mod in ("encoder", "llm"):
                if mod in per_mod:
                    reporter.event("progress", step=step + 1, total=p["steps"], step_time_s=st.wall_s,
                                   phases={"idle": 0.0, **per_mod[mod]}, module=mod, ranks=world)
            every = p["checkpoint_every"]
            stop = _stop_agreed(dist_eng is not None and world > 1)
            if ckpt and rank == 0 and step + 1 < p["steps"] and (stop or (every and (step + 1) % every == 0)):
                _save(ckpt, model, opt, step + 1, order_at(step + 1))
                reporter.event("checkpoint", path=ckpt, step=step + 1)
            if stop and step + 1 < p["steps"]:
                stopped_at = step + 1
                break
    finally:
        if colo is not None:
            colo.close()
    if stopped_at:
        saved = f"checkpoint at step {stopped_at}" if ckpt else "no checkpoint"
        _emit_error(reporter, rank, f"stopped by SIGTERM after step {stopped_at} ({saved})", signal="SIGTERM")
        leave()
        return EXIT_TERM
    if ckpt and rank == 0:
        _save(ckpt, model, opt, p["steps"], order_at(p["steps"]))
        reporter.event("checkpoint", path=ckpt, step=p["steps"])
    reporter.event("done", final_loss=loss)
    leave()
    return 0
