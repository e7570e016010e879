"""The performance model snapshot and its composition of a whole plan (pure).

Contract:
- :class:`PerfModel` holds versioned coefficients: a :class:`ComputeFit` per device
  type, a :class:`CommFit` per link type and interference coefficients per device
  type. ``to_dict``/``from_dict`` round-trip exactly (JSON-safe), so the estimator
  serves it and the controller evaluates it with this same code.
- :meth:`PerfModel.estimate_batch` takes many :class:`Candidate` and returns one
  :class:`Estimate` each, vectorised per (device type, link) group;
  :meth:`PerfModel.estimate` is the batch of one (identical numbers).
- An estimate is ``status="ok"`` with seconds, memory, a breakdown and a
  confidence, or ``status="insufficient_data"`` with the reason and no numbers.
- A candidate whose module is a ``peft``/``multimodal`` step shape
  (``tessera.modelkey.shape_key``) is answered from that shape's own profiles
  (:mod:`tessera.perfmodel.workload`), never by the composition below.

Composition (one training step of the runtime's ``gpt`` workload, rank 0's view):

    t_s      = m-independent per-micro-batch stage time: compute(q) + 4*layers_s*AR_tp(act)
               + sends_s * (alpha_p2p + beta_p2p * act)   (sends: forward to the next, grads
               to the previous; t_s sets pp = 1 and the breakdown's bubble)
    T_pipe   = m * t_0 for pp = 1; for pp > 1 the runtime's schedule (1F1B or GPipe)
               replayed op by op (tessera.perfmodel.pipeline) on each stage's forward
               (FWD_SHARE of its compute) and backward, each transfer a rendezvous of two
               computing ranks (CommFit.handoff: the sync rows' latency + bytes, + resume),
               a rank that waited in one woken (+ alpha_p2p) and its caches refilled
               (+ CommFit.refill_time of its wait); the last stage to finish sets it.
               (Until 2026-12-06 sum_s t_s + (m - 1) * max_s t_s + 2 (pp - 1) alpha_p2p,
               which counts one forward too many where the first stage is the
               bottleneck — 1F1B runs its next forward while the next stage computes —
               and priced each transfer at the ping-pong latency of a rank already
               waiting: re-fitted over the stored runs, multi_pp2 MAPE 5.41 ->
               4.42 % (26 Intel runs), 9.12 -> 7.69 % (7 AMD runs s22a-g), 10.78 -> 10.02 %
               (18 AMD runs s19-s21).)
    T_step   = T_pipe + max_s [AR_dp(4 * params_s) + dp>1 * bucket_s] + AR_world(16 B) + max_s step_work_s
               (bucket_s: flatten, average and copy back the gradients, 3 element-wise passes)
               + straggle(dp * tp, rank 0's compute) (waiting for the slowest replica; CommFit.straggle)
    colocated: (T + g_mode * e * (colocated - 1) * C) * oversubscription, C the compute
               part of T (equal to T for one rank), mode "shared" when the quotas
               oversubscribe the device (time slicing), else "split". Interference slows
               compute (shared caches, memory bandwidth) — its memory-bound part: e is the
               candidate's element-wise share of compute over that of the module whose
               pairs gave g (``interference_ref``; 1 without one), in every mode but
               "shared" (e = 1 there: see ``_interference_scale``). The communication
               tables were measured with every rank busy already. The ranks of a plan
               that share one device (a CPU node's cores) are colocated with each other:
               ``colocated`` counts them; where the model has a *rank profile* of such
               plans (mode "pipeline": a pp > 1 plan's, which prices pp > 1 plans; "ranks":
               a dp / tp plan's, which prices dp / tp plans and pipelines without a
               "pipeline" g), their g is that mode's (:func:`interference_mode`,
               :func:`fit_rank_interference`), not the split pair's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from tessera.perfmodel import features as F
from tessera.perfmodel.comm import CommFit
from tessera.perfmodel import pipeline as PL
from tessera.perfmodel import workload as W
from tessera.perfmodel.compute import ComputeFit, extrapolation
from tessera.perfmodel.priors import (  # noqa: F401 (re-exported)
    COLOCATION, CONF_TOLERANCE, EXTRAP_PER_LOG, NOISE_TO_ERROR, RUN_TO_RUN, UNSEEN_MODULE, confidence)

FORMAT = "tessera.perfmodel/1"
# Revision of the fitting rules beyond the feature counts (``features.FEATURES_REV``): what
# the comm, interference and rank fits make of the same measurements. A service that
# persisted a snapshot fitted under another revision refits it from its measurement log
# (estimator/models.py). 2 (2026-12-07, twenty-second session): the straggler line through
# each chunk length's medians (``comm.sync_groups``), a rank profile fits its plan's mode
# (``fit_rank_interference``). A snapshot persisted without it counts as 1.
FIT_REV = 2
# Element-wise passes over the gradients of a data-parallel step's flat bucket
# (agent.runtime.parallel.pipeline.average_gradients: cat, /= dp, copy back).
DP_BUCKET_PASSES = 3.0
# A micro-batch's forward share of its forward + backward compute (the pipeline replay
# needs them apart): a third by FLOPs (the backward computes two products per forward
# one); the runtime's phase timers read 0.36-0.37 on the pp = 2 stages of A and C
# (2-vCPU KVM guest, torch 2.13 CPU, 2026-12-06).
FWD_SHARE = 1.0 / 3.0

@dataclass(frozen=True)
class Candidate:
    """One configuration to estimate. ``batch`` is the global batch (rows); ``seq``
    defaults to ``seq_len``; ``quota`` is per rank (cores on CPU, SM share on GPU)."""

    device_type: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    batch: int
    seq: int = 0
    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1
    quota: float = 1.0
    link: str = ""
    module: str = ""
    colocated: int = 1              # modules (or ranks of this plan) sharing the device, this one included
    oversubscription: float = 1.0   # sum of quotas on the device / its capacity
    schedule: str = "1f1b"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class Estimate:
    """Step time and per-device memory of a candidate, with its uncertainty."""

    status: str                     # "ok" | "insufficient_data"
    seconds: float = math.nan
    memory_bytes: float = math.nan  # the most loaded rank
    rel_std: float = math.nan       # expected relative error (1 sigma)
    confidence: float = 0.0         # P(|error| < 10%)
    reason: str = ""
    breakdown: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# Interference modes of a plan's own ranks sharing one device (a CPU node's cores), fitted
# from rank profiles (:func:`fit_rank_interference`): "pipeline" from pp > 1 plans, for pp > 1
# plans, whose stages idle on each other by the schedule; "ranks" from dp / tp plans, for any
# such plan (a pipeline where no "pipeline" g is fitted).
RANK_MODES = ("ranks", "pipeline")


def interference_mode(c: Candidate, fitted) -> str:
    """The interference mode that prices candidate ``c`` given the modes ``fitted`` for its
    device type: a multi-rank plan whose ranks share the device only with each other
    (``colocated`` <= its world: every co-resident counted is one of its own ranks) on
    disjoint quotas (no oversubscription) takes "pipeline" when pp > 1 and that mode was
    fitted, else "ranks" when fitted; everything else "shared" when the quotas
    oversubscribe the device (time slicing), else "split" (two independent jobs on
    disjoint cores or SM shares)."""
    if c.world > 1 and c.colocated <= c.world and c.oversubscription <= 1:
        if c.pp > 1 and "pipeline" in fitted:
            return "pipeline"
        if "ranks" in fitted:
            return "ranks"
    return "shared" if c.oversubscription > 1 else "split"


def _insufficient(reason: str) -> Estimate:
    return Estimate(status="insufficient_data", reason=reason)


@dataclass
class PerfModel:
    """Versioned snapshot of every fitted coefficient (see module docstring)."""

    version: int = 0
    compute: dict = field(default_factory=dict)       # device_type -> ComputeFit
    comm: dict = field(default_factory=dict)          # link -> CommFit
    interference: dict = field(default_factory=dict)  # device_type -> {"split": g, "shared": g}
    # device_type -> shape of the module whose pairs gave ``interference`` ({"layers",
    # "hidden", "heads", "vocab", "rows", "seq"}; rows per micro-batch): g is scaled by a
    # candidate's element-wise share of compute over that module's. Absent: g as fitted.
    interference_ref: dict = field(default_factory=dict)
    # device_type -> profiled points (see ProfilePoint): answers exactly the configurations
    # that were run while the device type has too few profiles for a fitted curve.
    profiles: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ snapshot
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": self.version,
                "compute": {k: v.to_dict() for k, v in self.compute.items()},
                "comm": {k: v.to_dict() for k, v in self.comm.items()},
                "interference": {k: dict(v) for k, v in self.interference.items()},
                "profiles": {k: [p.to_dict() for p in v] for k, v in self.profiles.items()},
                **({"interference_ref": {k: dict(v) for k, v in self.interference_ref.items()}}
                   if self.interference_ref else {})}

    @classmethod
    def from_dict(cls, d: dict) -> "PerfModel":
        if d.get("format") != FORMAT:
            raise ValueError(f"unknown perf model format {d.get('format')!r}; expected {FORMAT}")
        return cls(version=int(d["version"]),
                   compute={k: ComputeFit.from_dict(v) for k, v in d["compute"].items()},
                   comm={k: CommFit.from_dict(v) for k, v in d["comm"].items()},
                   interference={k: {m: float(g) for m, g in v.items()} for k, v in d["interference"].items()},
                   profiles={k: [ProfilePoint.from_dict(p) for p in v] for k, v in d.get("profiles", {}).items()},
                   interference_ref={k: {f: float(x) for f, x in v.items()}
                                     for k, v in (d.get("interference_ref") or {}).items()})

    # ------------------------------------------------------------------ estimates
    def estimate(self, c: Candidate) -> Estimate:
        """Estimate one candidate (same code path as a batch of one)."""
        return self.estimate_batch([c])[0]

    def estimate_batch(self, cands: list[Candidate]) -> list[Estimate]:
        """Estimate many candidates; order preserved. Invalid or unsupported ones get
        ``insufficient_data`` (with the reason) instead of raising. An invalid candidate
        (bad plan, model shape, quota, oversubscription or schedule) is never answered,
        not even from a profile; a measured profile answers a valid candidate only when
        its device type has no fitted compute curve (missing or not fitted yet)."""
        out: list[Estimate | None] = [None] * len(cands)
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(cands):
            if W.profiled(c.module):  # its own step shape: the gpt plan rules do not apply
                bad = W.invalid(c)
                out[i] = _insufficient(bad) if bad else self._from_workload(c)
                continue
            bad = self._invalid(c)
            if bad:
                out[i] = _insufficient(bad)
                continue
            no_curve = self._no_curve(c)
            if no_curve and c.device_type in self.profiles:
                hit = self._from_profile(c)
                if hit is not None:
                    out[i] = hit
                    continue
            why = no_curve or self._missing(c)
            if why:
                out[i] = _insufficient(why)
            else:
                groups.setdefault((c.device_type, c.link if c.world > 1 else ""), []).append(i)
        for (dev, link), idx in groups.items():
            for i, e in zip(idx, self._evaluate(dev, link, [cands[i] for i in idx])):
                out[i] = e
        return out  # type: ignore[return-value]

    def _from_workload(self, c: Candidate) -> Estimate:
        """A workload the compute curve does not describe (``peft``, ``multimodal``: its
        module is a ``tessera.modelkey.shape_key``): from its own profiles
        (:func:`tessera.perfmodel.workload.estimate`). No memory model: ``memory_bytes``
        is NaN."""
        fit = self.compute.get(c.device_type)
        got = W.estimate(c, self.profiles.get(c.device_type, ()), fit,
                         self.interference.get(c.device_type, {}))
        if isinstance(got, str):
            return _insufficient(got)
        seconds, r, breakdown, reason = got
        return Estimate(status="ok", seconds=seconds, memory_bytes=math.nan, rel_std=r, confidence=confidence(r),
                        reason=reason, breakdown=breakdown)

    def _from_profile(self, c: Candidate) -> Estimate | None:
        """From the measured profile of exactly this configuration's per-rank shape, or
        None. Used only where the fitted curve cannot answer (too few profiles), for a
        candidate already checked valid. A single-device plan is the profile itself; a
        data-parallel plan (dp > 1, tp = pp = 1) is the profile of its per-rank batch plus
        the gradient all-reduce (4 bytes per parameter), the loss all-reduce and the wait
        for the slowest rank over the link's fitted table. A profile point with seconds
        not finite and > 0, or a spread not finite and >= 0, answers nothing; the answer's
        seconds are finite and > 0 and its confidence in [0, 1], or there is none. A
        one-rank candidate sharing its device (``colocated`` > 1) is stretched by its
        oversubscription and the device type's fitted interference for its mode, as fitted
        (no reference scaling: there is no curve to scale by), ``rel_std`` widened by the
        colocation prior; without that mode fitted, or with several ranks, no answer."""
        if c.tp != 1 or c.pp != 1 or min(c.batch, c.layers, c.micro_batches, c.dp) < 1:
            return None
        stretch = 1.0
        if c.colocated > 1:  # a one-rank job beside others: the device's fitted interference, as fitted
            if c.world != 1:
                return None
            stretch = W.colocation_stretch(c, self.interference.get(c.device_type, {}))[1]
            if stretch is None:
                return None
        if c.batch % c.dp:
            return None
        rows = c.batch // c.dp
        comm = self.comm.get(c.link) if c.dp > 1 else None
        if c.dp > 1 and (comm is None or not comm.has("all_reduce")):
            return None
        seq = c.seq or c.seq_len
        for p in self.profiles.get(c.device_type, ()):
            if (p.module, p.rows, p.seq, p.micro_batches) == (c.module, rows, seq, c.micro_batches) \
                    and abs(p.q - c.quota) < 1e-9:
                if not p.usable():
                    continue  # a corrupt measurement: no answer rather than a wrong one
                params = F.stage_params(c.layers, c.hidden, c.vocab, c.seq_len, 1, 1)
                seconds, r, breakdown = p.seconds, p.rel_std(), {"profile": p.seconds}
                if comm is not None:
                    grad = float(comm.time("all_reduce", c.dp, params * F.BYTES_PER_ELEM))
                    loss = float(comm.time("all_reduce", c.dp, 16.0))
                    wait = float(comm.straggle(c.dp, p.seconds))
                    seconds += grad + loss + wait
                    csig = comm.ops["all_reduce"].get("rel_sigma", 0.0)
                    r = math.sqrt(r * r + (csig * (grad + loss) / seconds) ** 2)
                    breakdown.update(grad_allreduce=grad, loss_allreduce=loss, straggle=wait)
                if stretch != 1.0:
                    seconds *= stretch
                    r = math.sqrt(r * r + COLOCATION ** 2)
                    breakdown["colocation"] = stretch
                if not (math.isfinite(seconds) and seconds > 0 and math.isfinite(r) and r > 0):
                    continue
                mem = 16.0 * params + F.activation_bytes(rows / c.micro_batches, seq, c.layers, c.hidden, c.heads,
                                                         c.vocab, 1)
                return Estimate(status="ok", seconds=seconds, memory_bytes=float(mem), rel_std=r,
                                confidence=confidence(r),
                                reason=f"measured profile of the per-rank configuration ({p.steps} steps)"
                                       + (f" + all-reduce over {c.link!r}" if comm is not None else "")
                                       + f"; no fitted curve for {c.device_type!r} yet",
                                breakdown=breakdown)
        return None

    def _why_not(self, c: Candidate) -> str:
        """Why the fitted model cannot estimate ``c`` ("" if it can): the candidate is
        invalid, or data it needs is missing."""
        return self._invalid(c) or self._no_curve(c) or self._missing(c)

    @staticmethod
    def _invalid(c: Candidate) -> str:
        """Why ``c`` is not a valid configuration at all ("" if it is); no data helps: a
        plan field < 1, pp > layers, pp > ``MAX_PP``, micro_batches > ``MAX_MICRO_BATCHES``
        or (pp > 1) pp * micro_batches > ``MAX_PIPELINE_SLOTS`` (:mod:`tessera.perfmodel.
        pipeline`: the replay's cost), batch
        not divisible by dp * micro_batches, hidden or heads not by tp, a model field < 1,
        hidden not divisible by heads, seq < 0 or seq > seq_len (the runtime's context),
        a bad quota / colocation (``workload.quota_problem``) or an unknown schedule."""
        if min(c.dp, c.tp, c.pp, c.micro_batches, c.batch, c.layers) < 1 or c.layers < c.pp:
            return "invalid plan (dp, tp, pp, micro_batches, batch >= 1; layers >= pp)"
        if c.pp > PL.MAX_PP or c.micro_batches > PL.MAX_MICRO_BATCHES \
                or (c.pp > 1 and c.pp * c.micro_batches > PL.MAX_PIPELINE_SLOTS):
            return (f"invalid plan (pp <= {PL.MAX_PP}, micro_batches <= {PL.MAX_MICRO_BATCHES}, "
                    f"pp*micro_batches <= {PL.MAX_PIPELINE_SLOTS} for a pipeline)")
        if c.batch % (c.dp * c.micro_batches) or c.hidden % c.tp or c.heads % c.tp:
            return "batch must divide by dp*micro_batches, hidden and heads by tp"
        if min(c.hidden, c.heads, c.vocab, c.seq_len) < 1 or (c.seq or 0) < 0:
            return "invalid model (hidden, heads, vocab, seq_len >= 1; seq >= 0)"
        if c.hidden % c.heads or (c.seq or 0) > c.seq_len:
            return "invalid model (hidden divisible by heads; seq <= seq_len)"
        bad = W.quota_problem(c)
        if bad:
            return bad
        if c.schedule not in ("1f1b", "gpipe"):
            return f"unknown schedule {c.schedule!r} (1f1b or gpipe)"
        return ""

    def _no_curve(self, c: Candidate) -> str:
        """Why the device type has no usable fitted compute curve ("" if it has one)."""
        fit = self.compute.get(c.device_type)
        if fit is None:
            return f"no compute profile for device type {c.device_type!r}"
        if fit.status != "ok":
            return fit.reason or f"compute model of {c.device_type!r} not fitted"
        return ""

    def _missing(self, c: Candidate) -> str:
        """Why a valid candidate lacks communication or colocation data ("" if it has it)."""
        if c.world > 1:
            cf = self.comm.get(c.link)
            if cf is None:
                return f"no communication table for link type {c.link!r}"
            need = ["all_reduce"] + (["send_recv"] if c.pp > 1 else [])
            missing = [op for op in need if not cf.has(op)]
            if missing:
                return f"link {c.link!r} has no measurements of {', '.join(missing)}"
        if c.colocated > 1:
            mode = interference_mode(c, self.interference.get(c.device_type, {}))
            if mode not in self.interference.get(c.device_type, {}):
                return f"no colocation ({mode}) profile for device type {c.device_type!r}"
        return ""

    def _interference_scale(self, fit: ComputeFit, dev: str, rows, T, layers, h, a, V, head, tp, q):
        """How much more (or less) a candidate suffers from colocation than the module
        whose pairs were profiled: the element-wise share of a micro-batch's compute (first
        stage) over that module's at quota 1. Sharing a core (time slicing: caches refilled
        after every switch) or a CPU (the other core's memory traffic) slows memory-bound
        work; large matmuls barely notice: with one g for all (the A 8x64 twins'), the
        time-sliced pairs holding a wide module (hidden 192) read 8-16 % high, narrow
        ones -4 ... +4 %. 1 without a whole reference shape (older snapshots; the
        estimator service's colocation rows carry none).

        Not applied to mode "shared" (time slicing) since 2026-12-08 (twenty-fourth
        session): there a module's loss is its caches refilled after every switch, and
        the grid's own model-free ratio — a time-sliced pair's step over twice the same
        pair's on split cores, same run — was the same for every module: +12 ... +15 %
        for all eight of A 16x64, B, C, D, E on the Intel host (34 stored runs; A 8x32,
        the smallest step, +7.7 %), -0.9 ... +3.3 % on the AMD one (20 runs), where the scale
        gave the wide ones less (Intel time-sliced rows -3.9 % mean signed with it, -1.1
        without; single-device MAPE re-fitted 4.07 -> 3.95 %, AMD 6.29 -> 6.37: there
        the A twins' g over-states every time-sliced row, A's own too, and the scale
        had hidden part of that for the wide ones)."""
        ref = self.interference_ref.get(dev) or {}
        if any(k not in ref for k in ("layers", "hidden", "heads", "vocab", "rows", "seq")):
            return 1.0

        def share(mbf, qq):
            return fit.elementwise_time(mbf["elems"], qq) / np.maximum(fit.mb_time(mbf, qq), 1e-300)

        r = share(F.mb_features(ref["rows"], ref["seq"], ref["layers"], ref["hidden"], ref["heads"], ref["vocab"], 1, 1),
                  1.0)
        if not r > 0:
            return 1.0
        return share(F.mb_features(rows, T, layers, h, a, V, 1, head, tp), q) / r

    @staticmethod
    def _replay(cs: list[Candidate], pp, m, extra, fwd: dict, bwd: dict, xfer, wake, refill=None):
        """The pipeline part of each pp > 1 candidate's step: its schedule replayed
        (:mod:`tessera.perfmodel.pipeline`) on its stages' forward / backward times, in
        groups of one (pp, m, schedule); the last stage to finish sets it (every rank
        meets at the step's loss all-reduce). Stage s holds the first kind's layers for
        s = 0, the last's for s = pp - 1, one more than ``base`` for s < extra."""
        out = np.zeros(len(cs))
        xfer = np.broadcast_to(np.asarray(xfer, dtype=float), (len(cs),))
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(cs):
            if c.pp > 1:
                groups.setdefault((c.pp, c.micro_batches, c.schedule), []).append(i)
        for (p, mm, sched), idx in groups.items():
            ix = np.array(idx)

            def stage(d, s):
                if s == 0:
                    return d["first"][ix]
                if s == p - 1:
                    return d["last"][ix]
                return np.where(s < extra[ix], d["mid_big"][ix], d["mid_small"][ix])

            ends = PL.replay(PL.schedule_ops(p, mm, sched), [stage(fwd, s) for s in range(p)],
                             [stage(bwd, s) for s in range(p)], [xfer[ix]] * (p - 1), wake, refill)
            out[ix] = np.max(np.stack(ends), axis=0)
        return out

    def _evaluate(self, dev: str, link: str, cs: list[Candidate]) -> list[Estimate]:
        fit: ComputeFit = self.compute[dev]
        comm: CommFit | None = self.comm.get(link) if link else None

        def arr(name):
            return np.array([getattr(c, name) for c in cs], dtype=float)

        L, h, a, V, sl = arr("layers"), arr("hidden"), arr("heads"), arr("vocab"), arr("seq_len")
        T = np.array([c.seq or c.seq_len for c in cs], dtype=float)
        B, dp, tp, pp, m, q = arr("batch"), arr("dp"), arr("tp"), arr("pp"), arr("micro_batches"), arr("quota")
        rows = B / dp / m
        gpipe = np.array([c.schedule == "gpipe" for c in cs])
        act = rows * T * h * F.BYTES_PER_ELEM

        # Every blocking op also costs the compute after it a refill (CommFit.resume).
        resume = comm.resume_time() if comm is not None else 0.0

        def ar(n, nbytes):
            return (comm.time("all_reduce", n, nbytes) + resume) * (n > 1) if comm is not None else 0.0 * n

        has_p2p = comm is not None and comm.has("send_recv")
        p2p_lat = comm.time("send_recv", 2, 0.0) if has_p2p else 0.0

        def p2p(nbytes):
            # A stage's own cost of a blocking transfer: latency (the handshake) and bytes,
            # and the refill after it — in t_s, which for pp > 1 now only sets the
            # breakdown's bubble (the pipeline itself is replayed, transfers at
            # CommFit.handoff). Until 2026-12-06 only the bytes were charged in the
            # steady state ("the data waits for the receiver"); measured, a 1F1B exchange
            # costs the bottleneck stage its handshake although the neighbour is ready
            # (module doc); without it the stored runs' pp = 2 rows read low on average
            # (m <= 2: -5.9 % mean signed over 26 Intel runs, -12.4 % over 14 AMD ones).
            return comm.time("send_recv", 2, nbytes) + resume if has_p2p else 0.0 * nbytes

        base, extra = np.floor_divide(L, pp), np.mod(L, pp)
        single = pp == 1
        # Stage kinds: first (embeds; also the head when pp = 1), last, middle big/small.
        kinds = {
            "first": (base + (extra > 0), 1.0, single * 1.0, 1.0),
            "last": (base, 0.0, 1.0, (~single) * 1.0),
            "mid_big": (base + 1, 0.0, 0.0, np.clip(extra - 1, 0, np.maximum(pp - 2, 0))),
            "mid_small": (base, 0.0, 0.0, np.maximum(pp - 2, 0) - np.clip(extra - 1, 0, np.maximum(pp - 2, 0))),
        }
        # The profiled module's own correction of the compute terms (1 if never profiled).
        mod = np.array([fit.modules.get(c.module, 1.0) for c in cs])
        t_mb, t_step, params, mem, c_mb, c_step, fwd, bwd = {}, {}, {}, {}, {}, {}, {}, {}
        for k, (ls, e, hd, count) in kinds.items():
            mbf = F.mb_features(rows, T, ls, h, a, V, e, hd, tp)
            stf = F.step_features(T, ls, h, V, sl, e, hd, tp, mb_elems=mbf["elems"], micro_batches=m)
            sends = (pp > 1) * ((k != "last") * 1.0 + (k != "first") * 1.0)
            # Gradient accumulation (m > 1) happens in the micro-batches' backward: its
            # share per micro-batch, so that the pipeline's fill and bottleneck carry it.
            mb = mod * fit.mb_time(mbf, q)
            comp = mb + mod * fit.accumulation_time(stf["params"], m, q) / m
            tp_ar = 4.0 * ls * ar(tp, act)
            t = comp + tp_ar + sends * p2p(act)
            # For the pipeline replay: forward and backward apart (a forward is FWD_SHARE of
            # the micro-batch's compute; the accumulation is the backward's; half the tp
            # all-reduces each way), transfers priced by the replay.
            fwd[k] = np.where(count > 0, FWD_SHARE * mb + 0.5 * tp_ar, 0.0)
            bwd[k] = np.where(count > 0, comp + tp_ar - fwd[k], 0.0)
            c_mb[k] = np.where(count > 0, comp, 0.0)
            t_mb[k] = np.where(count > 0, t, 0.0)
            params[k] = np.where(count > 0, stf["params"], 0.0)
            c_step[k] = np.where(count > 0, mod * fit.step_time(stf, q), 0.0)
            # dp > 1: the gradients go through one flat bucket — flatten, average, copy
            # back: DP_BUCKET_PASSES element-wise passes over every gradient element.
            bucket = (dp > 1) * mod * fit.elementwise_time(DP_BUCKET_PASSES * params[k], q)
            c_step[k] = c_step[k] + np.where(count > 0, bucket, 0.0)
            t_step[k] = np.where(count > 0, c_step[k] + ar(dp, params[k] * F.BYTES_PER_ELEM), 0.0)
            inflight = np.where(gpipe, m, np.minimum(m, pp if k == "first" else 1.0))  # per candidate
            mem[k] = np.where(count > 0, 16.0 * params[k] + inflight * F.activation_bytes(rows, T, ls, h, a, V, hd, tp), 0.0)
        counts = {k: v[3] * np.ones_like(L) for k, v in kinds.items()}
        t_sum = sum(counts[k] * t_mb[k] for k in kinds)
        t_max = np.max(np.stack([t_mb[k] for k in kinds]), axis=0)
        pipe = t_sum + (m - 1) * t_max  # pp = 1: m micro-batches back to back
        if np.any(pp > 1):
            # Each transfer is a rendezvous of two computing ranks (CommFit.handoff), and
            # the blocking op's resume after it; a rank that waited in it is woken (one
            # ping-pong latency, as for the fill and drain before) and comes back to caches
            # refilled for as long as it idled (CommFit.refill_time; 0 without refill rows).
            hand = comm.handoff(act) + resume if has_p2p else 0.0 * act
            refill = comm.refill_time if comm is not None and comm.refill else None
            pipe = np.where(pp > 1, self._replay(cs, pp, m, extra, fwd, bwd, hand, p2p_lat, refill), pipe)
        per_step = np.max(np.stack([t_step[k] for k in kinds]), axis=0)
        world = dp * tp * pp
        loss_ar = ar(world, 16.0)
        # Waiting for the slowest replica at the synchronisations: grows with the compute
        # of rank 0's step. Only data / tensor replicas run the same work in lock step;
        # pipeline stages wait on each other by the schedule (fill, drain, bubbles:
        # priced in ``pipe``), and pricing that twice over-estimated every pp = 2 plan
        # (+10-20 % in two of five stored runs).
        comp_pipe = sum(counts[k] * c_mb[k] for k in kinds) + (m - 1) * np.max(np.stack([c_mb[k] for k in kinds]), 0)
        comp_step = np.max(np.stack([c_step[k] for k in kinds]), axis=0)
        straggle = comm.straggle(dp * tp, comp_pipe + comp_step) if comm is not None else 0.0 * world
        total = pipe + per_step + loss_ar + straggle
        # Colocation: time slicing stretches by the oversubscription, interference by mode.
        n_co, over = arr("colocated"), np.maximum(arr("oversubscription"), 1.0)
        fitted = self.interference.get(dev, {})
        modes = [interference_mode(c, fitted) for c in cs]
        g = np.array([fitted.get(md, 0.0) for md in modes]) \
            * np.where([md == "shared" for md in modes], 1.0,
                       self._interference_scale(fit, dev, rows, T, base + (extra > 0), h, a, V, single * 1.0, tp, q))
        total = np.where(n_co > 1, (total + g * (n_co - 1) * (comp_pipe + comp_step)) * over, total)
        # Uncertainty: fit residuals, extrapolation, unseen module, comm share, colocation.
        point = {"tokens": rows * m * T, "seq": T, "layers": L / pp, "hidden": h / tp, "vocab": V, "q": q}
        d = extrapolation(fit, point)
        unseen = np.array([0.0 if c.module in fit.modules else UNSEEN_MODULE for c in cs])
        # The communication share of the time, from the same per-stage terms: tp
        # all-reduces and pipeline sends inside the micro-batches, the dp gradient
        # all-reduce, the loss all-reduce and the straggle (time slicing stretches it;
        # interference does not: the tables were measured with every rank busy).
        comm_part = np.maximum(pipe - comp_pipe, 0.0) + np.maximum(per_step - comp_step, 0.0) + loss_ar + straggle
        comm_part = np.where(n_co > 1, comm_part * over, comm_part)
        # The scatter of the ops the plan uses: every multi-rank step all-reduces (its
        # loss, and dp / tp), only a pipeline sends. (The largest over every measured op
        # let a noisy send/recv fit drag every dp / tp estimate's confidence down.)
        csig = 0.0 * world
        if comm is not None:
            sig = {op: float(v.get("rel_sigma", 0.0)) for op, v in comm.ops.items()}
            csig = np.where(pp > 1, max(sig.get("all_reduce", 0.0), sig.get("send_recv", 0.0)),
                            sig.get("all_reduce", 0.0))
        # The fit's residual scatter, floored at the run-to-run noise of a measured
        # configuration (a noiseless fit cannot predict a new run better than that): the
        # prior's, or what the profiles measured on this device when they show more (a
        # noisy host: a new run and the estimate each carry it).
        floor = max(RUN_TO_RUN, NOISE_TO_ERROR * fit.noise)
        var = max(fit.rel_sigma, floor) ** 2 + (EXTRAP_PER_LOG * d) ** 2 + unseen ** 2 \
            + (csig * comm_part / np.maximum(total, 1e-12)) ** 2 + (COLOCATION * (n_co > 1)) ** 2
        rel = np.sqrt(var)
        out = []
        for i in range(len(cs)):
            r = float(rel[i])
            if not (math.isfinite(float(total[i])) and total[i] > 0 and math.isfinite(r)):
                out.append(_insufficient("the model gives no finite positive time for this candidate"))
                continue
            conf = math.erf(CONF_TOLERANCE / (math.sqrt(2.0) * r)) if r > 0 else 1.0
            out.append(Estimate(
                status="ok", seconds=float(total[i]), memory_bytes=float(max(mem[k][i] for k in kinds)),
                rel_std=r, confidence=conf,
                breakdown={"pipeline": float(pipe[i]), "bubble": float((pp[i] > 1) * max(0.0, pipe[i] - m[i] * t_max[i])),
                           "per_step": float(per_step[i]), "loss_allreduce": float(np.asarray(loss_ar)[i] if np.ndim(loss_ar) else loss_ar),
                           "straggle": float(np.asarray(straggle)[i] if np.ndim(straggle) else straggle),
                           "extrapolation": float(np.asarray(d)[i] if np.ndim(d) else d)}))
        return out

    def with_version(self, version: int) -> "PerfModel":
        return replace(self, version=version)


@dataclass(frozen=True)
class ProfilePoint:
    """One profiled single-device configuration: the median of ``steps`` measured steps
    (warm-up excluded) and their spread ``(p90 - p10) / median``."""

    module: str
    rows: int
    seq: int
    micro_batches: int
    q: float
    seconds: float
    steps: int
    spread: float = 0.0

    def rel_std(self) -> float:
        """Expected relative error of predicting a new run by this median: the median's
        standard error (1.25 sigma / sqrt(n), sigma = spread / 2.56 for a normal) and the
        run-to-run prior, in quadrature."""
        se = 1.25 * (self.spread / 2.56) / math.sqrt(max(self.steps, 1))
        return math.sqrt(se * se + RUN_TO_RUN ** 2)

    def usable(self) -> bool:
        """A real measurement: seconds finite and > 0, spread finite and >= 0, steps >= 1."""
        return (math.isfinite(self.seconds) and self.seconds > 0 and math.isfinite(self.spread)
                and self.spread >= 0 and self.steps >= 1)

    def to_dict(self) -> dict:
        return {"module": self.module, "rows": self.rows, "seq": self.seq, "micro_batches": self.micro_batches,
                "q": self.q, "seconds": self.seconds, "steps": self.steps, "spread": self.spread}

    @classmethod
    def from_dict(cls, d: dict) -> "ProfilePoint":
        return cls(module=str(d["module"]), rows=int(d["rows"]), seq=int(d["seq"]),
                   micro_batches=int(d["micro_batches"]), q=float(d["q"]), seconds=float(d["seconds"]),
                   steps=int(d["steps"]), spread=float(d.get("spread", 0.0)))


def fit_interference(pairs: list[dict]) -> dict:
    """Interference coefficient per mode from colocation profiles.

    Each pair row: ``{"mode": "split"|"shared", "colocated": n, "oversubscription": o,
    "alone_s": measured alone step time, "together_s": measured colocated step time}``.
    g = median over rows of (together / (alone * o) - 1) / (n - 1), floored at 0.
    """
    by: dict[str, list[float]] = {}
    for r in pairs:
        n = r["colocated"]
        if n < 2 or r["alone_s"] <= 0:
            continue
        over = max(1.0, r.get("oversubscription", 1.0))
        by.setdefault(r["mode"], []).append((r["together_s"] / (r["alone_s"] * over) - 1.0) / (n - 1))
    return {mode: max(0.0, float(np.median(v))) for mode, v in by.items()}


def fit_rank_interference(model: PerfModel, rows: list[dict]) -> dict:
    """Interference of a plan's own ranks on a shared device, per device type and rank
    mode, from *rank profiles*: short real runs of a multi-rank plan whose ranks share
    the device (a CPU node's cores).

    Each row: ``{"mode": "ranks"|"pipeline", "candidate": Candidate fields (dict),
    "seconds": the measured step time}``. A row fits the mode of its *plan*: a pp > 1
    plan's "pipeline", a dp / tp plan's "ranks" (a "pipeline" row of a pp = 1 plan is
    skipped; a "ranks" row of a pp > 1 plan fits "pipeline" — until 2026-12-07's
    twenty-second session it fitted "ranks", and the one pipeline that profilerd.colobench
    and the accuracy benchmark measure priced every dp / tp plan with a pipeline's loss:
    a stage that idles on its neighbour comes back to cold caches, which lock-step dp /
    tp ranks do not; their wait for each other is the straggler term,
    ``comm.CommFit.straggle``. Over the 15 stored AMD runs s27b-s32b, multi-rank
    7.53 -> 6.89 % mean, dp / tp / pp +3.7 / +8.5 / -0.5 -> -2.0 / +1.0 / -0.5 % mean
    signed, with the straggler fit of that session). See :func:`interference_mode`. A candidate's time is
    linear in its mode's g (``(T + g * e * (n - 1) * C) * o``), so each row gives
    ``g = (seconds - est(g=0)) / (est(g=1) - est(g=0))`` with ``model``'s own compute,
    communication and pipeline terms: what the ranks lose beside each other beyond what
    ``model`` already prices (a data-parallel rank computing beside its twin, a pipeline
    stage coming back from its waits to cold caches; on the 2-vCPU host of 2026-12-07 a
    stage's forward + backward ran 1.14-1.20x the same layers' in one process, a dp rank's
    1.08x — neither of which the split pair of two independent jobs shows). Returns
    ``{device_type: {mode: g}}``, g the median over a mode's rows, floored at 0 (a rank is
    not faster beside its peers); rows whose candidate is not a multi-rank plan sharing
    its device with its own ranks only, on disjoint quotas (:func:`interference_mode`),
    the model cannot estimate, or whose time is not finite and > 0 are skipped. Pure:
    ``model`` is not changed."""
    by: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        mode, t = r.get("mode"), r.get("seconds")
        if mode not in RANK_MODES or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            continue
        try:
            c = Candidate(**r["candidate"])
        except (KeyError, TypeError):
            continue
        if c.world < 2 or not 1 < c.colocated <= c.world or c.oversubscription > 1 \
                or (mode == "pipeline" and c.pp < 2):
            continue
        mode = "pipeline" if c.pp > 1 else "ranks"
        dev = c.device_type
        ests = []
        # The row's mode alone among the rank modes, so that it is the one that prices c.
        others = {k: v for k, v in model.interference.get(dev, {}).items() if k not in RANK_MODES}
        for g in (0.0, 1.0):
            inter = {**model.interference, dev: {**others, mode: g}}
            ests.append(replace(model, interference=inter).estimate(c))
        if not all(e.ok for e in ests) or not ests[1].seconds > ests[0].seconds:
            continue
        by.setdefault((dev, mode), []).append((t - ests[0].seconds) / (ests[1].seconds - ests[0].seconds))
    out: dict[str, dict[str, float]] = {}
    for (dev, mode), gs in by.items():
        out.setdefault(dev, {})[mode] = max(0.0, float(np.median(gs)))
    return out
