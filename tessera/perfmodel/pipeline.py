"""The runtime's pipeline schedules, replayed with per-stage times (pure: numpy only).

Contract:
- :func:`schedule_ops` gives, per stage, the runtime's exact order of work and blocking
  transfers for ``pp`` stages and ``m`` micro-batches (``agent.runtime.parallel.pipeline``:
  ``forward_backward_1f1b`` for ``"1f1b"``, ``forward_backward`` for ``"gpipe"``).
- :func:`replay` runs that order on per-stage forward / backward seconds of one
  micro-batch (arrays over candidates) and per-transfer costs, and returns when each
  stage finishes its last operation (arrays; same shape as the inputs).

Why replay rather than a closed form: the textbook ``sum_s t_s + (m - 1) * max_s t_s``
treats a micro-batch's forward and backward on a stage as one block. In 1F1B the first
stage interleaves them (``B_i`` then ``F_{i+2}`` between two exchanges): when it is the
bottleneck, its forward of the next micro-batch runs while the next stage computes, and
the closed form counts one forward too many. Traced on a 2-vCPU KVM guest (2026-12-06,
C 16x64, m = 4, pp = 2; first stage ~1.6x the last): rank 0 ran F0 (3.8 ms), F1 (3.3),
then waited 2.9 ms for rank 1's F0 + B0 (6.0) — not 6.0 — and its step took 45.2 ms;
replayed with the trace's per-micro-batch times (rank 0 F 3.5 / B 6.3 ms, rank 1 F + B
5.9, transfers 0.25) the pipeline takes 43.0 ms + 1.2 (loss all-reduce, optimizer), the
closed form 47.3 + 1.2.

Transfers are blocking and matched: a transfer completes on both sides when both have
posted it (a ``send`` with its ``recv``; an ``exchange`` posts a send and a receive at
once and completes when both have), plus its cost. A stage that waited for its
neighbour in a transfer also pays ``wake`` (its thread slept: the neighbour's message
wakes it), which a busy ping-pong's latency does not include, and ``refill(idle)``: its
next compute comes back to caches that other work (other tenants, its neighbour) filled
while it idled ``idle`` seconds (``CommFit.refill_time``).
"""

from __future__ import annotations

import numpy as np

SCHEDULES = ("1f1b", "gpipe")
# The largest pipeline a candidate may ask for: stages (pp) and micro-batches per step.
# :func:`replay` walks every operation of every stage in Python, about 2 * pp * m
# operations (~50-70 us each): pp = 8, m = 4096 takes ~1.6 s, pp = m = 256 ~4 s. Beyond
# these bounds a candidate is invalid (``PerfModel._invalid`` answers insufficient_data;
# the estimator service refuses it with INVALID_ARGUMENT naming the field) instead of
# holding a thread for minutes. No runtime plan comes near them (a stage holds >= 1
# layer; a micro-batch >= 1 row).
MAX_PP = 1024
MAX_MICRO_BATCHES = 1024
# And their product, for a pipeline (pp > 1): the replay's work is ~2 * pp * m operations,
# so each bound alone still lets pp = m = 1024 through (over a minute); 8192 slots (pp = 64
# with m = 128, pp = 8 with m = 1024) replay in ~0.4 s.
MAX_PIPELINE_SLOTS = 8192


def schedule_ops(pp: int, m: int, schedule: str = "1f1b") -> list[list[tuple]]:
    """Per stage, its operations in order: ``("F", i)`` / ``("B", i)`` (forward / backward
    of micro-batch i) and ``("T", keys)`` (one blocking call; ``keys`` are the transfers it
    posts: ``("a", s, i)`` micro-batch i's activations over link s -> s+1, ``("g", s, i)``
    its gradients over link s+1 -> s). Mirrors the runtime's loops exactly."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r} ({' or '.join(SCHEDULES)})")
    if pp < 1 or m < 1:
        raise ValueError(f"pp and m must be >= 1 (got pp={pp}, m={m})")
    out = []
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        ops: list[tuple] = []

        def recv_act(i):
            if not first:
                ops.append(("T", (("a", s - 1, i),)))

        if schedule == "gpipe":
            for i in range(m):
                recv_act(i)
                ops.append(("F", i))
                if not last:
                    ops.append(("T", (("a", s, i),)))
            for i in reversed(range(m)):
                if not last:
                    ops.append(("T", (("g", s, i),)))
                ops.append(("B", i))
                if not first:
                    ops.append(("T", (("g", s - 1, i),)))
            out.append(ops)
            continue
        warmup = min(pp - s - 1, m)
        for i in range(warmup):
            recv_act(i)
            ops.append(("F", i))
            ops.append(("T", (("a", s, i),)))
        steady = m - warmup
        if steady > 0:
            recv_act(warmup)
        for k in range(steady):
            i = warmup + k
            ops.append(("F", i))
            if not last:
                ops.append(("T", (("a", s, i), ("g", s, k))))
            ops.append(("B", k))
            if k == steady - 1:
                if not first:
                    ops.append(("T", (("g", s - 1, k),)))
            elif not first:
                ops.append(("T", (("g", s - 1, k), ("a", s - 1, i + 1))))
        for j in range(m - warmup, m):
            ops.append(("T", (("g", s, j),)))
            ops.append(("B", j))
            if not first:
                ops.append(("T", (("g", s - 1, j),)))
        out.append(ops)
    return out


def replay(ops: list[list[tuple]], fwd, bwd, xfer, wake=0.0, refill=None) -> list:
    """Finish time of each stage's last operation, from time 0 on every stage.

    ``fwd[s]`` / ``bwd[s]``: seconds of one micro-batch's forward / backward on stage s
    (arrays broadcastable together); ``xfer[s]``: cost of one transfer over link s -> s+1
    (either direction); ``wake``: added to a transfer on the side that waited for its
    neighbour; ``refill``: None, or a function of the seconds a stage waited in a transfer
    (array) giving the seconds its next compute loses to refilling its caches, added on
    that side as well. Raises ValueError if the order cannot complete (it always can for
    :func:`schedule_ops`)."""
    pp = len(ops)
    zero = 0.0 * (np.asarray(fwd[0], dtype=float) + np.asarray(bwd[0], dtype=float)
                  + (np.asarray(xfer[0], dtype=float) if pp > 1 else 0.0) + np.asarray(wake, dtype=float))
    t = [zero.copy() for _ in range(pp)]
    ptr = [0] * pp
    posted: dict[tuple, dict[int, np.ndarray]] = {}
    done = 0
    while done < pp:
        moved = False
        done = 0
        for s in range(pp):
            while ptr[s] < len(ops[s]):
                kind, arg = ops[s][ptr[s]]
                if kind == "F":
                    t[s] = t[s] + fwd[s]
                elif kind == "B":
                    t[s] = t[s] + bwd[s]
                else:
                    for key in arg:
                        posted.setdefault(key, {}).setdefault(s, t[s])
                    if any(len(posted[key]) < 2 for key in arg):
                        break  # the neighbour has not posted its side yet
                    end = zero.copy()
                    for key in arg:
                        mine = posted[key][s]
                        other = next(v for r, v in posted[key].items() if r != s)
                        waited = other > mine
                        late = wake + (refill(other - mine) if refill is not None else 0.0)
                        end = np.maximum(end, np.maximum(mine, other) + xfer[key[1]] + np.where(waited, late, 0.0))
                    t[s] = end
                ptr[s] += 1
                moved = True
            done += ptr[s] == len(ops[s])
        if done < pp and not moved:
            raise ValueError("the schedule deadlocks")
    return t
