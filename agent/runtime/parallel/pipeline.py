"""One training step's forward/backward for any plan: GPipe or 1F1B schedules.

Contract: :func:`forward_backward` runs every micro-batch forward through this rank's
stage (receiving activations from the previous stage, sending to the next), then every
micro-batch backward in reverse order (receiving output gradients from the next stage,
sending input gradients to the previous). Gradients accumulate in ``.grad``, scaled so
that they equal the gradient of the mean loss over this replica's rows. With one stage
it is plain gradient accumulation. Communication only flows one way per phase, so
blocking send/recv cannot deadlock.

:func:`forward_backward_1f1b` is the non-interleaved 1F1B schedule (PipeDream-flush,
as in Megatron-LM): stage s runs ``pp - s - 1`` warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards. Same gradients as
GPipe, but a stage keeps at most ``pp - s`` micro-batches of activations instead of
all of them. Where two neighbours send to each other at once it posts both directions
together (``comm.exchange``).

:func:`average_gradients` then averages gradients over the data-parallel group: one
flat all-reduce (a single bucket is the cheapest for the small models tests run).
"""

from __future__ import annotations

import time

import torch

from agent.runtime.model import lm_loss
from agent.runtime.parallel import comm
from agent.runtime.parallel.context import ParallelContext


def forward_backward(
    model: torch.nn.Module,
    ctx: ParallelContext,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batches: int,
) -> tuple[float, dict[str, float]]:
    """Returns (local mean loss on the last stage else 0.0, phase seconds).

    Phases: ``forward`` and ``backward`` compute time, and ``communication`` (pipeline
    send/recv and tensor-parallel all-reduces, which are taken out of the other two).
    """
    hidden = model.cfg.hidden
    tok_mbs = inputs.chunk(micro_batches, dim=0)
    tgt_mbs = targets.chunk(micro_batches, dim=0)
    act_dtype = next(model.parameters()).dtype
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    loss_sum = 0.0

    c0 = comm.TIMER.seconds
    t0 = time.perf_counter()
    for i in range(micro_batches):
        shape = (tok_mbs[i].shape[0], tok_mbs[i].shape[1], hidden)
        if ctx.first_stage:
            x_in = None
            out = model(tok_mbs[i].to(ctx.device))
        else:
            x_in = comm.recv(shape, ctx.neighbour(-1), act_dtype, ctx.device).requires_grad_()
            out = model(x_in)
        if ctx.last_stage:
            # Each micro-batch's mean loss weighs 1/m: equal-size micro-batches make the
            # sum the mean over all rows, i.e. the same gradient as one big batch.
            out = lm_loss(out, tgt_mbs[i].to(ctx.device)) / micro_batches
            loss_sum += out.item()
        else:
            comm.send(out.detach(), ctx.neighbour(+1))
        saved.append((x_in, out))
    t1 = time.perf_counter()
    c1 = comm.TIMER.seconds

    for i in reversed(range(micro_batches)):
        x_in, out = saved[i]
        if ctx.last_stage:
            out.backward()
        else:
            g = comm.recv(tuple(out.shape), ctx.neighbour(+1), out.dtype, ctx.device)
            out.backward(g)
        if x_in is not None:
            comm.send(x_in.grad, ctx.neighbour(-1))
        saved[i] = (None, out.detach())  # free the graph and activations early
    t2 = time.perf_counter()
    c2 = comm.TIMER.seconds
    return loss_sum, {
        "forward": max(0.0, (t1 - t0) - (c1 - c0)),
        "backward": max(0.0, (t2 - t1) - (c2 - c1)),
        "communication": c2 - c0,
    }


def average_gradients(params: list[torch.nn.Parameter], ctx: ParallelContext) -> None:
    """Replace each gradient by its mean over the data-parallel group (no-op for dp=1)."""
    if ctx.dp_group is None:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, ctx.dp_group)
    flat /= ctx.plan.dp
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off : off + n].view_as(g))
        off += n


def forward_backward_1f1b(
    model: torch.nn.Module,
    ctx: ParallelContext,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batches: int,
) -> tuple[float, dict[str, float]]:
    """Same contract as :func:`forward_backward`, 1F1B order.

    Phases: forward and backward are not separate in time here, so ``forward`` is the
    compute of the forward passes and ``backward`` the compute of the backward passes,
    each timed around its own calls; ``communication`` is all send/recv time.
    """
    m = micro_batches
    if ctx.plan.pp == 1:
        return forward_backward(model, ctx, inputs, targets, m)
    hidden = model.cfg.hidden
    tok_mbs = inputs.chunk(m, dim=0)
    tgt_mbs = targets.chunk(m, dim=0)
    dtype = next(model.parameters()).dtype
    first, last = ctx.first_stage, ctx.last_stage
    prev = None if first else ctx.neighbour(-1)
    nxt = None if last else ctx.neighbour(+1)
    warmup = min(ctx.plan.pp - ctx.coord.pp - 1, m)
    saved: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    loss_sum = 0.0
    t_fwd = t_bwd = 0.0
    c0 = comm.TIMER.seconds

    def shape(i: int) -> tuple[int, int, int]:
        return (tok_mbs[i].shape[0], tok_mbs[i].shape[1], hidden)

    def fwd(i: int, x_in: torch.Tensor | None) -> torch.Tensor:
        nonlocal loss_sum, t_fwd
        t0, c = time.perf_counter(), comm.TIMER.seconds
        out = model(tok_mbs[i].to(ctx.device) if first else x_in)
        if last:
            out = lm_loss(out, tgt_mbs[i].to(ctx.device)) / m
            loss_sum += out.item()
        saved.append((x_in, out))
        t_fwd += (time.perf_counter() - t0) - (comm.TIMER.seconds - c)  # TP all-reduces are communication
        return out

    def bwd(grad: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal t_bwd
        t0, c = time.perf_counter(), comm.TIMER.seconds
        x_in, out = saved.pop(0)
        out.backward() if last else out.backward(grad)
        t_bwd += (time.perf_counter() - t0) - (comm.TIMER.seconds - c)
        return None if x_in is None else x_in.grad

    def recv_act(i: int) -> torch.Tensor | None:
        return None if first else comm.recv(shape(i), prev, dtype, ctx.device).requires_grad_()

    # Warm-up: forwards only (the last stage has none).
    for i in range(warmup):
        out = fwd(i, recv_act(i))
        comm.send(out.detach(), nxt)
    # Steady state: one forward, one backward.
    steady = m - warmup
    x_in = recv_act(warmup) if steady > 0 else None
    for k in range(steady):
        i = warmup + k
        out = fwd(i, x_in)
        grad = None if last else comm.exchange(out.detach(), nxt, shape(i), nxt, dtype, ctx.device)
        g_in = bwd(grad)
        if k == steady - 1:
            if not first:
                comm.send(g_in, prev)
        elif first:
            x_in = None
        else:
            x_in = comm.exchange(g_in, prev, shape(i + 1), prev, dtype, ctx.device).requires_grad_()
    # Cool-down: the backwards of the warm-up micro-batches.
    for j in range(m - warmup, m):
        grad = comm.recv(shape(j), nxt, dtype, ctx.device)
        g_in = bwd(grad)
        if not first:
            comm.send(g_in, prev)
    return loss_sum, {"forward": t_fwd, "backward": t_bwd, "communication": comm.TIMER.seconds - c0}
