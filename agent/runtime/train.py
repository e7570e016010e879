"""The ``gpt`` workload: train a GPT under any dp x tp x pp plan, with checkpoints.

Contract: ``run(spec, reporter) -> exit code`` (0 done, 1 failure, 2 invalid spec,
143 stopped by SIGTERM via :data:`STOP`). It reports ``start``, one ``progress`` per
step, ``checkpoint`` and ``done`` through ``reporter`` (enabled on rank 0 only) and
``error`` on any rank. Step s (0-based) trains on the global batch
``source.batch(s, batch_size, seq_len)``; each rank keeps its rows (plan.batch_rows).
A checkpoint in ``checkpoint_dir`` is resumed from, whatever plan wrote it.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from agent.runtime import checkpoint as ckptmod
from agent.runtime.data import make_source
from agent.runtime.heap import keep_heap
from agent.runtime.model import GPT, GPTConfig
from agent.runtime.optim import adamw_impl, all_finite, is_fused, make_adamw
from agent.runtime.parallel import comm
from agent.runtime.parallel import context as pctx
from agent.runtime.parallel.pipeline import average_gradients, forward_backward, forward_backward_1f1b
from agent.runtime.parallel.stage import StageModule, merge_pieces
from agent.runtime.parallel.tp import shard, unshard
from agent.runtime.plan import Plan, replica_rows, stage_layers, validate
from agent.runtime.report import Reporter
from agent.runtime.threads import ThreadFollower
from tessera import log
from tessera.errors import SpecError

# Set by the entry point's SIGTERM watcher; polled between steps by every runner.
STOP = threading.Event()

EXIT_OK, EXIT_FAIL, EXIT_SPEC, EXIT_TERM = 0, 1, 2, 143

# Pipeline schedules by name; both compute the same gradients (1F1B holds fewer activations).
SCHEDULES = {"gpipe": forward_backward, "1f1b": forward_backward_1f1b}


@dataclass(frozen=True)
class GPTJob:
    """The validated ``gpt`` part of an executor spec (defaults for optional fields)."""

    job_id: str
    cfg: GPTConfig
    steps: int
    batch_size: int
    learning_rate: float
    seed: int
    data: dict
    plan: Plan
    checkpoint_every: int
    checkpoint_dir: str | None
    threads: int | None
    weight_decay: float
    schedule: str = "1f1b"
    dist: dict = field(default_factory=dict)
    step_delay_s: float = 0.0  # each step first waits this long for its input (an input-bound job)

    @property
    def rank(self) -> int:
        return int(self.dist.get("rank", 0))

    @property
    def world_size(self) -> int:
        return int(self.dist.get("world_size", 1))


def _int(d: dict, key: str, field_: str, default: int | None = None, minimum: int = 1) -> int:
    v = d.get(key, default)
    if v is None:
        raise SpecError(field_, "is required")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise SpecError(field_, f"must be an integer >= {minimum}, got {v!r}")
    return v


def parse_spec(spec: dict) -> GPTJob:
    """Validate an executor spec for the gpt workload; SpecError names the bad field."""
    if not isinstance(spec, dict):
        raise SpecError("spec", "must be an object")
    w = spec.get("workload")
    if not isinstance(w, dict):
        raise SpecError("workload", "must be an object")
    m = w.get("model") or {}
    if not isinstance(m, dict):
        raise SpecError("workload.model", "must be an object")
    try:
        cfg = GPTConfig(**m)
    except TypeError as e:
        raise SpecError("workload.model", str(e)) from e
    except ValueError as e:
        raise SpecError("workload.model", str(e)) from e
    lr = w.get("learning_rate", 3e-3)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and math.isfinite(lr)):
        raise SpecError("workload.learning_rate", f"must be a positive number, got {lr!r}")
    wd = w.get("weight_decay", 0.0)
    if isinstance(wd, bool) or not isinstance(wd, (int, float)) or wd < 0:
        raise SpecError("workload.weight_decay", f"must be a number >= 0, got {wd!r}")
    delay = w.get("step_delay_s", 0.0)
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not (0.0 <= delay <= 3600.0):
        raise SpecError("workload.step_delay_s", f"must be a number in [0, 3600], got {delay!r}")
    schedule = w.get("pipeline_schedule", "1f1b")
    if schedule not in SCHEDULES:
        raise SpecError("workload.pipeline_schedule", f"must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    d = spec.get("dist") or {}
    if not isinstance(d, dict):
        raise SpecError("dist", "must be an object")
    world = _int(d, "world_size", "dist.world_size", 1)
    rank = _int(d, "rank", "dist.rank", 0, minimum=0)
    if rank >= world:
        raise SpecError("dist.rank", f"{rank} >= world_size {world}")
    plan = Plan.from_dict(w.get("plan"))
    job = GPTJob(
        job_id=str(spec.get("job_id", "")),
        cfg=cfg,
        steps=_int(w, "steps", "workload.steps", 100),
        batch_size=_int(w, "batch_size", "workload.batch_size", 8),
        learning_rate=float(lr),
        seed=_int(w, "seed", "workload.seed", 0, minimum=0),
        data=w.get("data") or {"kind": "synthetic"},
        plan=plan,
        checkpoint_every=_int(w, "checkpoint_every", "workload.checkpoint_every", 50, minimum=0),
        checkpoint_dir=spec.get("checkpoint_dir") or None,
        threads=_int(spec, "threads", "threads", None, minimum=1) if spec.get("threads") is not None else None,
        weight_decay=float(wd),
        schedule=schedule,
        dist=d,
        step_delay_s=float(delay),
    )
    validate(plan, layers=cfg.layers, heads=cfg.heads, hidden=cfg.hidden, batch_size=job.batch_size, world_size=world)
    return job


def build_stage(job: GPTJob, ctx: pctx.ParallelContext) -> StageModule:
    """This rank's stage, initialised from the full GPT that ``seed`` gives on one process.

    Every rank builds the full model and keeps its shard, so the initial weights do not
    depend on the plan (cheap for the model sizes executors run on CPU; a large model
    would load a checkpoint instead).
    """
    torch.manual_seed(job.seed)
    full = GPT(job.cfg).state_dict()
    stages = stage_layers(job.cfg.layers, job.plan.pp)
    c = ctx.coord
    stage = StageModule(
        job.cfg,
        stages[c.pp],
        first=c.pp == 0,
        last=c.pp == job.plan.pp - 1,
        tp=job.plan.tp,
        tp_rank=c.tp,
        tp_group=ctx.tp_group,
    )
    stage.load_full(full)
    return stage.to(ctx.device)


def make_optimizer(stage: torch.nn.Module, job: GPTJob) -> torch.optim.Optimizer:
    # Element-wise AdamW: a shard's update equals the same slice of the full update,
    # which is what lets optimizer state be resharded freely (fused by default:
    # agent.runtime.optim).
    return make_adamw(stage.parameters(), lr=job.learning_rate, weight_decay=job.weight_decay)


def _local_optim(stage: StageModule, opt: torch.optim.Optimizer) -> dict[str, dict]:
    out = {}
    for name, p in stage.named_parameters():
        st = opt.state.get(p)
        if st:
            out[name] = {
                "step": float(st["step"]),
                "exp_avg": st["exp_avg"].detach().cpu().clone(),
                "exp_avg_sq": st["exp_avg_sq"].detach().cpu().clone(),
            }
    return out


def gather_full_state(stage: StageModule, opt: torch.optim.Optimizer, ctx: pctx.ParallelContext) -> tuple[dict, dict] | None:
    """Full (unsharded) model and optimizer state on rank 0, None on other ranks.

    Collective: every rank must call it. Only replica 0 contributes; other replicas
    hold identical copies.
    """
    mine = None
    if ctx.coord.dp == 0:
        mine = {"coord": (ctx.coord.pp, ctx.coord.tp), "model": stage.local_pieces(), "optim": _local_optim(stage, opt)}
    if ctx.initialized:
        objs = [None] * ctx.plan.world_size if ctx.rank == 0 else None
        dist.gather_object(mine, objs, dst=0)
        if ctx.rank != 0:
            return None
    else:
        objs = [mine]
    by = {o["coord"]: o for o in objs if o is not None}
    model, optim = {}, {}
    for p in range(ctx.plan.pp):
        shards = [by[(p, t)] for t in range(ctx.plan.tp)]
        model.update(merge_pieces([s["model"] for s in shards]))
        for name in shards[0]["optim"]:
            optim[name] = {
                "step": shards[0]["optim"][name]["step"],
                "exp_avg": unshard(name, [s["optim"][name]["exp_avg"] for s in shards]),
                "exp_avg_sq": unshard(name, [s["optim"][name]["exp_avg_sq"] for s in shards]),
            }
    return model, optim


def load_state(stage: StageModule, opt: torch.optim.Optimizer, ckpt: dict) -> None:
    """Load this rank's shards of a full checkpoint into the stage and its optimizer."""
    stage.load_full(ckpt["model"])
    dev = next(stage.parameters()).device
    for name, p in stage.named_parameters():
        st = ckpt["optim"].get(name)
        if st is None:
            continue
        opt.state[p] = {
            # AdamW keeps a float32 CPU step counter unless capturable/fused (then on
            # the parameters' device).
            "step": torch.tensor(float(st["step"]), dtype=torch.float32, device=dev if is_fused(opt) else None),
            "exp_avg": shard(name, st["exp_avg"], stage.tp_rank, stage.tp).to(dev),
            "exp_avg_sq": shard(name, st["exp_avg_sq"], stage.tp_rank, stage.tp).to(dev),
        }


def _save(job, stage, opt, ctx, step, first_loss, last_loss, reporter) -> None:
    state = gather_full_state(stage, opt, ctx)
    if state is None:
        return
    model, optim = state
    obj = {
        "format": ckptmod.FORMAT,
        "step": step,
        "plan": job.plan.to_dict(),
        "model_config": job.cfg.to_dict(),
        "model": model,
        "optim": optim,
        "optim_hparams": {"lr": job.learning_rate, "weight_decay": job.weight_decay},
        "data": {"seed": job.seed, "next_step": step},
        "rng": {"torch": torch.get_rng_state()},
        "first_loss": first_loss,
        "last_loss": last_loss,
    }
    path = ckptmod.save(obj, job.checkpoint_dir)
    reporter.event("checkpoint", job_id=job.job_id, path=path, step=step)


def _grads_finite(params) -> bool:
    """Whether every gradient of ``params`` is finite (exact; ``optim.all_finite``)."""
    return all_finite(p.grad for p in params)


def _reduce_step(loss_local: float, stop: bool, ctx: pctx.ParallelContext,
                 grads_ok: bool = True) -> tuple[float, bool, bool]:
    """Global mean loss, "any rank asked to stop" and "every rank's gradients are finite"
    in one all-reduce.

    Only tensor shard 0 of the last stage counts its loss (the other shards hold the
    same value); replicas are averaged. Agreeing on stop makes every rank leave at the
    same step, so the final checkpoint's collectives cannot hang; agreeing on the
    gradients makes every rank fail at the same step, before any update (a non-finite
    gradient must never reach the weights, nor a checkpoint).
    """
    if not ctx.initialized:
        return loss_local, stop, grads_ok
    counts = ctx.last_stage and ctx.coord.tp == 0
    t = torch.tensor([loss_local if counts else 0.0, 1.0 if stop else 0.0, 0.0 if grads_ok else 1.0],
                     dtype=torch.float64, device=ctx.device)
    comm.all_reduce(t, ctx.world_group)
    return float(t[0]) / ctx.plan.dp, bool(t[1] > 0), not bool(t[2] > 0)


def _agree_on_start(start_step: int, ctx: pctx.ParallelContext, checkpoint_dir: str | None) -> None:
    """Every rank must resume from the same checkpoint step: each loads the checkpoint
    itself, and a stale view of shared storage (or a file replaced between two loads)
    would otherwise leave ranks at different steps, hanging a collective or mixing two
    checkpoints. RuntimeError naming both steps when they differ."""
    if not ctx.initialized:
        return
    t = torch.tensor([start_step, -start_step], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.world_group)
    hi, lo = int(t[0]), int(-t[1])
    if hi != lo:
        raise RuntimeError(f"ranks loaded different checkpoints of {checkpoint_dir} (steps {lo} and {hi}): "
                           "the checkpoint directory is not the same on every rank (stale shared storage?)")


def train(job: GPTJob, reporter: Reporter) -> int:
    """The training loop proper (spec already validated)."""
    keep_heap()
    adamw_impl()  # a bad TESSERA_ADAMW fails here, before any rank joins a group
    if job.threads:
        torch.set_num_threads(job.threads)
    follower = ThreadFollower(job.threads)
    logger = log.get(job_id=job.job_id, rank=job.rank)
    t0 = time.perf_counter()
    ctx = pctx.init(job.plan, job.dist)
    logger.info("joined", plan=job.plan.to_dict(), coord=vars(ctx.coord), device=str(ctx.device),
                backend=job.dist.get("backend", "gloo"), seconds=round(time.perf_counter() - t0, 3))
    try:
        source = make_source(job.data, job.cfg.vocab, job.seed)
        stage = build_stage(job, ctx)
        opt = make_optimizer(stage, job)
        start_step, first_loss, loss = 0, None, None
        ckpt = ckptmod.load(job.checkpoint_dir)
        if ckpt is not None:
            if ckpt.get("format") != ckptmod.FORMAT:
                raise SpecError("checkpoint_dir", f"unknown checkpoint format {ckpt.get('format')!r}")
            if ckpt["model_config"] != job.cfg.to_dict():
                raise SpecError("workload.model", "differs from the model the checkpoint was written for")
            saved_seed = (ckpt.get("data") or {}).get("seed")
            if saved_seed is not None and saved_seed != job.seed:
                raise SpecError("workload.seed", f"is {job.seed}, the checkpoint was written with seed {saved_seed}: "
                                                 "resuming would train on another data stream")
            load_state(stage, opt, ckpt)
            torch.set_rng_state(ckpt["rng"]["torch"])
            start_step = int(ckpt["step"])
            first_loss, loss = ckpt.get("first_loss"), ckpt.get("last_loss")
        _agree_on_start(start_step, ctx, job.checkpoint_dir)
        if ckpt is not None:
            logger.info("resumed", step=start_step, from_plan=ckpt["plan"], to_plan=job.plan.to_dict())
        params = list(stage.parameters())
        reporter.event(
            "start",
            job_id=job.job_id,
            workload="gpt",
            module="gpt",
            total=job.steps,
            step=start_step,
            resumed=ckpt is not None,
            resumed_plan=ckpt["plan"] if ckpt is not None else None,
            plan=job.plan.to_dict(),
            world_size=job.plan.world_size,
            params=job.cfg.num_params(),
        )
        if start_step >= job.steps:
            # Resumed from the checkpoint of a run that had already finished (a stop that
            # raced its last steps: their progress went to an allocation the controller had
            # replaced): nothing to train. Say where it stands, as its last step would have
            # (no step time: no step ran here).
            reporter.event("progress", job_id=job.job_id, module="gpt", step=start_step, total=job.steps,
                           **({"loss": loss} if loss is not None else {}))
        tokens_per_step = job.batch_size * job.cfg.seq_len
        last_saved = start_step if ckpt is not None else -1
        stopped = False
        for step in range(start_step, job.steps):
            t_start = time.perf_counter()
            comm.TIMER.reset()
            threads = follower.poll()  # the agent may have changed our cores live (UpdateGrant)
            if threads is not None:
                logger.info("threads follow the grant", threads=threads, cores=follower.cores, step=step)
                reporter.event("threads", job_id=job.job_id, threads=threads, cores=follower.cores, step=step)
            if job.step_delay_s:
                # Input-bound: the step waits for its batch (cores idle); a SIGTERM ends the wait.
                STOP.wait(job.step_delay_s)
            inputs, targets = source.batch(step, job.batch_size, job.cfg.seq_len)
            rows = replica_rows(job.plan, job.batch_size, ctx.coord.dp)
            loss_local, phases = SCHEDULES[job.schedule](stage, ctx, inputs[rows], targets[rows], job.plan.micro_batches)
            c0 = comm.TIMER.seconds
            average_gradients(params, ctx)
            loss, stopped, grads_ok = _reduce_step(loss_local, STOP.is_set(), ctx, _grads_finite(params))
            phases["communication"] += comm.TIMER.seconds - c0
            if not math.isfinite(loss):
                # Every rank sees the same global loss, so all of them fail here together.
                raise FloatingPointError(f"loss is {loss} at step {step + 1}")
            if not grads_ok:
                # Agreed by every rank (above), before the update: the weights and the last
                # checkpoint stay finite, so a relaunch can resume from it.
                raise FloatingPointError(f"gradients are not finite at step {step + 1} (loss {loss})")
            t_opt = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            phases["optimizer"] = time.perf_counter() - t_opt
            if first_loss is None:
                first_loss = loss
            dt = time.perf_counter() - t_start
            reporter.event(
                "progress",
                job_id=job.job_id,
                module="gpt",
                step=step + 1,
                total=job.steps,
                loss=loss,
                step_time_s=dt,
                tokens_per_s=tokens_per_step / dt if dt > 0 else 0.0,
                phases=phases,
            )
            done = step + 1
            if job.checkpoint_dir and (
                stopped or done == job.steps or (job.checkpoint_every and done % job.checkpoint_every == 0)
            ):
                t_ck = time.perf_counter()
                _save(job, stage, opt, ctx, done, first_loss, loss, reporter)
                last_saved = done
                logger.debug("checkpointed", step=done, seconds=round(time.perf_counter() - t_ck, 3))
            if stopped:
                break
        if stopped and done < job.steps:  # a stop at the last step is just completion
            logger.info("stopped", step=done, checkpoint_step=last_saved)
            saved = f"checkpoint at step {last_saved}" if last_saved > 0 else "no checkpoint"
            _emit_error(reporter, ctx.rank, f"stopped by SIGTERM after step {done} ({saved})", signal="SIGTERM")
            return EXIT_TERM
        reporter.event("done", job_id=job.job_id, module="gpt", steps=job.steps, final_loss=loss, first_loss=first_loss)
        return EXIT_OK
    finally:
        pctx.shutdown(ctx)


def _emit_error(reporter: Reporter, rank: int, message: str, **fields) -> None:
    # Errors are reported by every rank: a failing non-zero rank must still be heard.
    (reporter if reporter.enabled else Reporter()).event("error", message=message, rank=rank, **fields)


def run(spec: dict, reporter: Reporter) -> int:
    """Entry point of the gpt workload (see module docstring for the contract)."""
    rank = (spec.get("dist") or {}).get("rank", 0) if isinstance(spec, dict) else 0
    try:
        job = parse_spec(spec)
    except SpecError as e:
        _emit_error(reporter, rank, str(e), field=e.field)
        return EXIT_SPEC
    try:
        return train(job, reporter)
    except SpecError as e:
        _emit_error(reporter, rank, str(e), field=e.field)
        return EXIT_SPEC
    except Exception as e:  # noqa: BLE001 - an executor reports every failure as an event
        traceback.print_exc(file=sys.stderr)
        _emit_error(reporter, rank, f"{type(e).__name__}: {e}")
        return EXIT_FAIL
