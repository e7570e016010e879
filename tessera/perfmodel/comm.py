"""Communication model: latency + bytes / bandwidth per link type and operation.

Time of one operation over ``n`` ranks moving ``nbytes`` per rank (ring algorithms,
the ones gloo and NCCL use for these sizes):

    all_reduce   2(n-1) * alpha + 2(n-1)/n * nbytes * beta
    all_gather    (n-1) * alpha +  (n-1)   * nbytes * beta     (nbytes: one rank's input)
    broadcast  ceil(log2 n) * alpha + nbytes * beta
    send_recv           alpha +            nbytes * beta

``alpha`` (seconds per step) and ``beta`` (seconds per byte = 1 / bandwidth) are
fitted per (link type, op) from a measured table (rows ``{"op", "bytes", "world",
"seconds"}``, e.g. a torch.distributed micro-benchmark), by non-negative least
squares on relative residuals. A world of one costs nothing. Pure: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tessera.perfmodel.compute import nnls

OPS = ("all_reduce", "all_gather", "broadcast", "send_recv")


def steps_and_volume(op: str, n, nbytes):
    """(latency steps, bytes on the critical path) of ``op`` over n ranks; arrays ok."""
    n = np.asarray(n, dtype=float)
    nbytes = np.asarray(nbytes, dtype=float)
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / np.maximum(n, 1) * nbytes
    if op == "all_gather":
        return n - 1, (n - 1) * nbytes
    if op == "broadcast":
        return np.ceil(np.log2(np.maximum(n, 1))), nbytes * (n > 1)
    if op == "send_recv":
        return 1.0 * (n > 1), nbytes * (n > 1)
    raise ValueError(f"unknown op {op!r}; one of {OPS}")


@dataclass
class CommFit:
    """Fitted (alpha, beta) per op of one link type, with relative residual std per op."""

    link: str
    ops: dict = field(default_factory=dict)   # op -> {"alpha", "beta", "rel_sigma", "n", "max_bytes"}

    def to_dict(self) -> dict:
        return {"link": self.link, "ops": {k: dict(v) for k, v in self.ops.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "CommFit":
        return cls(link=d["link"], ops={k: dict(v) for k, v in d["ops"].items()})

    def has(self, op: str) -> bool:
        return op in self.ops

    def time(self, op: str, n, nbytes):
        """Seconds of ``op`` over n ranks with ``nbytes`` per rank (0 for n <= 1)."""
        c = self.ops[op]
        st, vol = steps_and_volume(op, n, nbytes)
        return c["alpha"] * st + c["beta"] * vol


def fit_comm(link: str, rows: list[dict]) -> CommFit:
    """Fit each op that has at least 2 sizes in ``rows``; ops with fewer are left out
    (the composition then reports insufficient data for plans that need them)."""
    out = CommFit(link=link)
    for op in OPS:
        rs = [r for r in rows if r["op"] == op and r["world"] > 1 and r["seconds"] > 0]
        if len({r["bytes"] for r in rs}) < 2:
            continue
        st, vol = zip(*(steps_and_volume(op, r["world"], r["bytes"]) for r in rs))
        y = np.array([r["seconds"] for r in rs])
        x = np.column_stack([np.array(st, dtype=float), np.array(vol, dtype=float)])
        a = x / y[:, None]
        scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
        c = nnls(a / scale, np.ones(len(rs))) / scale
        r = (x @ c - y) / y
        dof = max(1, len(rs) - 2)
        out.ops[op] = {"alpha": float(c[0]), "beta": float(c[1]), "rel_sigma": math.sqrt(float(r @ r) / dof),
                       "n": len(rs), "max_bytes": float(max(rr["bytes"] for rr in rs))}
    return out
