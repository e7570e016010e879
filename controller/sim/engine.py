"""Discrete-event, round-based replay of a trace over a cluster, driving a policy.

Ground truth is the measured iteration time of each job's model on the shape it got
(``truth``, a ``TableEstimator`` without error); the policy sees only what its
``estimator`` says (the same tables, or with injected error). Time advances from event
to event (arrival, completion, the policy's round boundary); the policy runs at round
boundaries (``round_s``, Arena uses 300 s) whenever something changed since its last
call, and at least every ``idle_call_rounds`` rounds. Completions happen at their exact
time inside a round; freed devices are reused at the next round boundary.

Overheads (``Overheads``) are charged as time during which a job holds its devices but
makes no progress: first launch, restart from checkpoint (preempted job resumes, resize
on the same nodes), migration (resume on other nodes: + checkpoint transfer), resharding
and repartitioning by relaunch. Progress is checkpointed at every stop (graceful
preemption), so no iterations are lost.

Invariants checked on every decision (``SimError`` when broken): a job is placed only
when pending, moved only when running; every device exists on a ready node; the quotas on
a device never sum above 1; a job finishes exactly once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from controller.policy.estimator import SharingModel
from controller.policy.types import (
    ColocationGroup, JobView, NodeView, Placement, RunningJob, ScheduleReply, ScheduleRequest,
)

from .traces import SimJob

EPS = 1e-9


class SimError(Exception):
    """A policy decision broke an invariant of the cluster (a bug, not a scheduling outcome)."""


@dataclass(frozen=True)
class Overheads:
    """Seconds without progress charged to a job (stated in docs/scheduler.md)."""

    launch_s: float = 30.0      # first start: process, model build, data loader warm-up
    restart_s: float = 60.0     # resume from checkpoint on the same nodes
    migrate_s: float = 90.0     # resume on other nodes: restart + checkpoint transfer
    reshard_s: float = 30.0     # encoder:LLM split change (redistribute module weights)


@dataclass
class _Run:
    placement: Placement
    since: float
    ready_at: float
    rate: float = 0.0           # iterations per second once ready
    base_it: float = 0.0        # ground-truth seconds per iteration, exclusive


@dataclass
class JobRecord:
    """What happened to one job."""

    job_id: str
    submit: float
    first_start: float | None = None
    finish: float | None = None
    done: float = 0.0
    restarts: int = 0
    waited: float = 0.0         # total time pending (first wait and after preemptions)
    pending_since: float | None = None


@dataclass
class SimResult:
    """Per-job records plus time series; ``metrics.summarize`` turns it into numbers."""

    policy: str
    records: dict[str, JobRecord]
    start: float
    end: float
    decision_ms: list[float] = field(default_factory=list)
    throughput: list[tuple[float, float, float, float]] = field(default_factory=list)  # t, dt, busy, norm tput
    total_gpus: int = 0
    max_usage: float = 0.0
    actions: dict[str, int] = field(default_factory=dict)


class Simulator:
    """Replays ``jobs`` on ``nodes`` under ``policy``. One ``run()`` per instance."""

    def __init__(self, nodes: tuple[NodeView, ...], jobs: list[SimJob], truth, policy, estimator=None,
                 round_s: float = 300.0, overheads: Overheads = Overheads(),
                 sharing: SharingModel | None = None, max_time: float | None = None,
                 idle_call_rounds: int = 12, tenant_quotas: tuple[tuple[str, int], ...] = (),
                 weights: dict[str, float] | None = None):
        self.nodes = nodes
        self.jobs = sorted(jobs, key=lambda j: (j.submit, j.job_id))
        self.truth = truth
        self.policy = policy
        self.estimator = estimator if estimator is not None else truth
        self.round_s = round_s
        self.ov = overheads
        self.sharing = sharing or SharingModel()
        self.max_time = max_time
        self.idle_call_rounds = idle_call_rounds
        self.tenant_quotas = tenant_quotas
        self.weights = weights or {}
        self.by_id = {j.job_id: j for j in self.jobs}
        if len(self.by_id) != len(self.jobs):
            raise ValueError("duplicate job ids in trace")
        self.device_type = {(n.name, d.device_id): d.model for n in nodes if n.ready for d in n.devices}
        self.usage: dict[tuple[str, str], float] = {}
        self.running: dict[str, _Run] = {}
        self.pending: dict[str, None] = {}
        self.records = {j.job_id: JobRecord(j.job_id, j.submit) for j in self.jobs}
        self.last_nodes: dict[str, frozenset[str]] = {}
        self._ref_rate: dict[str, float] = {}

    # -- views for the policy ------------------------------------------------------------
    def _view(self, j: SimJob) -> JobView:
        return JobView(j.job_id, j.tenant, j.num_gpu, j.gpu_type, j.submit, self.weights.get(j.tenant, 1.0),
                       j.model, j.workload, iterations=j.iterations,
                       done_iterations=float(int(self.records[j.job_id].done)),
                       gpu_fraction=j.gpu_fraction, backbone=j.backbone, encoder_share=j.encoder_share)

    def _groups(self) -> tuple[ColocationGroup, ...]:
        by: dict[str, list] = {}
        for jid, r in self.running.items():
            if r.placement.group:
                by.setdefault(r.placement.group, []).append((jid, r.placement.quota))
        out = []
        for g, members in sorted(by.items()):
            first = next(self.running[j].placement for j, _ in members)
            bbs = {self.by_id[j].backbone for j, _ in members}
            mode = "fused-spatial" if len(members) > 1 and len(bbs) == 1 and "" not in bbs else "mps"
            out.append(ColocationGroup(g, first.shards[0].node, first.shards[0].device_ids, tuple(sorted(members)), mode))
        return tuple(out)

    def request(self, now: float) -> ScheduleRequest:
        """The snapshot the policy sees at ``now``."""
        return ScheduleRequest(
            nodes=self.nodes,
            pending=tuple(self._view(self.by_id[j]) for j in self.pending),
            running=tuple(RunningJob(self._view(self.by_id[j]), r.placement, r.since) for j, r in self.running.items()),
            now=now, estimator=self.estimator, tenant_quotas=self.tenant_quotas, groups=self._groups())

    # -- device accounting ------------------------------------------------------------------
    def _acquire(self, p: Placement) -> None:
        for s in p.shards:
            for d in s.device_ids:
                k = (s.node, d)
                if k not in self.device_type:
                    raise SimError(f"{p.job_id}: device {k} does not exist on a ready node")
                u = self.usage.get(k, 0.0) + p.quota
                if u > 1.0 + 1e-6:
                    raise SimError(f"{p.job_id}: device {k} over-allocated ({u:.3f})")
                self.usage[k] = u

    def _release(self, p: Placement) -> None:
        for s in p.shards:
            for d in s.device_ids:
                k = (s.node, d)
                self.usage[k] = self.usage.get(k, 0.0) - p.quota
                if self.usage[k] < 1e-6:
                    del self.usage[k]

    def _truth_time(self, j: SimJob, p: Placement) -> float:
        sh = p.shards
        t = self.device_type[(sh[0].node, sh[0].device_ids[0])]
        if any(self.device_type[(s.node, d)] != t for s in sh for d in s.device_ids):
            raise SimError(f"{j.job_id}: placement mixes device types")
        it = self.truth.iter_time(j.model, t, len(sh), max(len(s.device_ids) for s in sh))
        if it is None:
            raise SimError(f"{j.job_id}: {t}:{len(sh)}x{max(len(s.device_ids) for s in sh)} infeasible for {j.model}")
        return it

    def _rates(self) -> None:
        """Recompute every running job's rate (sharing changes the others' speed)."""
        members: dict[tuple[str, str], list[str]] = {}
        for jid, r in self.running.items():
            if r.placement.quota < 1.0:
                s = r.placement.shards[0]
                members.setdefault((s.node, s.device_ids[0]), []).append(jid)
        for jid, r in self.running.items():
            j = self.by_id[jid]
            if not r.base_it:
                r.base_it = self._truth_time(j, r.placement)
            it = r.base_it
            if r.placement.quota < 1.0:
                s = r.placement.shards[0]
                ms = members[(s.node, s.device_ids[0])]
                bbs = {self.by_id[m].backbone for m in ms}
                fused = len(ms) > 1 and len(bbs) == 1 and "" not in bbs
                it *= self.sharing.colocation_slowdown(len(ms), fused)
                if not fused and r.placement.quota + EPS < j.gpu_fraction:
                    it *= j.gpu_fraction / r.placement.quota  # starved of its demand
            r.rate = 1.0 / it

    # -- applying a reply -------------------------------------------------------------------
    def _nodes_of(self, p: Placement) -> frozenset[str]:
        return frozenset(s.node for s in p.shards)

    def _start(self, jid: str, p: Placement, now: float) -> None:
        rec = self.records[jid]
        if rec.first_start is None:
            rec.first_start = now
            cost = self.ov.launch_s
        else:
            rec.restarts += 1
            cost = self.ov.restart_s if self.last_nodes.get(jid) == self._nodes_of(p) else self.ov.migrate_s
        if rec.pending_since is not None:
            rec.waited += now - rec.pending_since
            rec.pending_since = None
        self._acquire(p)
        self.running[jid] = _Run(p, now, now + cost)
        self.last_nodes[jid] = self._nodes_of(p)

    def apply(self, reply: ScheduleReply, now: float, count: dict[str, int]) -> None:
        """Carry out a reply at time ``now``; raises ``SimError`` on an invalid decision."""
        for a in reply.preemptions:
            r = self.running.pop(a.job_id, None)
            if r is None:
                raise SimError(f"preempt of {a.job_id}, which is not running")
            self._release(r.placement)
            self.pending[a.job_id] = None
            self.records[a.job_id].pending_since = now
            count["preempt"] = count.get("preempt", 0) + 1
        moves = []
        for a in reply.resizes:
            r = self.running.pop(a.job_id, None)
            if r is None:
                raise SimError(f"resize of {a.job_id}, which is not running")
            self._release(r.placement)
            moves.append(a)
        # Quota changes before new placements: the policy packed new jobs against them.
        for a in reply.repartitions:
            # Release every member first: quotas move together, so only the end state
            # must fit (an intermediate sum above 1 is not an over-allocation).
            members = [(jid, q, self.running[jid]) for jid, q in a.quotas if jid in self.running]
            for _, _, r in members:
                self._release(r.placement)
            for jid, q, r in members:
                r.placement = Placement(r.placement.job_id, r.placement.shards, r.placement.reason,
                                        r.placement.gpu_type, r.placement.plan, q, r.placement.group)
                r.base_it = 0.0
                self._acquire(r.placement)
                r.ready_at = max(r.ready_at, now) + a.cost_s
            count["repartition"] = count.get("repartition", 0) + 1
        for a in moves:
            self.records[a.job_id].restarts += 1
            same = self.last_nodes.get(a.job_id) == self._nodes_of(a.placement)
            self._acquire(a.placement)
            self.running[a.job_id] = _Run(a.placement, now, now + (self.ov.restart_s if same else self.ov.migrate_s))
            self.last_nodes[a.job_id] = self._nodes_of(a.placement)
            count[a.kind] = count.get(a.kind, 0) + 1
        for p in reply.placements:
            if p.job_id not in self.pending:
                raise SimError(f"placement of {p.job_id}, which is not pending")
            del self.pending[p.job_id]
            self._start(p.job_id, p, now)
            count["place"] = count.get("place", 0) + 1
            if p.quota < 1.0:
                count["shared"] = count.get("shared", 0) + 1
        for a in reply.reshards:
            r = self.running.get(a.job_id)
            if r is None:
                raise SimError(f"reshard of {a.job_id}, which is not running")
            r.ready_at = max(r.ready_at, now) + self.ov.reshard_s
            count["reshard"] = count.get("reshard", 0) + 1
        self._rates()

    # -- the loop ------------------------------------------------------------------------------
    def _advance(self, now: float, to: float) -> list[str]:
        """Progress every running job from ``now`` to ``to``; returns those that finished."""
        done = []
        for jid, r in self.running.items():
            j = self.by_id[jid]
            rec = self.records[jid]
            begin = max(now, r.ready_at)
            if to <= begin:
                continue
            left = j.iterations - rec.done
            need = left / r.rate
            if begin + need <= to + EPS:
                rec.done = float(j.iterations)
                if rec.finish is not None:
                    raise SimError(f"{jid} finished twice")
                rec.finish = begin + need
                done.append(jid)
            else:
                rec.done += (to - begin) * r.rate
        for jid in done:
            self._release(self.running.pop(jid).placement)
        if done:
            self._rates()
        return done

    def _next_finish(self, now: float) -> float:
        out = math.inf
        for jid, r in self.running.items():
            left = self.by_id[jid].iterations - self.records[jid].done
            out = min(out, max(now, r.ready_at) + left / r.rate)
        return out

    def _norm_tput(self) -> tuple[float, float]:
        busy = sum(self.usage.values())
        tput = 0.0
        for jid, r in self.running.items():
            ref = self._ref(jid)
            if ref:
                tput += r.rate / ref
        return busy, tput

    def _ref(self, jid: str) -> float:
        """Rate of the job on its best measured single-shape config (normaliser)."""
        if jid not in self._ref_rate:
            j = self.by_id[jid]
            best = None
            cfgs = getattr(self.truth, "configs", lambda m: ())(j.model) or ()
            for t, n, g in cfgs:
                it = self.truth.iter_time(j.model, t, n, g)
                if it and (best is None or it < best):
                    best = it
            if best is None:
                best = self.truth.iter_time(j.model, "", 1, 1) or 1.0
            self._ref_rate[jid] = 1.0 / best
        return self._ref_rate[jid]

    def run(self) -> SimResult:
        """Replay the whole trace (or until ``max_time``)."""
        res = SimResult(getattr(self.policy, "name", type(self.policy).__name__), self.records,
                        self.jobs[0].submit if self.jobs else 0.0, 0.0,
                        total_gpus=len(self.device_type))
        if not self.jobs:
            return res
        now = self.jobs[0].submit
        idx, n = 0, len(self.jobs)
        changed, idle = True, 0
        stop = self.max_time if self.max_time is not None else math.inf
        while (idx < n or self.pending or self.running) and now <= stop:
            while idx < n and self.jobs[idx].submit <= now:
                jid = self.jobs[idx].job_id
                self.pending[jid] = None
                self.records[jid].pending_since = self.jobs[idx].submit
                idx += 1
                changed = True
            # Periodic calls only matter while jobs wait (priorities age); otherwise the
            # state the policy sees changes only with events.
            if changed or (idle >= self.idle_call_rounds and self.pending):
                req = self.request(now)
                t0 = time.perf_counter()
                reply = self.policy.schedule(req)
                res.decision_ms.append((time.perf_counter() - t0) * 1e3)
                self.apply(reply, now, res.actions)
                res.max_usage = max(res.max_usage, max(self.usage.values(), default=0.0))
                changed, idle = False, 0
            if idx >= n and not self.running and self.pending and not changed:
                break  # nothing runs, nothing arrives, and the policy placed nothing: stuck
            # Jump to the round boundary of the next event.
            nxt = self.jobs[idx].submit if idx < n else math.inf
            nxt = min(nxt, self._next_finish(now))
            if self.pending:
                nxt = min(nxt, now + max(1, self.idle_call_rounds - idle) * self.round_s)
            if nxt == math.inf:
                break
            k = max(1, math.ceil((nxt - now) / self.round_s - 1e-9))
            to = now + k * self.round_s
            busy, tput = self._norm_tput()
            res.throughput.append((now, to - now, busy, tput))
            if self._advance(now, to):
                changed = True
            idle += k
            now = to
        res.end = max((r.finish for r in self.records.values() if r.finish is not None), default=now)
        return res
