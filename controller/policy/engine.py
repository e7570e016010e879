"""The greedy round shared by Tessera and the baselines: one pass in priority order
over the grid cells of every job, then an expansion pass over idle devices.

Every policy here is a ``Strategy`` (a frozen set of knobs) driven by ``run_round``:
how jobs are ordered (SRPT on estimated remaining time, FIFO, least attained service),
which cells a job may use (requested only, any type, elastic), how cells are ranked,
and whether preemption, expansion and multiplexing are allowed. Keeping one engine makes
the comparison fair: the baselines differ from Tessera only in the decisions, never in
bookkeeping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import multiplex as mx
from .grid import Cell, ClusterShape, GridCache
from .pool import Pool
from .types import (
    Infeasible, JobView, Placement, Plan, Preempt, Resize, RunningJob, ScheduleReply, ScheduleRequest, Shard,
)

INF = float("inf")


@dataclass(frozen=True)
class Strategy:
    """Knobs of a greedy policy. See docs/scheduler.md for what each baseline sets."""

    order: str = "srpt"              # "srpt" | "srpw" (remaining work) | "fifo" | "las"
    cells: str = "elastic"           # "requested" | "any-type" | "elastic"
    rank: str = "balanced"           # "fastest" | "efficient" | "balanced" | "compact"
    beta: float = 0.5                # balanced: minimise iter_time * count**beta
    preempt: bool = False            # may take devices of lower-priority running jobs
    preempt_ratio: float = 0.5       # ... only if the taker's key is below ratio x victim's
    expand: bool = False             # hand idle devices to placed jobs (faster cells)
    expand_factor: float = INF       # expansion cap as a multiple of the requested count
    multiplex: bool = False          # pack fractional / LoRA jobs on shared devices
    shrink_limit: float = 2.0        # elastic: at least requested / shrink_limit devices
    restart_cost_s: float = 60.0     # charged to every move of a running job
    move_gain: float = 0.15          # a move must cut remaining time by this fraction
    wait_bound_s: float = INF        # pending longer than this jumps the queue
    max_preempt_attempts: int = 32   # per round: bounds the O(nodes) preemption scans
    max_members: int = 4             # jobs per shared device
    min_run_s: float = 0.0           # a job placed less than this ago is not preempted (anti-churn)


@dataclass
class _Item:
    job: JobView
    running: RunningJob | None
    cells: tuple[Cell, ...]
    more: tuple[Cell, ...]
    key: tuple = ()
    rem_iters: float = 1.0
    placed: Placement | None = None
    cell: Cell | None = None
    fractional: bool = False
    group: "mx.SharedDevice | None" = None   # a running shared device, ordered as one item
    members: tuple = ()                      # its running members' JobViews


@dataclass
class _Round:
    request: ScheduleRequest
    s: Strategy
    pool: Pool
    shape: ClusterShape
    quotas: dict[str, int]
    used: dict[str, float] = field(default_factory=dict)
    placements: list = field(default_factory=list)
    resizes: list = field(default_factory=list)
    preemptions: list = field(default_factory=list)
    infeasible: list = field(default_factory=list)
    attempts: int = 0


def remaining_iters(job: JobView) -> float:
    """Iterations left (at least 1); an unknown total counts as one iteration."""
    return max(job.iterations - job.done_iterations, 1.0) if job.iterations else 1.0


def requested_cells(job: JobView, shape: ClusterShape) -> tuple[Cell, ...]:
    """Cells with exactly the requested type and count, compact first (no estimator)."""
    out = []
    for t, nodes, per in shape:
        if job.device_kind and t != job.device_kind:
            continue
        for n in range(1, nodes + 1):
            if job.num_devices % n == 0 and job.num_devices // n <= per:
                out.append(Cell(1.0, t, n, job.num_devices // n))
    return tuple(sorted(out, key=lambda c: (c.n_nodes, c.gpu_type)))


def _rank(cells, s: Strategy) -> tuple[Cell, ...]:
    if s.rank == "fastest":
        k = lambda c: (c.iter_time, c.count, c.n_nodes)
    elif s.rank == "efficient":
        k = lambda c: (c.iter_time * c.count, c.iter_time, c.n_nodes)
    elif s.rank == "compact":
        k = lambda c: (c.n_nodes, c.iter_time)
    else:
        k = lambda c: (c.iter_time * c.count ** s.beta, c.iter_time, c.n_nodes)
    return tuple(sorted(cells, key=lambda c: (k(c), c.gpu_type)))


def allowed_cells(job: JobView, grid: tuple[Cell, ...], s: Strategy) -> tuple[tuple[Cell, ...], tuple[Cell, ...]]:
    """(base cells, expansion cells) the strategy lets ``job`` use, unranked.

    A job whose requested count is infeasible (too small to fit in memory) may use the
    smallest feasible count above it, so that no job is left out for a bad request."""
    req = max(job.num_devices, 1)
    if not grid:
        return (), ()
    typed = [c for c in grid if not job.device_kind or c.gpu_type == job.device_kind]
    mode = s.cells if job.elastic else "requested"
    if mode == "requested":
        base = [c for c in typed if c.count == req] or _least_above(typed, req) \
            or [c for c in grid if c.count == req] or _least_above(grid, req)
        return tuple(base), ()
    if mode == "any-type":
        base = [c for c in grid if c.count == req] or _least_above(grid, req)
        return tuple(base), ()
    lo = math.ceil(req / s.shrink_limit)
    base = [c for c in grid if lo <= c.count <= req] or _least_above(grid, req)
    hi = req * s.expand_factor
    more = [c for c in grid if c.count <= hi] if s.expand else []
    return tuple(base), tuple(more)


def _least_above(cells, req: int) -> list[Cell]:
    """Cells with the least count >= req; the largest cells when none is that big."""
    above = [c for c in cells if c.count >= req] or list(cells)
    if not above:
        return []
    if all(c.count < req for c in above):
        m = max(c.count for c in above)
        return [c for c in above if c.count == m]
    m = min(c.count for c in above)
    return [c for c in above if c.count == m]


def _plan(c: Cell) -> Plan:
    return Plan(c.n_nodes, c.gpus_per_node, c.stages, c.iter_time)


def _cell_of(p: Placement, cells: tuple[Cell, ...]) -> Cell | None:
    """The grid cell matching a placement's type and shape, if any."""
    n, g = len(p.shards), max((len(s.device_ids) for s in p.shards), default=0)
    t = p.gpu_type
    for c in cells:
        if c.gpu_type == t and c.n_nodes == n and c.gpus_per_node == g:
            return c
    return None


def resize_kind(old: Placement, new: Placement) -> str:
    """How a move changes a job's resources (for the reply and the logs)."""
    if old.gpu_type and new.gpu_type != old.gpu_type:
        return "type-change"
    if new.num_devices < old.num_devices:
        return "shrink"
    if new.num_devices > old.num_devices:
        return "expand"
    return "migrate"


def run_round(request: ScheduleRequest, s: Strategy, cache: GridCache) -> ScheduleReply:
    """One scheduling round. Deterministic: depends only on ``request`` and ``s``."""
    shape = cache.shape(request.nodes)
    pool = Pool.fresh(request.nodes)
    rd = _Round(request, s, pool, shape, {t: q for t, q in request.tenant_quotas if q > 0})
    est = request.estimator

    knows = getattr(est, "knows", None)

    def grid_of(job: JobView) -> tuple[Cell, ...]:
        # No estimator, or one that cannot estimate this job's requested shape (too
        # little data): the requested shapes only, as asked.
        if est is None or (knows is not None and not knows(job.model)):
            return requested_cells(job, shape)
        return cache.get(est, job.model, shape)

    # A shared device of running fractional jobs is one item: soft-held under its group
    # id, ordered by its most urgent member, and preempted as a whole when a job with
    # much less remaining work needs the device.
    shared = mx.shared_from_running(request.running, pool.device_type) if s.multiplex else {}
    # Repartition before packing, so new jobs are packed against the quotas that will hold.
    repartitions = []
    if s.multiplex:
        jobs = {r.job.job_id: r.job for r in request.running}
        caps = {(n.name, d.device_id): d.capacity for n in request.nodes for d in n.devices}
        for g in request.groups:
            a = mx.repartition_action(g, jobs, s.restart_cost_s,
                                      capacity=caps.get((g.node, g.device_ids[0]), 0) if g.device_ids else 0)
            if a is None:
                continue
            repartitions.append(a)
            sd = shared.get((g.node, g.device_ids[0])) if g.device_ids else None
            if sd is not None:
                sd.members.update({j: q for j, q in a.quotas if j in sd.members})
    shared_list = list(shared.values())
    in_shared = {j for sd in shared_list for j in sd.members}
    run_by_id = {r.job.job_id: r for r in request.running}
    items: list[_Item] = []
    for sd in shared_list:
        pool.hold(sd.group_id, Placement(sd.group_id, (Shard(sd.node, (sd.device,)),)))
        sd.confirmed = False
        members = tuple(run_by_id[j].job for j in sorted(sd.members) if j in run_by_id)
        gj = JobView(sd.group_id, submit_time=min((m.submit_time for m in members), default=0.0))
        gi = _Item(gj, run_by_id[members[0].job_id] if members else None, (), (), group=sd, members=members)
        items.append(gi)
    for r in request.running:
        if r.job.job_id in in_shared:
            continue
        pool.hold(r.job.job_id, r.placement)
        items.append(_make_item(r.job, r, grid_of(r.job), s, cache.memo))
    for j in request.pending:
        items.append(_make_item(j, None, grid_of(j), s, cache.memo))
    for it in items:
        it.key = _group_key(it, s, request.now, grid_of) if it.group is not None else _key(it, s, request.now)
    items.sort(key=lambda it: it.key)
    # Jobs that may still lose devices this round: lower priority (processed later) and
    # placed at least ``min_run_s`` ago (a fresh placement is not undone at once).
    running_left = {it.job.job_id for it in items
                    if it.running and request.now - it.running.since >= s.min_run_s}

    # Every running job counts against its tenant's quota from the start of the round (not
    # only at its turn, or a pending job of the tenant ordered earlier could exceed the
    # cap); released when the job is preempted, re-charged at its new size when moved.
    for it in items:
        if it.group is not None:
            for m in it.members:
                _charge(rd, m, it.group.members.get(m.job_id, 0.0))
        elif it.running:
            _charge(rd, it.job, it.running.placement.num_devices)

    touched: dict[str, mx.SharedDevice] = {}
    for it in items:
        if it.group is not None:
            running_left.discard(it.job.job_id)
            _handle_group(rd, it, shared_list)
        elif it.running:
            running_left.discard(it.job.job_id)
            _handle_running(rd, it)
        elif it.fractional:
            _handle_fractional(rd, it, shared_list, touched, running_left)
        else:
            _handle_pending(rd, it, running_left)

    if s.expand and any(pool.total_free.values()):
        _expand(rd, items)

    for it in items:
        if it.placed is not None and not it.running:
            rd.placements.append(it.placed)

    colocations = [mx.group_of(sd) for sd in touched.values()]
    reshards = []
    if s.multiplex:
        for it in items:
            if it.placed is not None and not it.running:
                g = mx.module_group(it.job, it.placed)
                if g:
                    colocations.append(g)
        for r in request.running:
            a = mx.reshard_action(r, s.restart_cost_s / 2)
            if a:
                reshards.append(a)
    placed = {p.job_id for p in rd.placements}
    starving = tuple(sorted(j.job_id for j in request.pending
                            if j.job_id not in placed and request.now - j.submit_time > s.wait_bound_s))
    return ScheduleReply(
        placements=tuple(rd.placements), infeasible=tuple(rd.infeasible), resizes=tuple(rd.resizes),
        preemptions=tuple(rd.preemptions), colocations=tuple(colocations), reshards=tuple(reshards),
        repartitions=tuple(repartitions), starving=starving)


def _make_item(job: JobView, r: RunningJob | None, grid, s: Strategy, memo: dict) -> _Item:
    """The job's ranked base cells and expansion cells (memoised per grid and request)."""
    if s.multiplex and job.gpu_fraction < 1.0 and job.num_devices <= 1:
        single = tuple(c for c in grid if c.count == 1)
        return _Item(job, r, single, (), rem_iters=remaining_iters(job), fractional=True)
    k = (id(grid), job.num_devices, job.device_kind, job.elastic)
    got = memo.get(k)
    if got is None or got[0] is not grid:
        base, more = allowed_cells(job, grid, s)
        got = memo[k] = (grid, _rank(base, s), more)
    return _Item(job, r, got[1], got[2], rem_iters=remaining_iters(job))


def _key(it: _Item, s: Strategy, now: float) -> tuple:
    j = it.job
    best_t = min((c.iter_time for c in it.cells), default=INF)
    # Past the waiting bound a job is served (and, once running, kept) in arrival order;
    # running jobs stay in the tier too, or starving jobs would preempt each other in turn.
    starving = now - j.submit_time > s.wait_bound_s
    if s.order == "fifo":
        return (0, 0.0, j.submit_time, j.job_id)
    if s.order == "las":
        v = j.done_iterations * (best_t if best_t < INF else 1.0) * max(j.num_devices, 1)
    elif s.order == "srpw" and it.cells:
        c = it.cells[0]  # the preferred cell: remaining device-seconds on it
        v = it.rem_iters * c.iter_time * c.count / max(j.weight, 1e-9)
    else:
        v = it.rem_iters * best_t / max(j.weight, 1e-9)
    if it.fractional:
        v *= max(j.gpu_fraction, 0.01)  # a small job's work is its share of the device
    if it.running and s.preempt:
        v *= s.preempt_ratio
    return (0 if starving else 1, v if not starving else j.submit_time, j.submit_time, j.job_id)


def _group_key(it: _Item, s: Strategy, now: float, grid_of) -> tuple:
    """A shared device is ordered by its most urgent member's remaining work (on one
    device, times its quota), like a running job."""
    vals = []
    for m in it.members:
        t = min((c.iter_time for c in grid_of(m) if c.count == 1), default=1.0)
        vals.append(remaining_iters(m) * t * max(m.gpu_fraction, 0.01) / max(m.weight, 1e-9))
    v = min(vals, default=0.0) * (s.preempt_ratio if s.preempt else 1.0)
    starving = any(now - m.submit_time > s.wait_bound_s for m in it.members)
    return (0 if starving else 1, it.job.submit_time if starving else v, it.job.submit_time, it.job.job_id)


def _handle_group(rd: _Round, it: _Item, shared: list[mx.SharedDevice]) -> None:
    sd = it.group
    if rd.pool.intact(sd.group_id, 1):
        rd.pool.confirm(sd.group_id)
        sd.confirmed = True
        return
    rd.pool.release(sd.group_id)
    shared.remove(sd)
    for m in it.members:
        _charge(rd, m, -sd.members.get(m.job_id, 0.0))
        rd.preemptions.append(Preempt(m.job_id, "shared device taken by a job with much less remaining work"))


def _quota_ok(rd: _Round, job: JobView, amount: float) -> bool:
    cap = rd.quotas.get(job.tenant)
    return cap is None or rd.used.get(job.tenant, 0.0) + amount <= cap + 1e-9


def _charge(rd: _Round, job: JobView, amount: float) -> None:
    rd.used[job.tenant] = rd.used.get(job.tenant, 0.0) + amount


def _try_cells(rd: _Round, it: _Item, cells, victims_ok=None) -> tuple[Cell, tuple[Shard, ...]] | None:
    pool = rd.pool
    for c in cells:
        if not _quota_ok(rd, it.job, c.count):
            continue
        if pool.free_count(c.gpu_type) >= c.count:
            sh = pool.take(c.gpu_type, c.n_nodes, c.gpus_per_node)
            if sh is not None:
                return c, sh
    if victims_ok is None or not rd.s.preempt or rd.attempts >= rd.s.max_preempt_attempts:
        return None
    for c in cells[:2]:  # pruned: preempt only for the job's two preferred cells
        if not _quota_ok(rd, it.job, c.count):
            continue
        rd.attempts += 1
        got = pool.take_preempting(c.gpu_type, c.n_nodes, c.gpus_per_node, victims_ok)
        if got is not None:
            return c, got[0]
    return None


def _placement(it: _Item, c: Cell, shards, why: str) -> Placement:
    return Placement(it.job.job_id, shards, why, gpu_type=c.gpu_type, plan=_plan(c))


def _handle_running(rd: _Round, it: _Item) -> None:
    job, r = it.job, it.running
    if rd.pool.intact(job.job_id, r.placement.num_devices):
        rd.pool.confirm(job.job_id)
        it.placed, it.cell = r.placement, _cell_of(r.placement, it.cells + it.more)
        return
    # Some devices went to a job with higher priority (or its node left): move or stop.
    rd.pool.release(job.job_id)
    _charge(rd, job, -r.placement.num_devices)
    got = _try_cells(rd, it, it.cells)
    if got is None:
        rd.preemptions.append(Preempt(job.job_id, "devices taken by a job with shorter remaining time"))
        return
    c, sh = got
    p = _placement(it, c, sh, f"moved to {c.label()} after preemption of its devices")
    it.placed, it.cell = p, c
    _charge(rd, job, c.count)
    rd.resizes.append(Resize(job.job_id, p, resize_kind(r.placement, p), rd.s.restart_cost_s, p.reason))


def _handle_pending(rd: _Round, it: _Item, running_left: set[str]) -> None:
    job = it.job
    if not it.cells:
        rd.infeasible.append(Infeasible(job.job_id, "no feasible configuration on this cluster "
                                        "(the estimator finds every shape out of memory or unprofiled)"))
        return
    if not any(_quota_ok(rd, job, c.count) for c in it.cells):
        rd.infeasible.append(Infeasible(job.job_id, f"tenant {job.tenant} is at its GPU quota "
                                        f"({rd.used.get(job.tenant, 0):g}/{rd.quotas[job.tenant]})"))
        return
    got = _try_cells(rd, it, it.cells, (lambda j: j in running_left) if job.preempts else None)
    if got is None:
        best = it.cells[0]
        rd.infeasible.append(Infeasible(job.job_id, f"waiting: none of {len(it.cells)} allowed cells is free "
                                        f"(preferred {best.label()}, ~{best.iter_time:.3g} s/iter)"))
        return
    c, sh = got
    req = job.num_devices
    why = f"cell {c.label()} ~{c.iter_time:.3g} s/iter"
    if c.count < req:
        why += f" (shrunk from {req})"
    elif job.device_kind and c.gpu_type != job.device_kind:
        why += f" (type changed from {job.device_kind})"
    it.placed, it.cell = _placement(it, c, sh, why), c
    _charge(rd, job, c.count)


def _handle_fractional(rd: _Round, it: _Item, shared: list[mx.SharedDevice], touched: dict,
                       running_left: set[str]) -> None:
    job = it.job
    if not it.cells:
        rd.infeasible.append(Infeasible(job.job_id, "no single-device configuration fits this job"))
        return
    if not _quota_ok(rd, job, job.gpu_fraction):
        rd.infeasible.append(Infeasible(job.job_id, f"tenant {job.tenant} is at its GPU quota"))
        return
    types = {c.gpu_type for c in it.cells}
    dev = None
    # Alone on a free device the job runs without interference, so it finishes sooner
    # than packed: pack only when no device is free (then packing beats waiting). The
    # new device is opened as a shared one so later jobs can join it under contention.
    # Small jobs are not bound by device speed: open on the type with most free devices.
    for c in sorted(it.cells, key=lambda c: (-rd.pool.free_count(c.gpu_type), c.iter_time)):
        sh = rd.pool.take(c.gpu_type, 1, 1)
        if sh is not None:
            dev = mx.SharedDevice(sh[0].node, sh[0].device_ids[0], c.gpu_type)
            shared.append(dev)
            break
    if dev is None:
        dev = mx.pick_shared(job, [d for d in shared if d.gpu_type in types], rd.s.max_members)
    if dev is None:
        # A running group on the job's backbone is fused into before its own turn (it loses
        # nothing); it is then kept this round: nothing later may preempt it.
        # Only a group that still holds its device: one taken by preemption earlier in the
        # round is gone (the group is preempted at its turn).
        dev = mx.pick_fusable(job, [d for d in shared if d.gpu_type in types and not d.confirmed],
                              rd.s.max_members, intact=lambda d: rd.pool.intact(d.group_id, 1))
        if dev is not None:
            running_left.discard(dev.group_id)
    if dev is None and job.preempts and rd.s.preempt and rd.attempts < rd.s.max_preempt_attempts:
        # Like any job, a small one with much less remaining work may preempt.
        for c in it.cells[:2]:
            rd.attempts += 1
            got = rd.pool.take_preempting(c.gpu_type, 1, 1, lambda j: j in running_left)
            if got is not None:
                sh = got[0]
                dev = mx.SharedDevice(sh[0].node, sh[0].device_ids[0], c.gpu_type)
                shared.append(dev)
                break
    if dev is None:
        rd.infeasible.append(Infeasible(job.job_id, "waiting: no shared device with room and no free device"))
        return
    p = mx.join(job, dev)
    c = next(c for c in it.cells if c.gpu_type == dev.gpu_type)
    it.placed = Placement(p.job_id, p.shards, p.reason, gpu_type=p.gpu_type, plan=_plan(c), quota=p.quota, group=p.group)
    touched[dev.group_id] = dev
    _charge(rd, job, p.quota)


def _expand(rd: _Round, items: list[_Item]) -> None:
    """Give idle devices to placed jobs, in priority order, when a faster cell cuts the
    job's remaining time by ``move_gain`` after paying the restart cost."""
    pool, s = rd.pool, rd.s
    for it in items:
        if not any(pool.total_free.values()):
            return
        if it.placed is None or it.fractional or it.cell is None or not it.more or it.placed.quota < 1:
            continue
        cur = it.cell
        cost = s.restart_cost_s if it.running else 0.0
        cur_rem = it.rem_iters * cur.iter_time
        better = [c for c in it.more if it.rem_iters * c.iter_time + cost < (1 - s.move_gain) * cur_rem]
        if not better:
            continue
        old = it.placed
        pool.give_back(old.shards)
        got = None
        for c in sorted(better, key=lambda c: (c.iter_time, c.count)):
            if c.count > cur.count and not _quota_ok(rd, it.job, c.count - cur.count):
                continue
            if pool.free_count(c.gpu_type) >= c.count:
                sh = pool.take(c.gpu_type, c.n_nodes, c.gpus_per_node)
                if sh is not None:
                    got = (c, sh)
                    break
        if got is None:
            ok = pool.take_exact(old.shards)
            assert ok, "restoring a placement must succeed"
            continue
        c, sh = got
        _charge(rd, it.job, c.count - cur.count)
        p = _placement(it, c, sh, f"expanded on idle devices to {c.label()}: estimated {c.iter_time:.3g} s/iter vs "
                                  f"{cur.iter_time:.3g} on {cur.label()}, {it.rem_iters:.0f} iters left: "
                                  f"~{it.rem_iters * c.iter_time:.0f}s + {cost:g}s restart vs "
                                  f"~{cur_rem:.0f}s staying")
        if it.running:
            # A running job moved in an earlier step of this round already has a resize.
            rd.resizes = [x for x in rd.resizes if x.job_id != it.job.job_id]
            rd.resizes.append(Resize(it.job.job_id, p, resize_kind(it.running.placement, p), cost, p.reason))
        it.placed, it.cell = p, c
