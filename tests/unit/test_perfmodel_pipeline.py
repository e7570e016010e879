"""The pipeline replay (tessera.perfmodel.pipeline): its schedules are the runtime's own
call order, and its timing follows from the operations' times."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from agent.runtime.parallel import comm
from agent.runtime.parallel import pipeline as runtime_pipeline
from agent.runtime.parallel.context import ParallelContext
from agent.runtime.plan import Coord, Plan
from tessera.perfmodel.pipeline import replay, schedule_ops


class _Mark(torch.autograd.Function):
    """Identity whose backward records one "B" (one stage backward of a micro-batch)."""

    log: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Mark.log.append("B")
        return g


class _Stage(torch.nn.Module):
    """Stands in for a StageModule: records each forward; hidden 4, vocab 8."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = SimpleNamespace(hidden=4)
        self.first, self.last = first, last
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        _Mark.log.append("F")
        h = torch.ones(x.shape[0], x.shape[1], 4) * self.w if self.first else x * self.w
        h = _Mark.apply(h)
        return h @ torch.ones(4, 8) if self.last else h


def _runtime_calls(monkeypatch, pp: int, m: int, s: int, schedule: str) -> list:
    """The runtime's own sequence of stage work and blocking calls on stage s."""
    log = _Mark.log
    log.clear()
    monkeypatch.setattr(comm, "send", lambda t, dst: log.append(("send", dst)))

    def recv(shape, src, dtype, device):
        log.append(("recv", src))
        return torch.zeros(shape, dtype=dtype)

    def exchange(t, dst, shape, src, dtype, device):
        log.append(("exchange", dst, src))
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(comm, "recv", recv)
    monkeypatch.setattr(comm, "exchange", exchange)
    ctx = ParallelContext(plan=Plan(pp=pp, micro_batches=m), rank=s, coord=Coord(dp=0, tp=0, pp=s),
                          device=torch.device("cpu"))
    model = _Stage(s == 0, s == pp - 1)
    tokens = torch.zeros(2 * m, 3, dtype=torch.long)
    fn = runtime_pipeline.forward_backward_1f1b if schedule == "1f1b" else runtime_pipeline.forward_backward
    fn(model, ctx, tokens, tokens, m)
    return list(log)


def _as_calls(ops: list[tuple], s: int) -> list:
    """schedule_ops' operations of stage s in the runtime's terms."""
    out = []
    for kind, arg in ops:
        if kind in ("F", "B"):
            out.append(kind)
            continue
        parts = []
        for what, link, _ in arg:
            sender = link if what == "a" else link + 1
            receiver = link + 1 if what == "a" else link
            parts.append(("send", receiver) if sender == s else ("recv", sender))
        if len(parts) == 1:
            out.append(parts[0])
        else:
            (send,), (recv,) = [p for p in parts if p[0] == "send"], [p for p in parts if p[0] == "recv"]
            out.append(("exchange", send[1], recv[1]))
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (3, 2), (3, 5), (4, 3)])
def test_schedule_is_the_runtime_s_call_order_on_every_stage(monkeypatch, schedule, pp, m):
    ops = schedule_ops(pp, m, schedule)
    for s in range(pp):
        assert _as_calls(ops[s], s) == _runtime_calls(monkeypatch, pp, m, s, schedule), (s, ops[s])


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_equal_stages_take_m_plus_pp_minus_one_slots(schedule):
    """Free transfers, equal stages: the textbook (m + pp - 1) (f + b) for both schedules."""
    f, b = np.array([1.0, 2.0]), np.array([2.0, 3.0])  # two candidates at once
    for pp, m in ((2, 1), (2, 4), (4, 8)):
        ends = replay(schedule_ops(pp, m, schedule), [f] * pp, [b] * pp, [np.zeros(2)] * (pp - 1))
        np.testing.assert_allclose(np.max(np.stack(ends), axis=0), (m + pp - 1) * (f + b))


def test_a_slow_first_stage_runs_its_next_forward_while_the_last_computes():
    """1F1B, pp = 2: stage 0 (f0, b0) slower than stage 1 (f1 + b1) = t1: the step is
    f0 + [f0 overlapped with t1: max(f0, t1)] + (m - 1) (b0 + f0) ... = m (f0 + b0) + t1 - f0
    when t1 >= f0: one forward shorter than sum + (m - 1) max."""
    f0, b0, f1, b1, m = 3.0, 6.0, 2.0, 4.0, 4
    ends = replay(schedule_ops(2, m), [f0, f1], [b0, b1], [0.0])
    assert max(ends) == pytest.approx(m * (f0 + b0) + (f1 + b1) - f0)
    assert max(ends) == pytest.approx((f0 + b0) + (f1 + b1) + (m - 1) * (f0 + b0) - f0)


def test_transfer_cost_and_wake_fall_on_the_right_side():
    """m = 1, pp = 2: stage 1 waits for the activations (woken), stage 0 for the gradient
    (woken): F0 + x + w + F1 + B1 + x + w + B0; wake is paid only by a rank that waited."""
    x, w = 0.5, 0.25
    ends = replay(schedule_ops(2, 1), [1.0, 2.0], [3.0, 4.0], [x], w)
    assert ends[0] == pytest.approx(1.0 + x + w + 2.0 + 4.0 + x + w + 3.0)
    assert ends[1] == pytest.approx(1.0 + x + w + 2.0 + 4.0 + x)  # its send: stage 0 was there first


def test_refill_falls_on_the_side_that_waited_and_grows_with_its_wait():
    """m = 1, pp = 2 as above, with a refill of half the wait: stage 1 waited F0 + x for
    the activations (posted its recv at 0, stage 0 its send at F0), stage 0 waited for
    the gradient from its send's end to stage 1's send; a rank that did not wait pays
    nothing."""
    x, w = 0.5, 0.25
    ops = schedule_ops(2, 1)
    plain = replay(ops, [1.0, 2.0], [3.0, 4.0], [x], w)
    ends = replay(ops, [1.0, 2.0], [3.0, 4.0], [x], w, refill=lambda idle: 0.5 * idle)
    wait1 = 1.0
    r1 = 0.5 * wait1
    assert ends[1] == pytest.approx(plain[1] + r1)
    # stage 0 posted the gradient recv at 1 + x, stage 1 its send at 1 + x + w + r1 + 2 + 4.
    wait0 = (1.0 + x + w + r1 + 2.0 + 4.0) - (1.0 + x)
    assert ends[0] == pytest.approx(plain[0] + r1 + 0.5 * wait0)
    # Arrays of candidates: each pays its own wait's refill.
    two = replay(ops, [np.array([1.0, 2.0]), np.array([2.0, 2.0])], [np.array([3.0, 3.0]), np.array([4.0, 4.0])],
                 [np.array([x, x])], w, refill=lambda idle: 0.5 * idle)
    assert two[1][0] == pytest.approx(ends[1]) and two[1][1] == pytest.approx(ends[1] + 1.0 + 0.5 * 1.0)


def test_bad_schedule_and_sizes_are_refused():
    with pytest.raises(ValueError, match="schedule"):
        schedule_ops(2, 2, "interleaved")
    with pytest.raises(ValueError, match="pp and m"):
        schedule_ops(0, 2)
    with pytest.raises(ValueError, match="pp and m"):
        schedule_ops(2, 0)
