"""Timed communication primitives shared by the parallel schedules.

Every collective and point-to-point call of the runtime goes through this module so
that its wall time is added to :data:`TIMER`; the training loop subtracts it from the
forward/backward wall time to report a separate ``communication`` phase, including the
tensor-parallel all-reduces that run inside autograd.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class CommTimer:
    """Accumulates seconds spent in communication (single-threaded use)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def reset(self) -> float:
        """Return the accumulated seconds and start again from zero."""
        s, self.seconds = self.seconds, 0.0
        return s


TIMER = CommTimer()


def all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    """In-place SUM all-reduce over ``group`` (no-op for a None group), timed."""
    if group is None:
        return t
    t0 = time.perf_counter()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    TIMER.seconds += time.perf_counter() - t0
    return t


def send(t: torch.Tensor, dst: int) -> None:
    """Blocking send to global rank ``dst``, timed."""
    t0 = time.perf_counter()
    dist.send(t.contiguous(), dst=dst)
    TIMER.seconds += time.perf_counter() - t0


def recv(shape: tuple[int, ...], src: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Blocking receive of a tensor of known shape from global rank ``src``, timed."""
    buf = torch.empty(shape, dtype=dtype, device=device)
    t0 = time.perf_counter()
    dist.recv(buf, src=src)
    TIMER.seconds += time.perf_counter() - t0
    return buf


class _CopyToTP(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the tensor-parallel group.

    Each shard computes only its part of d(loss)/d(input); the replicated input needs
    the sum (Megatron's ``f`` operator).
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward sums partial outputs over the tensor-parallel group; backward is the
    identity because every shard needs the full output gradient (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def exchange(t: torch.Tensor, dst: int, shape: tuple[int, ...], src: int, dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
    """Send ``t`` to ``dst`` and receive a tensor of ``shape`` from ``src`` at once, timed.

    Both operations are posted before either is waited on: in 1F1B's steady state two
    neighbouring stages send to each other at the same moment, which two blocking
    sends could deadlock on.
    """
    buf = torch.empty(shape, dtype=dtype, device=device)
    t0 = time.perf_counter()
    reqs = [dist.isend(t.contiguous(), dst=dst), dist.irecv(buf, src=src)]
    for r in reqs:
        r.wait()
    TIMER.seconds += time.perf_counter() - t0
    return buf
