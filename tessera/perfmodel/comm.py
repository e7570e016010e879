"""Communication model: latency + bytes / bandwidth per link type and operation.

Time of one operation over ``n`` ranks moving ``nbytes`` per rank (ring algorithms,
the ones gloo and NCCL use for these sizes):

    all_reduce   2(n-1) * alpha + 2(n-1)/n * nbytes * beta
    all_gather    (n-1) * alpha +  (n-1)   * nbytes * beta     (nbytes: one rank's input)
    broadcast  ceil(log2 n) * alpha + nbytes * beta
    send_recv           alpha +            nbytes * beta

``alpha`` (seconds per step) and ``beta`` (seconds per byte = 1 / bandwidth) are
fitted per (link type, op) from a measured table (rows ``{"op", "bytes", "world",
"seconds"}``, e.g. a torch.distributed micro-benchmark): the rows of each (world,
bytes) are averaged first (the expected cost, see ``_expected``), then non-negative
least squares on relative residuals across sizes. A world of one costs nothing.
Pure: numpy only.

Synchronisation (straggler) cost: a synchronous step waits at each collective for
the slowest rank, and that wait grows with the compute each rank did since the last
synchronisation (independent jitter of the ranks' cores; one core busier than the
other). Rows ``{"op": "sync", "seconds", "compute_s"}`` (a tiny all-reduce right after
a compute chunk of ``compute_s``, minus the chunk alone) give ``seconds = a +
kappa * compute_s``: the rows are grouped by chunk length (``sync_groups``), each
group is its rows' medians (``compute_s`` and ``seconds``), and the line goes through the
groups (NNLS on relative residuals; with two chunk lengths, exactly through both). These
rows scatter by 100-200 % here: an absolute fit of the rows let one slow row set kappa,
and a relative fit of the rows themselves (until 2026-12-07's twenty-second session)
pulled the line under the long chunk's rows — a relative residual punishes a
prediction above a row more than one below it, and the long chunk's rows scatter the
most — so kappa read a third to a half of what the two groups' medians show (0.013-0.036
against 0.018-0.086 over the 15 stored AMD runs s27b-s32b: dp = 2 rows +3.7 % and tp = 2
rows +8.5 % mean signed with the pipeline's g standing in for the missing wait, -2.0 /
+1.0 % with this fit and that g on pipelines only — ``model.fit_rank_interference``);
the wait of a step over ``n`` ranks is

    straggle(n, compute) = kappa * compute * E[max of n] / E[max of 2]

(expected maximum of n standard normals: the wait grows like the largest of n
jitters). No sync rows: kappa = 0 (snapshots without them load unchanged).

Resume cost: compute right after a blocking op runs slower than the same compute after
other compute (the rank comes back from the wait with cold caches). Rows ``{"op":
"resume", "seconds"}`` (a compute chunk after an all-reduce minus the same chunk after a
chunk) give ``resume`` = their mean, seconds added to every blocking op of a step (the
composition's all-reduces and in-step pipeline transfers). No resume rows: 0.

Refill after idling: a pipeline stage waits for its neighbour for milliseconds, and its
next compute comes back to caches that other work filled meanwhile; the loss grows with
the wait and levels off once the working set is gone:

    refill(idle) = r_max * (1 - exp(-idle / REFILL_TAU0))

Rows ``{"op": "refill", "seconds", "idle_s"}`` (a ~2 MiB working-set chunk right after
waiting ``idle_s`` in ``recv``, minus the same chunk right after it; profilerd.commbench)
give ``r_max`` = the mean of ``seconds / (1 - exp(-idle_s / REFILL_TAU0))``. Only the
pipeline replay charges it (tessera.perfmodel.pipeline: to the side that waited). No
refill rows: 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tessera.perfmodel.compute import nnls

OPS = ("all_reduce", "all_gather", "broadcast", "send_recv")
SYNC = "sync"
RESUME = "resume"
REFILL = "refill"
# The refill's time constant: a 2 MiB working-set chunk after idling 5.7 / 11.6 / 24.7 ms
# in a gloo recv took +0.29 / +0.57 / +0.67 ms (2-vCPU KVM guest, AMD EPYC, 2026-12-06;
# a forward or backward of A 8x64 / B 4x64 after 2 / 8 ms asleep +0.05-0.25 / +0.5-0.6
# ms): r_max * (1 - exp(-idle / 8 ms)) with r_max ~0.7 ms follows both.
REFILL_TAU0 = 0.008
# Sorted by compute_s, a sync row more than this factor above the one before starts the
# next chunk length (profilerd.commbench measures two, ~50x apart: SYNC_CHUNKS; the rows
# of one chunk spread by up to 2.8x over a run's rounds, the gap between the two
# chunks' rows was 13x or more in every stored run).
SYNC_GROUP_GAP = 4.0
# E[max of n iid standard normals] for n = 1..16 (n > 16: sqrt(2 ln n) asymptote).
_EMAX = (0.0, 0.5642, 0.8463, 1.0294, 1.1630, 1.2672, 1.3522, 1.4236, 1.4850, 1.5388, 1.5864, 1.6292,
         1.6680, 1.7034, 1.7359, 1.7660)


def expected_max(n):
    """E[max of n iid standard normals] (0 for n <= 1); arrays ok."""
    n = np.asarray(n, dtype=float)
    idx = np.clip(np.rint(n).astype(int), 1, len(_EMAX)) - 1
    big = np.sqrt(2.0 * np.log(np.maximum(n, 2.0))) - 0.6
    return np.where(n <= 1, 0.0, np.where(n <= len(_EMAX), np.asarray(_EMAX)[idx], big))


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
    sync: dict = field(default_factory=dict)  # {"a", "kappa", "rel_sigma", "n"}; empty: no sync rows
    resume: dict = field(default_factory=dict)  # {"seconds", "n"}; empty: no resume rows
    refill: dict = field(default_factory=dict)  # {"r_max", "tau0", "n"}; empty: no refill rows

    def to_dict(self) -> dict:
        d = {"link": self.link, "ops": {k: dict(v) for k, v in self.ops.items()}}
        if self.sync:
            d["sync"] = dict(self.sync)
        if self.resume:
            d["resume"] = dict(self.resume)
        if self.refill:
            d["refill"] = dict(self.refill)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CommFit":
        return cls(link=d["link"], ops={k: dict(v) for k, v in d["ops"].items()}, sync=dict(d.get("sync") or {}),
                   resume=dict(d.get("resume") or {}), refill=dict(d.get("refill") or {}))

    def resume_time(self) -> float:
        """Seconds a blocking op costs the compute right after it (0 without resume rows)."""
        return float(self.resume.get("seconds", 0.0))

    def refill_time(self, idle_s):
        """Seconds a rank's next compute loses after idling ``idle_s`` seconds in a
        blocking transfer (module doc; 0 without refill rows, and for idle_s <= 0); arrays ok."""
        idle = np.maximum(np.asarray(idle_s, dtype=float), 0.0)
        r_max = float(self.refill.get("r_max", 0.0))
        tau0 = float(self.refill.get("tau0", REFILL_TAU0))
        return r_max * -np.expm1(-idle / tau0)

    def straggle(self, n, compute_s):
        """Expected wait for the slowest of ``n`` ranks over a step whose ranks each
        computed ``compute_s`` seconds between synchronisations (0 for n <= 1 or no
        sync rows); arrays ok."""
        kappa = float(self.sync.get("kappa", 0.0))
        return kappa * np.asarray(compute_s, dtype=float) * expected_max(n) / _EMAX[1]

    def handoff(self, nbytes):
        """Seconds of one blocking pipeline transfer of ``nbytes`` between two ranks that
        both computed up to it (a 1F1B exchange, a fill / drain send): the rendezvous
        latency of the sync rows (``sync["a"]``: a tiny all-reduce right after a compute
        chunk) plus the bytes at send_recv's rate. Without sync rows, send_recv's own
        latency — which its table measured to a rank already waiting in ``recv``
        (profilerd.commbench: ~0.1 ms where the rendezvous took ~0.35 ms). Arrays ok;
        requires a send_recv fit."""
        c = self.ops["send_recv"]
        lat = float(self.sync["a"]) if "a" in self.sync else c["alpha"]
        return lat + c["beta"] * np.asarray(nbytes, dtype=float)

    def has(self, op: str) -> bool:
        return op in self.ops

    def time(self, op: str, n, nbytes):
        """Seconds of ``op`` over n ranks with ``nbytes`` per rank (0 for n <= 1)."""
        c = self.ops[op]
        st, vol = steps_and_volume(op, n, nbytes)
        return c["alpha"] * st + c["beta"] * vol


def _expected(rows: list[dict]) -> list[dict]:
    """One row per (world, bytes): the mean of its rows' seconds — the expected cost,
    which a step's many ops add up to. The fit runs on relative residuals, and fed the
    raw rows of a bimodal op (gloo as shipped, on a core it shares with its loop thread:
    0.3 or 3-4 ms, see tessera.gloo) it lands near the harmonic mean: 0.6 ms for rows
    averaging 1.1 ms."""
    by: dict[tuple, list[float]] = {}
    for r in rows:
        by.setdefault((r["world"], r["bytes"]), []).append(float(r["seconds"]))
    return [{"op": rows[0]["op"], "world": w, "bytes": b, "seconds": sum(v) / len(v), "n": len(v)}
            for (w, b), v in by.items()]


def sync_groups(rows: list[dict]) -> list[list[dict]]:
    """``rows`` (sync rows, ``compute_s`` > 0) grouped by chunk length, shortest first:
    sorted by ``compute_s``, a row more than ``SYNC_GROUP_GAP`` times the one before it
    starts the next group. The service's rows carry no chunk label (only ``compute_s``,
    measured); the chunk lengths profilerd.commbench times lie ~50x apart."""
    out: list[list[dict]] = []
    for r in sorted(rows, key=lambda r: r["compute_s"]):
        if out and r["compute_s"] <= SYNC_GROUP_GAP * out[-1][-1]["compute_s"]:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def fit_comm(link: str, rows: list[dict]) -> CommFit:
    """Fit each op that has at least 2 sizes in ``rows``; ops with fewer are left out
    (the composition then reports insufficient data for plans that need them). Rows
    of op ``"sync"`` with ``compute_s`` at 2 or more chunk lengths (:func:`sync_groups`)
    give ``sync`` (``rel_sigma``: the rows' scatter about its line), rows of
    op ``"resume"`` (seconds > 0) their mean ``resume``, rows of op ``"refill"`` (seconds
    > 0 after ``idle_s`` > 0) ``refill``."""
    out = CommFit(link=link)
    rf = [float(r["seconds"]) / -math.expm1(-float(r["idle_s"]) / REFILL_TAU0) for r in rows
          if r["op"] == REFILL and float(r["seconds"]) > 0 and float(r.get("idle_s", 0.0)) > 0]
    if rf:
        out.refill = {"r_max": float(np.mean(rf)), "tau0": REFILL_TAU0, "n": len(rf)}
    rr = [float(r["seconds"]) for r in rows if r["op"] == RESUME and float(r["seconds"]) > 0]
    if rr:
        out.resume = {"seconds": float(np.mean(rr)), "n": len(rr)}
    rs = [r for r in rows if r["op"] == SYNC and r.get("compute_s", 0) > 0 and r["seconds"] > 0]
    groups = sync_groups(rs)
    if len(groups) >= 2:
        gx = np.array([float(np.median([r["compute_s"] for r in g])) for g in groups])
        gy = np.array([float(np.median([r["seconds"] for r in g])) for g in groups])
        x = np.column_stack([np.ones(len(gx)), gx])
        with np.errstate(all="ignore"):  # an extreme row: a non-finite fit, which callers leave out
            a = x / gy[:, None]
            scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
            c = nnls(a / scale, np.ones(len(gx))) / scale
            y = np.array([r["seconds"] for r in rs])
            r = (c[0] + c[1] * np.array([r["compute_s"] for r in rs]) - y) / y
        out.sync = {"a": float(c[0]), "kappa": float(c[1]), "n": len(rs),
                    "rel_sigma": math.sqrt(float(r @ r) / max(1, len(rs) - 2))}
    for op in OPS:
        rs = _expected([r for r in rows if r["op"] == op and r["world"] > 1 and r["seconds"] > 0])
        if len({r["bytes"] for r in rs}) < 2:
            continue
        st, vol = zip(*(steps_and_volume(op, r["world"], r["bytes"]) for r in rs))
        y = np.array([r["seconds"] for r in rs])
        x = np.column_stack([np.array(st, dtype=float), np.array(vol, dtype=float)])
        with np.errstate(all="ignore"):  # as above
            a = x / y[:, None]
            scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
            c = nnls(a / scale, np.ones(len(rs))) / scale
            r = (x @ c - y) / y
        dof = max(1, len(rs) - 2)
        out.ops[op] = {"alpha": float(c[0]), "beta": float(c[1]), "rel_sigma": math.sqrt(float(r @ r) / dof),
                       "n": sum(row["n"] for row in rs), "max_bytes": float(max(rr["bytes"] for rr in rs))}
    return out
