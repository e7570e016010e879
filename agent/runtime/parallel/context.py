"""Process-group setup for one rank of a parallel plan.

Contract: :func:`init` joins the job's world (``torch.distributed`` with a TCP
rendezvous at master_addr:master_port; gloo on CPU, NCCL when asked and CUDA is
available) and creates the tensor- and data-parallel groups of the plan. Every rank
creates every group in the same order, as ``new_group`` requires; gloo's loop threads
are then put under SCHED_BATCH (:mod:`tessera.gloo`: 3-8x faster collectives on one-core
ranks). A world of one
process initialises nothing, so single-process training has no distributed
dependency at all. Pipeline neighbours talk point-to-point by global rank.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from agent.runtime.plan import Coord, Plan, coord_of, dp_groups, rank_of, tp_groups
from tessera.gloo import calm_loop_threads


@dataclass
class ParallelContext:
    """Where this rank sits and which groups it talks to (None: a group of one)."""

    plan: Plan
    rank: int
    coord: Coord
    device: torch.device
    tp_group: object = None
    dp_group: object = None
    world_group: object = None
    initialized: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def last_stage(self) -> bool:
        return self.coord.pp == self.plan.pp - 1

    def neighbour(self, delta: int) -> int:
        """Global rank of the same (dp, tp) shard in stage ``pp + delta``."""
        c = self.coord
        return rank_of(self.plan, Coord(dp=c.dp, tp=c.tp, pp=c.pp + delta))


def pick_device(backend: str, rank: int) -> torch.device:
    """cuda:<local rank> for NCCL on a CUDA machine, else the CPU."""
    if backend == "nccl" and torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init(plan: Plan, dist_spec: dict) -> ParallelContext:
    """Join the world described by ``dist_spec`` and build the plan's groups."""
    rank = int(dist_spec.get("rank", 0))
    world = int(dist_spec.get("world_size", 1))
    backend = dist_spec.get("backend", "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        backend = "gloo"  # a CPU-only node still runs the job, on gloo
    device = pick_device(backend, rank)
    ctx = ParallelContext(plan=plan, rank=rank, coord=coord_of(plan, rank), device=device)
    if world == 1:
        return ctx
    addr = dist_spec.get("master_addr", "127.0.0.1")
    port = int(dist_spec.get("master_port", 29500))
    if addr in ("127.0.0.1", "localhost"):
        # Gloo otherwise binds to the address the hostname resolves to, which in
        # containers may not be reachable from the other ranks.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=float(dist_spec.get("timeout_s", 300)))
    dist.init_process_group(
        backend=backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world, timeout=timeout
    )
    ctx.initialized = True
    ctx.world_group = dist.group.WORLD
    if plan.tp > 1:
        for ranks in tp_groups(plan):
            g = dist.new_group(ranks)
            if rank in ranks:
                ctx.tp_group = g
    if plan.dp > 1:
        for ranks in dp_groups(plan):
            g = dist.new_group(ranks)
            if rank in ranks:
                ctx.dp_group = g
    calm_loop_threads()  # every group's gloo loop thread exists now
    return ctx


def shutdown(ctx: ParallelContext) -> None:
    """Leave the world (idempotent)."""
    if ctx.initialized and dist.is_initialized():
        dist.destroy_process_group()
    ctx.initialized = False
