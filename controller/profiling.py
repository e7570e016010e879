"""Profiling jobs and estimates: the controller's side of the performance model.

Each cycle (while leading) for every job of a ``gpt``, ``peft`` or ``multimodal`` workload:

1. its module (``module_of``: ``tessera.modelkey.shape_key``, for ``gpt`` the model's
   ``arch_key``, for the others the model plus a digest of the step's shape) has no
   profile at the estimator (ListProfiles) -> submit a *profiling job* once
   (``profile_doc``): for ``gpt`` the job's model on one device (its per-rank batch,
   ``dp = tp = pp = 1``), for ``peft``/``multimodal`` the job's own workload,
   ``profile_steps`` steps; a real short run through the agents whose step timings
   reach the estimator via profilerd; the job's ``status.estimate`` says ``profiling``
   and names it (never for a finished job: it keeps the estimate it has, see
   ``Profiling._ended``); a profiling job that FAILED, or SUCCEEDED ``grace_s`` ago
   with no profile arrived (its node's profilerd down or not streaming: the agent's
   reports are best effort), is submitted again, up to ``attempts`` jobs in all, the
   next after ``retry_s * 2**(k-1)`` from the k-th one's failure (at the end of the
   grace for a lost profile) — a transient fault must not leave the module unprofiled
   for good (``attempt_key``); the last of them, or one that was CANCELLED
   (deliberately: never retried), turns that into ``insufficient_data`` naming it
   (``Profiling._settled``); one still PENDING carries its placement decision's reason
   (why it waits) in the estimate's reason;
2. otherwise -> evaluate the cached model snapshot (GetModelSnapshot, polled with
   ``if_newer_than``) *locally* with ``tessera.perfmodel`` for the job's plan and write
   ``status.estimate`` (ok with seconds and confidence, or insufficient_data with the
   reason) when it changed. ``gpt`` estimates compose the fitted curve and the
   communication tables; ``peft``/``multimodal`` ones are the job's step shape measured,
   carried to the job's quota (``tessera.perfmodel.workload``). A placed job is
   estimated beside the executors that share its partition (``partition_load``,
   ``sharing_of``, ``estimate_placed``: colocated, oversubscription, the fitted
   interference, or a reason saying it is not counted).

The controller talks to the estimator only over gRPC; the numbers come from the same
pure code the estimator runs. An unreachable estimator skips the cycle (estimates are
advisory: scheduling never waits for them). Profiling jobs belong to tenant
``PROFILE_TENANT``, are idempotent per (module, per-rank shape, device kind), and never
fuse with other LoRA jobs (controller/fusion.py).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from tessera import grpcserver, log, manifest
from tessera.api.v1 import estimator_pb2, estimator_pb2_grpc, types_pb2
from tessera.modelkey import arch_key, shape_key
from tessera.perfmodel import Candidate, Estimate, PerfModel, interference_mode
from tessera.perfmodel.priors import COLOCATION, confidence
from tessera.quota import partition_quota
from tessera.spec.multimodal import mean_mix

from .adapter import node_partitions
from .core import NotFound, NotLeader
from .records import PROFILE_PREFIX, PROFILE_TENANT, is_profile_job  # noqa: F401 - one definition (fusion too)
from .store import Fenced
from .policy.snapshot_estimator import link_for  # noqa: F401 - one definition for the policy and here

WORKLOADS = ("gpt", "peft", "multimodal")  # the workload types estimated (all the runtime has)
P = types_pb2.JobPhase
TERMINAL = (P.SUCCEEDED, P.FAILED, P.CANCELLED)


def profile_doc(doc: dict, steps: int) -> tuple[dict, str]:
    """(manifest of the profiling job, its idempotency key) for a validated job manifest.

    ``gpt``: the same model and data on one device at the per-rank batch, ``steps``
    steps (the performance model composes the plan). ``peft`` / ``multimodal``: the job's
    own workload on as many devices, ``steps`` steps (every LoRA task ``steps`` steps, so
    all of them are in every profiled step; a modality schedule replaced by its mean over
    the job's run, ``tessera.spec.multimodal.mean_mix``), which files its steps under the
    job's own ``shape_key``. The key is the same for every job of one step shape."""
    w = doc["workload"]
    p = w["plan"]
    dev = doc["resources"].get("device_kind", "")
    if w.get("type", "gpt") == "gpt":
        rows = w["batch_size"] // p["dp"]
        key = json.dumps([arch_key(w), rows, p["micro_batches"], dev], sort_keys=True)
        # The model's compute alone: an input-bound job's wait for its input
        # (``step_delay_s``) is not the model's, and the key leaves it out.
        pw = {k: v for k, v in w.items() if k not in ("peft", "multimodal", "step_delay_s")}
        pw.update(steps=steps, batch_size=rows, checkpoint_every=steps,
                  plan={"dp": 1, "tp": 1, "pp": 1, "micro_batches": p["micro_batches"]})
        devices = 1
    else:
        devices = doc["resources"]["devices"]
        key = json.dumps([shape_key(w, devices), w["batch_size"], p["micro_batches"], dev], sort_keys=True)
        pw = copy.deepcopy(w)
        pw.update(steps=steps, checkpoint_every=steps)
        if pw["type"] == "peft":
            for t in pw["peft"]["tasks"]:
                t["steps"] = steps
        elif pw["type"] == "multimodal":
            img, aud = mean_mix(w["multimodal"]["mix"], w["steps"])
            pw["multimodal"]["mix"] = [{"step": 0, "image_prob": round(img, 4), "audio_prob": round(aud, 4)}]
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return ({"apiVersion": manifest.API_VERSION, "name": PROFILE_PREFIX + digest, "tenant": PROFILE_TENANT,
             "workload": pw, "resources": {"devices": devices, "device_kind": dev}}, PROFILE_PREFIX + digest)


def attempt_key(idem: str, k: int) -> str:
    """The idempotency key (and name) of the k-th profiling job (k >= 1) of the step shape
    whose first one ``profile_doc`` keys ``idem``: ``idem`` itself for the first, then
    ``idem-a<k>`` (a retry after a FAILED one is a new job, never the failed one again)."""
    return idem if k <= 1 else f"{idem}-a{k}"


def module_of(doc: dict) -> str:
    """The module key a validated job manifest's estimates and profiles are filed under
    (``tessera.modelkey.shape_key`` over its devices)."""
    return shape_key(doc["workload"], doc["resources"]["devices"])


def candidate(doc: dict, device_type: str, quota: float, nodes: int,
              plan: types_pb2.ParallelPlan | None = None) -> Candidate:
    """The perfmodel candidate of a validated job manifest on ``device_type``; ``plan``
    (the job's ``status.plan``: the plan the policy chose and the job runs, when it is not
    the spec's) replaces the spec's dp, tp, pp and micro-batches."""
    w, m = doc["workload"], doc["workload"]["model"]
    p = dict(w["plan"])
    if plan is not None and plan.dp:
        p.update(dp=plan.dp, tp=plan.tp or 1, pp=plan.pp or 1, micro_batches=plan.micro_batches or 1)
    # peft / multimodal runtimes take no gpt plan: their step shape (devices included) is the module key
    dp, tp, pp = (p["dp"], p["tp"], p["pp"]) if w.get("type", "gpt") == "gpt" else (1, 1, 1)
    return Candidate(device_type=device_type, layers=m["layers"], hidden=m["hidden"], heads=m["heads"],
                     vocab=m["vocab"], seq_len=m["seq_len"], batch=w["batch_size"], dp=dp, tp=tp, pp=pp,
                     micro_batches=p["micro_batches"], quota=quota, link=link_for(device_type, nodes),
                     module=module_of(doc))


@dataclass(frozen=True)
class Sharing:
    """How a placed job shares its device with other executors (:func:`sharing_of`):
    ``colocated`` executors on its most crowded partition, this job's rank there
    included; ``oversubscription`` the sum of their grants over the partition's capacity
    (time slicing: every executor wants the whole device, so their number); ``where``
    that partition as "node/partition"; ``others`` the other jobs there."""

    colocated: int = 1
    oversubscription: float = 1.0
    where: str = ""
    others: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        """The colocation mode the model prices it with for one-rank jobs: "shared" when the
        grants oversubscribe the device (time slicing), else "split"."""
        return "shared" if self.oversubscription > 1 else "split"


ALONE = Sharing()


def _timesliced(part: types_pb2.Partition) -> bool:
    return part.kind == "timeslice" or part.unit == "slots"


def partition_load(jobs: list[types_pb2.Job], nodes: dict) -> dict[tuple[str, str], tuple[int, int, tuple[str, ...]]]:
    """(node, partition id) -> (executors, units granted, job ids) over every rank of every
    SCHEDULED or RUNNING job, except jobs fused into another's executor (they run inside
    it). A rank granted no units holds the whole partition (its capacity; 0 for one the
    node does not report). Pure; computed once per profiling cycle."""
    caps = {(name, p.id): p.capacity_units for name, n in nodes.items() for p in node_partitions(n)}
    load: dict[tuple[str, str], tuple[int, int, tuple[str, ...]]] = {}
    for j in jobs:
        if j.status.phase not in (P.SCHEDULED, P.RUNNING) or j.status.fused_into:
            continue
        for s in j.status.placement:
            for pid in (list(s.partition_ids) or list(s.device_ids)):
                n, units, ids = load.get((s.node, pid), (0, 0, ()))
                load[(s.node, pid)] = (n + 1, units + (s.units or caps.get((s.node, pid), 0)),
                                       ids if j.id in ids else ids + (j.id,))
    return load


def sharing_of(job: types_pb2.Job, load: dict, nodes: dict) -> Sharing:
    """Who shares ``job``'s partitions while it is SCHEDULED or RUNNING, from
    :func:`partition_load` ``load``: every executor (rank) placed on the same (node,
    partition id) — ``job``'s own other ranks there too (a multi-rank plan on one CPU core
    set is its ranks sharing it). Over ``job``'s partitions the most crowded one counts
    (the slowest rank sets the step). ``oversubscription``: the units granted there over
    the partition's capacity (1.0 for a partition the node does not report), or on a
    time-sliced one (kind "timeslice", unit "slots") the number of executors. ``ALONE``
    for a job not placed or alone everywhere. Pure."""
    if job.status.phase not in (P.SCHEDULED, P.RUNNING) or job.status.fused_into or not job.status.placement:
        return ALONE
    best = ALONE
    for s in job.status.placement:
        for pid in (list(s.partition_ids) or list(s.device_ids)):
            n, units, ids = load.get((s.node, pid), (1, 0, (job.id,)))
            if n <= best.colocated:
                continue
            node = nodes.get(s.node)
            part = next((p for p in node_partitions(node) if p.id == pid), None) if node is not None else None
            if part is not None and _timesliced(part):
                over = float(n)
            else:
                over = units / part.capacity_units if part is not None and part.capacity_units else 1.0
            best = Sharing(n, over, f"{s.node}/{pid}", tuple(sorted(set(ids) - {job.id})))
    return best


def estimate_placed(model: PerfModel, c: Candidate, share: Sharing) -> Estimate:
    """The estimate of candidate ``c`` where it runs, sharing its device as ``share`` says:
    alone, the model's estimate of ``c``; shared, the model's estimate with ``colocated``
    and ``oversubscription`` set (the device type's fitted interference for the mode,
    :func:`tessera.perfmodel.interference_mode`), its reason naming the partition and the
    jobs beside it. Where only the estimate alone can be made (the model has no
    colocation profile of that mode, or answers from a measured profile that cannot price
    it), the estimate alone stretched by the oversubscription (time slicing: each executor
    gets 1/n of the device), its uncertainty widened by the colocation prior, and its
    reason saying that interference is not counted and why — an estimate that ignored
    the neighbours without saying so would read as a model error. Where not even that,
    the shared candidate's insufficient_data. Pure."""
    if share.colocated <= 1:
        return model.estimate(c)
    others = (f"{len(share.others)} other job{'s' if len(share.others) != 1 else ''} "
              f"({', '.join(share.others[:3])}{', ...' if len(share.others) > 3 else ''})"
              if share.others else "its own ranks")
    where = (f"shares {share.where} with {others}: {share.colocated} executors, "
             f"oversubscription {share.oversubscription:.2g}")
    shared = replace(c, colocated=share.colocated, oversubscription=share.oversubscription)
    fitted = model.interference.get(c.device_type, {})
    mode = interference_mode(shared, fitted)
    e = model.estimate(shared)
    if e.ok:
        g = f" (g {fitted[mode]:.2f} per neighbour)" if mode in fitted else ""
        return replace(e, reason=f"{where}; {mode} interference counted{g}" + (f"; {e.reason}" if e.reason else ""))
    alone = model.estimate(c)
    if not alone.ok:
        return e  # not even alone: the shared candidate's own reason
    # Alone it can be estimated, beside its neighbours not: the device type has no
    # colocation fit of the mode (also behind a measured profile answering without a
    # fitted curve, which prices a fitted mode only); else the model's reason.
    why = e.reason if mode in fitted else f"no colocation ({mode}) profile for device type {c.device_type!r}"
    over = max(share.oversubscription, 1.0)
    r = math.hypot(alone.rel_std, COLOCATION)
    return replace(alone, seconds=alone.seconds * over, rel_std=r, confidence=confidence(r),
                   breakdown={**alone.breakdown, "colocation": over},
                   reason=f"{where}; interference not counted ({why})"
                          + (f", time slicing x{over:g} counted" if over > 1 else "")
                          + (f"; {alone.reason}" if alone.reason else ""))


def to_status(e: Estimate, version: int, now: float, profile_job: str = "") -> types_pb2.JobEstimate:
    if not e.ok:
        return types_pb2.JobEstimate(status=e.status, reason=e.reason, model_version=version,
                                     profile_job_id=profile_job, time=now)
    return types_pb2.JobEstimate(status="ok", step_time_s=e.seconds, rel_std=e.rel_std, confidence=e.confidence,
                                 memory_bytes=e.memory_bytes, reason=e.reason, model_version=version,
                                 profile_job_id=profile_job, time=now)


REWRITE_REL = 0.01  # an ok estimate is rewritten only when it moved by more than this


def _same(a: types_pb2.JobEstimate, b: types_pb2.JobEstimate) -> bool:
    """Whether ``b`` says nothing new over ``a``: the model's version moves with every
    refit (each running job's steps refine its profile), so an ok estimate is kept
    unless its seconds or uncertainty moved materially; one etcd write per job per
    refit would not scale."""
    if (a.status, a.profile_job_id) != (b.status, b.profile_job_id):
        return False
    if a.status != "ok":
        return a.reason == b.reason
    return (abs(a.step_time_s - b.step_time_s) <= REWRITE_REL * max(a.step_time_s, 1e-12)
            and abs(a.rel_std - b.rel_std) <= REWRITE_REL / 2)


class EstimatorLink:
    """gRPC client of the estimator with a cached model snapshot."""

    def __init__(self, address: str, timeout_s: float = 5.0) -> None:
        # the estimator's message limits (EstimateBatch at MAX_BATCH, large snapshots)
        self.channel = grpc.aio.insecure_channel(address, options=grpcserver.LARGE_MESSAGES)
        self.stub = estimator_pb2_grpc.EstimatorServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.model = PerfModel(version=0)

    async def snapshot(self) -> PerfModel:
        """The estimator's current model (fetched only when its version differs from the
        cached one: a lower version, after the estimator lost its state, replaces the cache)."""
        r = await self.stub.GetModelSnapshot(estimator_pb2.GetModelSnapshotRequest(if_newer_than=self.model.version),
                                             timeout=self.timeout_s)
        if not r.unchanged and r.json:
            self.model = PerfModel.from_dict(json.loads(r.json))
        return self.model

    async def profiles(self, module: str) -> list[estimator_pb2.ProfileEntry]:
        r = await self.stub.ListProfiles(estimator_pb2.ListProfilesRequest(module=module), timeout=self.timeout_s)
        return list(r.profiles)

    async def close(self) -> None:
        await self.channel.close()


class Profiling:
    """The profiling/estimate loop over a ``controller.core.Controller`` (see module doc)."""

    def __init__(self, ctl, address: str, *, steps: int = 8, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.time, grace_s: float = 60.0, attempts: int = 3,
                 retry_s: float = 10.0) -> None:
        self.ctl = ctl
        self.link = EstimatorLink(address)
        self.steps = steps
        self.grace_s = grace_s
        self.attempts = attempts
        self.retry_s = retry_s
        self.interval_s = interval_s
        self.clock = clock
        self.log = log.get(component="controller.profiling")

    async def run(self, stop: asyncio.Event) -> None:
        """Run ``once`` every ``interval_s`` while leading, until ``stop``."""
        while not stop.is_set():
            if self.ctl.leading:
                try:
                    await self.once()
                except grpc.aio.AioRpcError as e:
                    self.log.warning("estimator unreachable; estimates not refreshed", code=e.code().name,
                                     error=e.details())
                except Exception:
                    self.log.exception("profiling cycle failed")
            try:
                async with asyncio.timeout(self.interval_s):
                    await stop.wait()
            except TimeoutError:
                pass
        await self.link.close()

    async def once(self) -> dict:
        """One cycle; returns counts {"requested", "estimated"} (profiling jobs submitted,
        estimates written)."""
        t0 = time.perf_counter()
        model = await self.link.snapshot()
        jobs, _ = await self.ctl.store.list_jobs()
        nodes = {v.value.name: v.value for v in await self.ctl.store.list_nodes()}
        by_id = {j.id: j for j in jobs}
        load = partition_load(jobs, nodes)  # who shares which partition: estimates count it
        known: dict[str, list] = {}
        requested = estimated = 0
        for job in jobs:
            if is_profile_job(job) or job.spec.workload.type not in WORKLOADS:
                continue
            try:
                r, e = await self._one(job, model, jobs, nodes, by_id, known, load)
            except (NotLeader, Fenced, grpc.aio.AioRpcError, ConnectionError):
                raise  # the cycle's own conditions (not leader, estimator unreachable): the loop retries
            except Exception:  # one bad job must not stop the estimates of the others
                self.log.exception("profiling cycle skipped a job", job_id=job.id)
                continue
            requested += r
            estimated += e
        if requested or estimated:
            self.log.info("profiling cycle", requested=requested, estimated=estimated, model_version=model.version,
                          ms=round((time.perf_counter() - t0) * 1000, 2))
        return {"requested": requested, "estimated": estimated}

    async def _one(self, job, model, jobs, nodes, by_id, known, load) -> tuple[int, int]:
        """One job of a cycle: (profiling jobs requested, estimates written)."""
        requested = estimated = 0
        cur = job.status.estimate
        if job.status.phase in TERMINAL and cur.status == "ok":
            return 0, 0  # frozen: the estimate it ran with
        doc = manifest.validate(manifest.from_proto(job.spec))
        module = module_of(doc)
        if module not in known:
            known[module] = await self.link.profiles(module)
        profs = known[module]
        pdoc, idem = profile_doc(doc, self.steps)
        rows, mb = pdoc["workload"]["batch_size"], pdoc["workload"]["plan"]["micro_batches"]
        est = None
        if profs:
            dev = self._device_kind(job, doc, nodes, profs, rows, mb)
            quota, n_nodes = self._quota(job, nodes, [p for p in profs if p.device_type == dev] or profs)
            plan = job.status.plan if job.status.HasField("plan") else None
            est = estimate_placed(model, candidate(doc, dev, quota, n_nodes, plan), sharing_of(job, load, nodes))
        if est is not None and (est.ok or any(p.rows == rows and p.micro_batches == mb and p.device_type == dev
                                              for p in profs)):
            pj_id = cur.profile_job_id if cur.profile_job_id in by_id else ""
            estimated += await self._write(job.id, to_status(_at_other_quota(est, profs, dev, rows, mb, quota),
                                                             model.version, self.clock(), pj_id))
            return requested, estimated
        if job.status.phase in TERMINAL:
            return 0, await self._ended(job, by_id)
        # Neither the model nor a profile of this module at this per-rank shape: profile it
        # (the latest of its profiling jobs; after a FAILED one, or one whose profile never
        # arrived, the next attempt).
        keys = {attempt_key(idem, k): k for k in range(1, self.attempts + 1)}
        k, pj = max(((keys[j.idempotency_key], j) for j in jobs
                     if is_profile_job(j) and j.idempotency_key in keys), default=(0, None), key=lambda t: t[0])
        retry_at, gone = None, None  # when the next attempt is due; why the latest brings no profile
        lost = self._settled(pj, module, k) if pj is not None and k < self.attempts else None
        if lost is not None and pj.status.phase != P.CANCELLED:  # a cancelled one is not retried
            backoff = self.retry_s * 2 ** (k - 1)
            if pj.status.phase == P.FAILED:
                retry_at, gone = _ended_at(pj, P.FAILED) + backoff, lost.reason
            else:  # SUCCEEDED, the grace passed and no profile arrived (profilerd down?)
                retry_at = _ended_at(pj, P.SUCCEEDED) + max(self.grace_s, backoff)
                gone = f"{lost.reason} (attempt {k} of {self.attempts})"
        if pj is None or (retry_at is not None and self.clock() >= retry_at):
            k += 1
            pdoc = {**pdoc, "name": attempt_key(pdoc["name"], k)}
            pj, created = await self.ctl.submit(manifest.to_proto(pdoc), attempt_key(idem, k))
            requested += created
            self.log.info("profiling job requested", job_id=job.id, profile_job=pj.id, module=module,
                          rows=rows, micro_batches=mb, attempt=k)
            retry_at = None
        if retry_at is not None:  # brings no profile; the next attempt is due at retry_at
            at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(retry_at))
            new = types_pb2.JobEstimate(status="profiling", profile_job_id=pj.id, time=self.clock(),
                                        reason=f"{gone}; attempt {k + 1} at {at}")
        else:
            new = self._settled(pj, module, k) or types_pb2.JobEstimate(
                status="profiling", profile_job_id=pj.id, time=self.clock(),
                reason=f"no profile of {module} at batch {rows} yet; profiling job {pj.id}" + _waiting(pj))
        estimated += await self._write(job.id, new)
        return requested, estimated

    def _settled(self, pj: types_pb2.Job, module: str, attempt: int = 0) -> types_pb2.JobEstimate | None:
        """``insufficient_data`` naming ``pj`` when it can no longer bring a profile: it
        FAILED (``attempt``, when given, is its number among the module's profiling jobs:
        the reason says it was the last) or was CANCELLED, or it SUCCEEDED at least
        ``grace_s`` ago and its profile still has not reached the estimator (profilerd
        down, not streaming, or its steps dropped); else None (still coming). A profile
        that arrives later still wins: the next cycle finds it and writes the estimate."""
        if pj.status.phase in (P.FAILED, P.CANCELLED):
            last = (f" (attempt {attempt} of {self.attempts}: {pj.status.reason or 'no reason given'})"
                    if attempt and pj.status.phase == P.FAILED else "")
            return types_pb2.JobEstimate(status="insufficient_data", profile_job_id=pj.id, time=self.clock(),
                                         reason=f"profiling job {pj.id} ended {P.Name(pj.status.phase)}{last}")
        if pj.status.phase != P.SUCCEEDED:
            return None
        ended = _ended_at(pj, P.SUCCEEDED)
        if self.clock() - ended < self.grace_s:
            return None
        node = pj.status.placement[0].node if pj.status.placement else "?"
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ended))
        # The reason is stable across cycles (no "N s ago"): it is written once, not every cycle.
        return types_pb2.JobEstimate(
            status="insufficient_data", profile_job_id=pj.id, time=self.clock(),
            reason=f"profiling job {pj.id} succeeded at {at} but no profile of {module} reached the estimator "
                   f"within {self.grace_s:g} s (is profilerd running on node {node} and streaming to the estimator?)")

    async def _ended(self, job: types_pb2.Job, by_id: dict) -> int:
        """A finished job without a usable estimate: never a profiling run on its behalf (it
        will not run again; its record may be about to be removed by retention, and a new
        profiling job would outlive it). Its estimate follows the profiling job it names
        while that is stored; once that is gone (removed), an estimate still saying
        ``profiling`` is marked insufficient_data, else kept. Returns estimates written."""
        cur = job.status.estimate
        if not cur.profile_job_id:
            return 0  # ended before profiling existed: not worth a run now
        pj = by_id.get(cur.profile_job_id)
        if pj is None:
            if cur.status != "profiling":
                return 0
            new = types_pb2.JobEstimate(status="insufficient_data", profile_job_id=cur.profile_job_id,
                                        time=self.clock(),
                                        reason=f"profiling job {cur.profile_job_id} was removed before a profile "
                                               f"arrived; none is requested for a finished job")
        else:
            new = self._settled(pj, module_of(manifest.validate(manifest.from_proto(job.spec)))) \
                or types_pb2.JobEstimate(status="profiling", profile_job_id=pj.id, time=self.clock(),
                                         reason=cur.reason or f"profiling job {pj.id}")
        return await self._write(job.id, new)

    @staticmethod
    def _device_kind(job: types_pb2.Job, doc: dict, nodes: dict, profs: list, rows: int, mb: int) -> str:
        """The device kind a job is estimated on (profiles are filed by kind: ``cpu``,
        ``gpu``): the one its spec asks for; else, placed, the kind of its first device;
        else the kind of a profile at its per-rank shape (``rows``, ``mb``: what its own
        profiling job measured); else the first profile's."""
        kind = doc["resources"].get("device_kind")
        if kind:
            return kind
        if job.status.placement:
            s = job.status.placement[0]
            node = nodes.get(s.node)
            dev = next((d for d in node.devices if s.device_ids and d.id == s.device_ids[0]), None) if node else None
            if dev is not None and dev.kind:
                return dev.kind
        at = next((p for p in profs if p.rows == rows and p.micro_batches == mb), None)
        return (at or profs[0]).device_type

    @staticmethod
    def _quota(job: types_pb2.Job, nodes: dict, profs: list) -> tuple[float, int]:
        """(quota per rank, nodes spanned) of the job where it is placed, else the quota its
        module was profiled at. Placed: its first shard's grant, by the rule the agent
        labels its executors' steps with (``tessera.quota.partition_quota``) — on a core-set
        partition (unit ``cores``) its units over the partition's ``units_per_core``
        (cores; a unit of a core counted twice is half a core), on an MPS one
        (``sm_percent``) its units / 100 of the GPU, on a MIG instance its share of the
        GPU's SMs (attribute ``sm_share``), on any other the device's capacity
        (cores of a CPU, a GPU's percent / 100) times the grant's share of the partition
        (all of it when the placement names no units) — except a time-sliced partition
        (kind "timeslice", unit "slots"), whose executors each run on the whole device:
        its capacity."""
        placement = list(job.status.placement)
        spanned = max(1, len({s.node for s in placement}))
        if placement:
            s = placement[0]
            node = nodes.get(s.node)
            pid = (s.partition_ids or s.device_ids or [""])[0]
            part = next((p for p in node_partitions(node) if p.id == pid), None) if node else None
            dev_id = part.device_id if part is not None else (s.device_ids or [""])[0]
            dev = next((d for d in node.devices if d.id == dev_id), None) if node else None
            units = s.units or (part.capacity_units if part is not None else 0)
            q = partition_quota(dev.kind if dev is not None else "", dev.capacity if dev is not None else 0,
                                part, units)
            if q is not None:
                return q, spanned
        return float(profs[0].quota or 1.0), spanned

    async def _write(self, job_id: str, new: types_pb2.JobEstimate) -> int:
        """Write ``status.estimate`` when it changed (CAS through the controller); 1 if written."""
        wrote = [0]

        def fn(job):
            if _same(job.status.estimate, new):
                return None
            job.status.estimate.CopyFrom(new)
            wrote[0] = 1
            return [], []

        try:
            await self.ctl._rmw(job_id, fn)  # noqa: SLF001 - the controller's fenced read-modify-write
        except NotFound:
            return 0
        return wrote[0]


def _at_other_quota(e: Estimate, profs: list, dev: str, rows: int, mb: int, quota: float) -> Estimate:
    """``e``, its reason saying why a profile of the job's shape did not answer when that
    is the quota: its module was profiled (its profiling job holds a whole partition) at
    other quotas than the job runs at (a job packed with ``resources.share`` < 1), and
    carrying a profile across quotas takes the fitted curve. Unchanged otherwise. Pure."""
    if e.ok:
        return e
    qs = sorted({p.quota for p in profs if p.rows == rows and p.micro_batches == mb and p.device_type == dev})
    if not qs or any(abs(q - quota) < 1e-9 for q in qs):
        return e
    return replace(e, reason=f"{e.reason} (its module was profiled at quota {', '.join(f'{q:g}' for q in qs)}; "
                             f"it runs at {quota:g}, which only the fitted curve can carry it to)")


def _ended_at(job: types_pb2.Job, phase: int) -> float:
    """When ``job`` entered ``phase`` (its history's latest such entry; its creation time
    if the history has none)."""
    return max((h.time for h in job.status.history if h.phase == phase), default=job.created)


def _waiting(pj: types_pb2.Job) -> str:
    """For a PENDING profiling job, why it waits (its placement decision's reason: no
    node of its device kind, a full cluster, ...) as a suffix of the estimate's reason;
    "" otherwise. Stable while the decision is (the estimate is rewritten only then)."""
    d = pj.status.last_decision
    if pj.status.phase == P.PENDING and d.action == "wait" and d.reason:
        return f" (pending: {d.reason})"
    return ""
