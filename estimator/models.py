"""From measurements to a versioned performance model (tessera.perfmodel), persisted.

Inputs, as the store indexes them (``run_key``, ``comm_row``, ``colocation_row``, ``rank_row``):
- step measurements of *single-device* ``gpt`` runs (labels ``world_size`` = 1, from
  ``tessera.modelkey.profile_labels``) and of rank 0 of ``peft``/``multimodal`` runs
  (``run_key``): each run (job, device kind, module, batch, micro-batches, quota)
  becomes one profile point, the median of its steps after ``WARMUP_STEPS`` (at least
  ``MIN_MEASURED`` measured steps); the compute curve is fitted on the ``gpt`` points
  only, the others answer estimates of their own step shape
  (``tessera.perfmodel.workload``);
- ``kind="comm"`` rows (labels ``op``, ``link``; values ``bytes``, ``world``, ``seconds``;
  ``compute_s`` too for ``op="sync"`` rows, the straggler term; ``idle_s`` for the
  ``op="refill"`` row, the pipeline's refill after idling),
  e.g. from the gloo micro-benchmark of ``bench/_measure.py``;
- ``kind="colocation"`` pairs (labels ``mode``, ``device_kind``; values ``colocated``,
  ``oversubscription``, ``alone_s``, ``together_s``);
- ``kind="ranks"`` rows (``rank_row``: a multi-rank plan whose ranks share one device,
  e.g. profilerd.colobench's 2-stage pipeline on two cores; labels ``mode`` "ranks" or
  "pipeline", ``device_kind``, ``link``, the module's shape and the plan; values
  ``seconds``, ``quota``): the rank modes' interference, fitted against the model's own
  terms (``tessera.perfmodel.fit_rank_interference``) once its compute curve and the
  link's comm fit exist — each row the mode of its plan (a pp > 1 plan's "pipeline",
  whatever its label: colobench's pipeline prices pipelines, not dp / tp plans).

``ModelKeeper`` refits when those inputs changed (not for device samples), at most
every ``min_refit_interval_s``, off the event loop; the version increases only when
the fitted snapshot differs. ``<state_dir>/model.json`` (written atomically) holds the
snapshot and the input revision it was fitted at, so a restart serves the same
version without refitting; the measurement log replays to the same revision. A snapshot
fitted under other feature counts (``FEATURES_REV``) or other fitting rules
(``tessera.perfmodel.FIT_REV``, recorded as ``fit_rev``; absent: 1) — an upgrade — is
served only until the refit from the log that its load forces.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessera import log
from tessera.fsutil import atomic_write
from tessera.measurement import (NUMERIC_LABELS, PROFILE_MIN_MEASURED, PROFILE_WARMUP_STEPS, ROW_VALUES,  # noqa: F401
                                 COMM_OPTIONAL_VALUES, MIN_TIME_S, RUN_INTS, malformed, number)
from tessera.perfmodel import (CommFit, ComputeFit, ComputeSample, PerfModel, ProfilePoint, fit_comm,
                               fit_compute, fit_interference, fit_rank_interference)
from tessera.perfmodel.comm import OPS, REFILL, RESUME, SYNC
from tessera.perfmodel.features import FEATURES_REV
from tessera.perfmodel.model import FIT_REV, RANK_MODES
from tessera.perfmodel.workload import profiled, workload_of

WARMUP_STEPS = PROFILE_WARMUP_STEPS  # tessera.measurement: the controller's profile_steps follows them too
MIN_MEASURED = PROFILE_MIN_MEASURED
MODEL_NAME = "model.json"
# RUN_INTS (the ints of a run key after job_id, device_kind, module), NUMERIC_LABELS,
# ROW_VALUES and ``malformed`` live in tessera.measurement: profilerd refuses at
# ReportStep exactly what ReportMeasurements refuses here.

MAX_INT = 2**31 - 1  # the largest configuration integer a run key takes (as the spec's)


_num = number  # a label or value as a finite float, or None


def _int(labels, k: str, default: str = "0") -> int | None:
    """Label ``k`` as an integer (``"2"``, ``"2.0"``), or None when it is not a finite
    number of at most ``MAX_INT`` in magnitude."""
    v = _num(labels.get(k, default) or default)
    if v is None or abs(v) > MAX_INT:
        return None
    return int(v)


def _pos(x) -> bool:
    v = _num(x)
    return v is not None and v > 0


def run_key(m) -> tuple | None:
    """The profiled run a step measurement belongs to, or None when it is not one. A
    ``gpt`` run is a single-device one (world_size 1); a run of another workload
    (``peft``, ``multimodal``) is rank 0 of any world size whose ``module`` is that
    workload's ``tessera.modelkey.shape_key`` (``<type>:...:w<digest>``; the world size
    is inside the digest). None too without configuration labels, a finite time > 0, a
    label that is a finite number, or a quota > 0 (label ``quota``, else ``threads``: the
    last element of the key), and for a step the agent labels
    ``colocated`` > 1 (other jobs ran on its partition then: no profile of the module
    alone; a running job's steps are profiles only while it has its partition to
    itself). Total: never raises."""
    lb = m.labels
    t = m.step_time_s
    wt = lb.get("workload_type", "gpt") or "gpt"
    module = lb.get("module", "")
    if not m.job_id or not (math.isfinite(t) and t > 0) or not module or lb.get("rank", "0") != "0":
        return None
    world = _int(lb, "world_size")
    if wt == "gpt":
        if world != 1 or workload_of(module) != "gpt":
            return None
    elif workload_of(module) != wt or ":w" not in module or world is None or world < 1:
        return None
    ints = tuple(_int(lb, k) for k in RUN_INTS)
    if any(v is None or v <= 0 for v in ints):
        return None
    # The quota it ran at: the agent's ``quota`` label (tessera.quota: cores of a CPU, the
    # GPU's SM share — the controller's candidates' units); an older agent's steps carry
    # only their CPU threads, which are the cores on a CPU.
    quota = _num(lb.get("quota") or lb.get("threads", "1") or "1")
    if quota is None or quota <= 0:
        return None
    if _int(lb, "colocated", "1") != 1:  # measured beside other jobs (absent: an older agent, alone)
        return None
    return (m.job_id, lb.get("device_kind", "cpu") or "cpu", lb["module"]) + ints + (quota,)


def fb_seconds(phases) -> float:
    """Forward + backward seconds of a step's ``phases`` map (the runtime's per-step
    phases), 0.0 when either is missing or either is not a finite number >= 0. Total."""
    f, b = _num(phases.get("forward", -1.0)), _num(phases.get("backward", -1.0))
    if f is None or b is None or f < 0 or b < 0:
        return 0.0
    return f + b


def comm_row(m) -> dict | None:
    """A communication row of a ``kind="comm"`` measurement, or None if malformed
    (every number finite: seconds >= ``MIN_TIME_S``, world an integer >= 2, bytes >= 0,
    compute_s / idle_s 0 (absent) or >= ``MIN_TIME_S``). Total."""
    v, lb = m.values, m.labels
    if not lb.get("op") or not lb.get("link"):
        return None
    seconds, world, nbytes = _num(v.get("seconds", 0)), _num(v.get("world", 0)), _num(v.get("bytes", 0))
    if seconds is None or seconds < MIN_TIME_S or world is None or not 2 <= world <= MAX_INT or nbytes is None \
            or nbytes < 0:
        return None
    row = {"link": lb["link"], "op": lb["op"], "bytes": nbytes, "world": int(world), "seconds": seconds}
    for k in COMM_OPTIONAL_VALUES:  # the sync rows' compute_s, the refill row's idle_s
        x = _num(v.get(k, 0))
        if x is None or 0 < x < MIN_TIME_S:
            return None
        if x > 0:
            row[k] = x
    return row


def colocation_row(m) -> dict | None:
    """A colocation pair of a ``kind="colocation"`` measurement, or None if malformed
    (finite times >= ``MIN_TIME_S``, an integer colocated >= 1, a finite oversubscription
    > 0). Total."""
    v, lb = m.values, m.labels
    if lb.get("mode") not in ("split", "shared"):
        return None
    alone, together = _num(v.get("alone_s", 0)), _num(v.get("together_s", 0))
    n, over = _num(v.get("colocated", 2)), _num(v.get("oversubscription", 1.0))
    if alone is None or alone < MIN_TIME_S or together is None or together < MIN_TIME_S or n is None \
            or not 1 <= n <= MAX_INT \
            or over is None or over <= 0:
        return None
    row = {"device_kind": lb.get("device_kind", "cpu") or "cpu", "mode": lb["mode"],
           "colocated": int(n), "oversubscription": over, "alone_s": alone, "together_s": together}
    ref = {k: _int(lb, k) for k in REF_LABELS}
    if all(x is not None and 1 <= x <= MAX_INT for x in ref.values()):
        row["ref"] = ref  # the measured module's shape (profilerd.colobench): interference_ref
    return row


# The integer labels of a ``kind="ranks"`` row: its module's shape and its plan (Candidate fields).
RANK_INTS = ("layers", "hidden", "heads", "vocab", "seq_len", "batch", "seq", "dp", "tp", "pp", "micro_batches")


def rank_row(m) -> dict | None:
    """A rank profile of a ``kind="ranks"`` measurement — ``{"device_kind", "mode",
    "link", "candidate": Candidate fields, "seconds"}`` with ``colocated`` = the plan's
    world (its ranks share the device with each other only) — or None if it is not one:
    mode not in ``RANK_MODES``, an integer label (``RANK_INTS``) missing or < 1, a world
    below 2, a time below ``MIN_TIME_S`` or a quota that is not > 0. Total."""
    v, lb = m.values, m.labels
    if lb.get("mode") not in RANK_MODES:
        return None
    ints = {k: _int(lb, k) for k in RANK_INTS}
    t, q = _num(v.get("seconds", 0)), _num(v.get("quota", 1.0))
    if any(x is None or not 1 <= x <= MAX_INT for x in ints.values()) or t is None or t < MIN_TIME_S \
            or q is None or q <= 0:
        return None
    world = ints["dp"] * ints["tp"] * ints["pp"]
    if world < 2:
        return None
    dev = lb.get("device_kind", "cpu") or "cpu"
    cand = {"device_type": dev, **ints, "quota": q, "link": lb.get("link", ""), "colocated": world}
    return {"device_kind": dev, "mode": lb["mode"], "link": cand["link"], "candidate": cand, "seconds": t}


def rank_key(row: dict) -> tuple:
    """The configuration a rank row measured (its store window's key): device kind, mode,
    link and the candidate's fields."""
    c = row["candidate"]
    return (row["device_kind"], row["mode"], row["link"]) + tuple(c[k] for k in RANK_INTS) + (c["quota"],)


# The labels of a colocation pair that name its module's shape (``PerfModel.interference_ref``).
REF_LABELS = ("layers", "hidden", "heads", "vocab", "rows", "seq")


def interference_ref(rows: list[dict]) -> dict | None:
    """The shape of the module whose pairs ``rows`` (one device type's) measured, when
    every row names one and all name the same (``colocation_row``'s ``ref``); else None:
    g is then applied as fitted (a mix of modules has no one reference). Pure."""
    refs = [r.get("ref") for r in rows]
    if not refs or any(x is None or x != refs[0] for x in refs):
        return None
    return {k: float(v) for k, v in refs[0].items()}


@dataclass(frozen=True)
class Profile:
    """One single-device run turned into a profile point."""

    job_id: str
    device_type: str
    module: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    rows: int
    micro_batches: int
    quota: float
    steps: int
    median_s: float
    spread: float
    mb_s: float = 0.0  # median forward + backward of the measured steps; 0: not every step reported it

    def point(self) -> ProfilePoint:
        return ProfilePoint(module=self.module, rows=self.rows, seq=self.seq_len, micro_batches=self.micro_batches,
                            q=self.quota, seconds=self.median_s, steps=self.steps, spread=self.spread)

    def sample(self) -> ComputeSample:
        return ComputeSample(module=self.module, rows=self.rows, seq=self.seq_len, layers=self.layers,
                             hidden=self.hidden, heads=self.heads, vocab=self.vocab, q=self.quota,
                             seconds=self.median_s, micro_batches=self.micro_batches, seq_len=self.seq_len,
                             mb_seconds=self.mb_s)


def is_profile(steps: dict[int, float]) -> bool:
    """Whether a run's steps make a profile point: at least ``MIN_MEASURED`` after the
    ``WARMUP_STEPS`` lowest step numbers."""
    return len(steps) - WARMUP_STEPS >= MIN_MEASURED


def _median(values: list[float]) -> float:
    """The median, overflow-safe (``np.median`` averages the middle pair as (a + b) / 2,
    which is inf for two values near the float maximum)."""
    v = sorted(values)
    n = len(v)
    return float(v[n // 2]) if n % 2 else float(v[n // 2 - 1] / 2 + v[n // 2] / 2)


def profiles(runs: dict[tuple, dict[int, float]], fb: dict[tuple, dict[int, float]] | None = None) -> list[Profile]:
    """Profile points of the runs with at least ``MIN_MEASURED`` steps after warm-up
    (``is_profile``), sorted by (device type, module, job): the median of a gpt run's
    measured steps, the mean of a peft / multimodal run's (see below); ``spread`` relative
    to that value. ``fb`` (run key -> step ->
    forward + backward seconds, 0 when a step did not report them) gives a point its
    ``mb_s`` when every measured step reported them."""
    out = []
    fb = fb or {}
    for key, steps in runs.items():
        if not is_profile(steps):
            continue
        order = sorted(steps)[WARMUP_STEPS:]
        ts = [steps[k] for k in order]
        run_fb = fb.get(key, {})
        fbs = [run_fb.get(k, 0.0) for k in order]
        mb_s = _median(fbs) if all(v > 0 for v in fbs) else 0.0
        job, dev, module = key[:3]
        layers, hidden, heads, vocab, seq_len, batch, mb = key[3:10]
        # A gpt step repeats the same work: the median shrugs off a disturbed step. A
        # peft / multimodal step does not (tessera.perfmodel.workload): a temporal LoRA
        # job alternates its tasks step by step, and the median of an odd count of
        # alternating steps is one task's step — 10 ms for tasks of 10 and 30 ms where the
        # job takes 20 ms a step. Their point is the mean step (what the job's steps add
        # up to): over the 26 stored Intel benchmark runs s17a-s18x3 the temporal shape's
        # quota-1 row read -4.5 % (mean signed) from the median, -2.4 % from the mean.
        med = _median(ts) if not profiled(module) else float(sum(ts) / len(ts))
        p10, p90 = np.percentile(ts, [10, 90])
        spread = float((p90 - p10) / med) if med > 0 else 0.0
        if not (math.isfinite(med) and math.isfinite(spread)):  # never served, never a model input
            continue
        out.append(Profile(job, dev, module, layers, hidden, heads, vocab, seq_len, batch, mb, key[10], len(ts), med,
                           spread, mb_s if math.isfinite(mb_s) else 0.0))
    return sorted(out, key=lambda p: (p.device_type, p.module, p.job_id))


def _finite(part) -> bool:
    """Whether one fitted part (its JSON form) is finite JSON, as ``_canonical`` needs."""
    try:
        json.dumps(part, allow_nan=False)
    except ValueError:
        return False
    return True


def _fit_link(link: str, rows: list[dict], lg) -> CommFit:
    """The communication fit of one link, each part on its own (``fit_comm`` fits every op,
    and the sync / resume / refill terms, from that op's rows only: fitted apart they are
    the same numbers). A part whose fit raises or is not finite is left out, with a
    warning naming it; the link's other parts stay."""
    out = CommFit(link=link)
    present = {r["op"] for r in rows}
    for op in [o for o in OPS + (SYNC, RESUME, REFILL) if o in present]:
        try:
            part = fit_comm(link, [r for r in rows if r["op"] == op])
        except Exception as e:
            lg.warning("communication fit failed; left out", link=link, op=op, error=repr(e))
            continue
        got = [(o, v) for o, v in part.ops.items()] + [(a, getattr(part, a)) for a in ("sync", "resume", "refill")
                                                        if getattr(part, a)]
        for name, v in got:
            if not _finite(v):
                lg.warning("communication fit is not finite; left out", link=link, op=name, fit=repr(v))
            elif name in part.ops:
                out.ops[name] = v
            else:
                setattr(out, name, v)
    return out


def build_model(runs: dict, comm_rows: list[dict], colocation_rows: list[dict], version: int,
                fb: dict | None = None, rank_rows: list[dict] | None = None) -> PerfModel:
    """Fit every part the data allows (pure apart from numpy): a compute curve per
    device type (it says insufficient_data when too few profiles), profile points per
    device type, a communication fit per link, interference per device type — the
    colocation pairs' modes, then the rank modes from ``rank_rows`` (``rank_row``s)
    against that model's own terms (``fit_rank_interference``: rows the model cannot yet
    estimate, e.g. before the device type's curve or the link's comm fit, give none).
    ``fb``: the runs' forward + backward seconds per step (:func:`profiles`).

    One extreme row never freezes the model: an individual fit that raises or is not
    finite — one device type's compute curve (then insufficient_data with the reason),
    one link's op / sync / resume / refill term, one device type's interference
    coefficient of a mode — is left out with a warning naming it, and the rest is
    published (``ModelKeeper`` refuses a snapshot that is not finite JSON whole)."""
    ps = profiles(runs, fb)
    lg = log.get(component="estimator.models")
    compute, points = {}, {}
    for dev in sorted({p.device_type for p in ps}):
        mine = [p for p in ps if p.device_type == dev]
        curve = [p for p in mine if not profiled(p.module)]  # the gpt stages the curve describes
        try:  # one device type's failed fit must not block the others (nor every later refit)
            compute[dev] = fit_compute(dev, [p.sample() for p in curve])
        except Exception as e:
            lg.warning("compute fit failed", device_type=dev, profiles=len(mine), error=repr(e))
            compute[dev] = ComputeFit(device_type=dev, n=len(curve), reason=f"compute fit of {dev!r} failed: {e!r}")
        if not _finite(compute[dev].to_dict()):
            lg.warning("compute fit is not finite; left out", device_type=dev, profiles=len(mine))
            compute[dev] = ComputeFit(device_type=dev, n=len(curve), reason=f"compute fit of {dev!r} is not finite")
        points[dev] = [p.point() for p in mine]
    comm = {}
    for link in sorted({r["link"] for r in comm_rows}):
        f = _fit_link(link, [r for r in comm_rows if r["link"] == link], lg)
        if f.ops:
            comm[link] = f
    inter, refs = {}, {}
    for dev in sorted({r["device_kind"] for r in colocation_rows}):
        mine = [r for r in colocation_rows if r["device_kind"] == dev]
        try:
            g = fit_interference(mine)
        except Exception as e:
            lg.warning("interference fit failed", device_type=dev, error=repr(e))
            continue
        inter[dev] = _finite_modes(g, dev, "interference", lg)
        ref = interference_ref(mine)
        if ref is not None and g:
            refs[dev] = ref
    model = PerfModel(version=version, compute=compute, comm=comm, interference=inter, interference_ref=refs,
                      profiles=points)
    if rank_rows:
        try:
            gs = fit_rank_interference(model, rank_rows)  # reads each row's mode, candidate, seconds
        except Exception as e:
            lg.warning("rank interference fit failed", rows=len(rank_rows), error=repr(e))
            gs = {}
        for dev, g in gs.items():
            g = _finite_modes(g, dev, "rank interference", lg)
            if g:
                inter[dev] = {**inter.get(dev, {}), **g}
    return model


def _finite_modes(g: dict, dev: str, what: str, lg) -> dict:
    """``g`` (mode -> coefficient) less the modes whose coefficient is not finite, each
    left out with a warning ("<what> fit is not finite; left out") naming it."""
    for mode in [m for m, v in g.items() if not math.isfinite(v)]:
        lg.warning(f"{what} fit is not finite; left out", device_type=dev, mode=mode, g=g.pop(mode))
    return g


def _canonical(model: PerfModel) -> str:
    d = model.to_dict()
    d.pop("version")
    return json.dumps(d, sort_keys=True, allow_nan=False)  # ValueError on NaN/inf: never published


class ModelKeeper:
    """The current model of an estimator: refit on demand, versioned, persisted."""

    def __init__(self, store, state_dir: str | os.PathLike, *, min_refit_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.path = Path(state_dir) / MODEL_NAME
        self.min_refit_interval_s = min_refit_interval_s
        self.clock = clock
        self.log = log.get(component="estimator.models")
        self.model = PerfModel(version=0)
        self.fitted_revision = 0
        self.fitted_at = 0.0
        self.measurements = 0
        self._last_fit = -math.inf
        self._lock = asyncio.Lock()
        if self.path.exists():
            self._load()

    def _load(self) -> None:
        """Load ``model.json``. One that cannot be read (truncated, corrupt, not a
        snapshot) is never a reason not to start: it is moved aside
        (``model.json.corrupt-<ns>``), a warning logged, and the model refitted from the
        measurement log (the source of truth) at the next ``current()``. Its version
        numbering resumes above the highest ``"version": N`` still legible in the file (a
        version number is never reissued with other content); when none is legible it
        restarts from 0 (a controller holding a higher one gets the new snapshot anyway:
        GetModelSnapshot answers ``unchanged`` only for an equal version)."""
        raw = b""
        try:
            raw = self.path.read_bytes()
            d = json.loads(raw)
            model = PerfModel.from_dict(d["snapshot"])
            revision = int(d["revision"])
            fitted_at = float(d.get("fitted_at", 0.0))
            measurements = int(d.get("measurements", 0))
            fit_rev = int(d.get("fit_rev", 1))
        except Exception as e:
            floor = max((int(v) for v in re.findall(rb'"version"\s*:\s*(\d{1,18})', raw)), default=0)
            aside = self.path.with_name(f"{MODEL_NAME}.corrupt-{time.time_ns()}")
            try:
                os.replace(self.path, aside)
            except OSError as m:
                self.log.warning("cannot move the unreadable model file aside", path=str(self.path), error=str(m))
            self.model = PerfModel(version=floor)
            self.fitted_revision = -1  # stale: refit from the log
            self.log.warning("model file unreadable; refitting from the measurement log", path=str(self.path),
                             moved_to=str(aside), error=repr(e), resume_after_version=floor)
            return
        self.model = model
        self.fitted_revision, self.fitted_at, self.measurements = revision, fitted_at, measurements
        old = sorted({f.features for f in model.compute.values() if f.features != FEATURES_REV})
        if old or fit_rev != FIT_REV:
            # Fitted under other feature counts or other fitting rules (an upgrade changed
            # them): served until the refit from the log that this forces at the next current().
            self.fitted_revision = -1
            self.log.info("model fitted under other feature counts or fitting rules; refitting from the "
                          "measurement log", version=self.model.version, fitted_features=old, features=FEATURES_REV,
                          fitted_fit_rev=fit_rev, fit_rev=FIT_REV)
            return
        self.log.info("model loaded", version=self.model.version, revision=self.fitted_revision,
                      store_revision=self.store.model_revision)

    @property
    def stale(self) -> bool:
        return self.store.model_revision != self.fitted_revision

    async def current(self) -> PerfModel:
        """The model, refitted first when its inputs changed and the last fit is at
        least ``min_refit_interval_s`` old. Never raises for a refit that cannot be
        published (a snapshot that is not finite JSON, ``model.json`` not writable): the
        last durable model is served and a later call refits again. The model returned is
        never mutated afterwards (a refit publishes a new object), so callers may read it
        from other threads."""
        if self.stale and self.clock() - self._last_fit >= self.min_refit_interval_s:
            async with self._lock:
                if self.stale:
                    await self._refit()
        return self.model

    async def _refit(self) -> None:
        st = self.store
        rev = st.model_revision
        runs = {k: dict(v) for k, v in st.runs.items()}
        fb = {k: dict(v) for k, v in st.run_fb.items()}
        comm, colo, ranks = list(st.comm_rows), list(st.colocation_rows), list(st.rank_rows)
        t0 = time.perf_counter()
        new = await asyncio.to_thread(build_model, runs, comm, colo, self.model.version, fb, ranks)
        self._last_fit = self.clock()
        try:
            changed = _canonical(new) != _canonical(self.model)
        except ValueError as e:  # a NaN/inf in the fit: keep serving the last good model, retry later
            self.log.error("refit produced a snapshot that is not finite JSON; keeping the current model",
                           version=self.model.version, revision=rev, error=str(e))
            return
        model = self.model
        if changed:
            new.version = self.model.version + 1
            model = new
        fitted_at, count = time.time(), st.count
        # Persisted first, published after: a version number is never served before it is
        # durable (a crash in between would reissue it with other content after a restart),
        # and a failed write (disk full, read-only state dir) is logged and leaves the keeper
        # serving the last durable model, stale, so a later refit tries again; it never
        # fails the RPC that asked for the model.
        try:
            await asyncio.to_thread(self._persist, model, rev, fitted_at, count)
        except OSError as e:
            self.log.warning("model not persisted; serving the last durable model, retrying at a later refit",
                             path=str(self.path), version=self.model.version, unpersisted_version=model.version,
                             revision=rev, error=repr(e))
            return
        self.model = model
        self.fitted_revision, self.fitted_at, self.measurements = rev, fitted_at, count
        self.log.info("model refitted", version=self.model.version, changed=changed, revision=rev,
                      profiles=sum(len(v) for v in self.model.profiles.values()),
                      fits={k: v.status for k, v in self.model.compute.items()}, links=sorted(self.model.comm),
                      ms=round((time.perf_counter() - t0) * 1000, 1))

    def _persist(self, model: PerfModel, revision: int, fitted_at: float, measurements: int) -> None:
        blob = json.dumps({"revision": revision, "fitted_at": fitted_at, "fit_rev": FIT_REV,
                           "measurements": measurements, "snapshot": model.to_dict()}, allow_nan=False)
        atomic_write(self.path, lambda f: f.write(blob.encode()))
