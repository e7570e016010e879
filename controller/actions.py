"""Carrying out the policy's reshard and repartition decisions (the decision logic is in
``controller.policy.multiplex``; this module is the I/O around it).

Contracts (each change of a job is one fenced etcd transaction, then agent RPCs):

- ``reshard(ctl, job, rs, nodes, decision_id)``: a running *disaggregated multimodal* job
  gets the encoder:LLM split ``rs.encoder_ranks : rs.llm_ranks`` (their sum must be its
  rank count). One transaction writes ``status.encoder_ranks`` (what ``apply_overrides``
  puts into the runtime spec's ``multimodal.disaggregated.encoder_ranks``) with a new
  allocation on the same partitions and units, the decision and SCHEDULED; then the old
  ranks get SIGTERM (the runtime checkpoints) and the new ones launch and resume from the
  checkpoint under the new split — the resize path, with the same partitions.
- ``repartition(ctl, rp, jobs, nodes, decision_id)``: new quotas inside a colocated group
  (members: running jobs, each on one partition, all the same). Units per member =
  ``adapter.quota_units(quota, capacity)``; members that shrink are changed before those
  that grow, so that each step fits. Per member one transaction writes the new units in
  the job's placement *and* in the partition's allocation record (capacity checked
  there) with the decision. CPU core sets (``cpuset``) then change live: the agent's
  ``UpdateGrant`` re-grants through its ledger and re-pins the running process, which
  is not restarted; an agent refusal (RESOURCE_EXHAUSTED, FAILED_PRECONDITION,
  NOT_FOUND, INVALID_ARGUMENT) writes the old units back with the refusal as the
  decision; any other RPC error leaves the outcome unknown and the records keep
  ``max(old, new)`` (never fewer than the agent may hold). The same write rescales the
  job's measured ``status.busy`` to the new units (``rescale_busy``). Other partition kinds (MPS, MIG, time slices): checkpoint and relaunch with
  the new units, as ``reshard``.

Decisions that do not apply (wrong job type, a rank count that does not add up, members
not on one partition, nothing to change) are logged and skipped: nothing is written.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import grpc

from controller.policy import Repartition, Reshard
from tessera import manifest
from tessera.api.v1 import agent_pb2, types_pb2

from . import adapter, measured
from .records import alloc_keys, decide, transition
from .store import CapacityExceeded, Conflict

P = types_pb2.JobPhase
ACTIVE = (P.SCHEDULED, P.RUNNING)
LIVE_KINDS = ("cpuset",)  # partition kinds whose quotas change in place


def apply_overrides(job: types_pb2.Job, doc: dict) -> None:
    """Put what the controller decided for the current allocation into the runtime spec
    ``doc`` (a validated manifest): the reshard's encoder ranks. Pure."""
    world = sum(len(s.device_ids) for s in job.status.placement)
    # Only while it fits the allocation (a later placement on fewer ranks drops it).
    if job.status.encoder_ranks and job.spec.workload.type == "multimodal" and job.status.encoder_ranks < world:
        mm = doc["workload"].setdefault("multimodal", {})
        mm.setdefault("disaggregated", {})["encoder_ranks"] = int(job.status.encoder_ranks)


def reshard_problem(job: types_pb2.Job, rs: Reshard) -> str:
    """Why ``rs`` cannot be carried out on ``job`` ("" when it can). Pure."""
    if job.spec.workload.type != "multimodal":
        return f"workload type {job.spec.workload.type!r} is not multimodal"
    mode = manifest.from_proto(job.spec)["workload"].get("multimodal", {}).get("mode", "colocated")
    if mode != "disaggregated":
        return f"multimodal mode {mode!r} has no encoder:LLM rank split"
    world = sum(len(s.device_ids) for s in job.status.placement)
    if rs.encoder_ranks < 1 or rs.llm_ranks < 1 or rs.encoder_ranks + rs.llm_ranks != world:
        return f"split {rs.encoder_ranks}:{rs.llm_ranks} does not cover the job's {world} ranks with both sides"
    if job.status.encoder_ranks == rs.encoder_ranks:
        return f"already runs with {rs.encoder_ranks} encoder ranks"
    return ""


async def reshard(ctl, job: types_pb2.Job, rs: Reshard, nodes: dict, decision_id: str) -> bool:
    """See the module docstring. True when the job was relaunched under the new split."""
    why = reshard_problem(job, rs)
    if why or job.status.phase not in ACTIVE:
        ctl.log.info("reshard skipped", job_id=job.id, why=why or "not running", decision_id=decision_id)
        return False
    split = f"{rs.encoder_ranks}:{rs.llm_ranks}"

    def mutate(j: types_pb2.Job) -> None:
        j.status.encoder_ranks = rs.encoder_ranks

    return await relaunch(ctl, job, "reshard", f"{rs.reason or 'reshard'}; encoder:LLM ranks {split}", nodes,
                          decision_id, mutate=mutate)


async def relaunch(ctl, job: types_pb2.Job, action: str, reason: str, nodes: dict, decision_id: str,
                   units: dict[tuple[str, str], int] | None = None,
                   mutate: Callable[[types_pb2.Job], None] | None = None, quota: float | None = None,
                   shards: list[types_pb2.Shard] | None = None, where: str = "") -> bool:
    """Checkpoint and relaunch ``job``: one fenced transaction moves it to a new
    allocation — on ``shards`` when given (a resize / migrate), else on its current
    partitions with ``units`` overriding the units per (node, partition id) — applies
    ``mutate`` (e.g. a new plan or encoder:LLM split) and records the decision; then
    SIGTERM to the old ranks and a launch of the new ones, which resume from the
    checkpoint. ``where`` is appended to the history line. The measured ``status.busy``
    follows the units in the same write (:func:`busy_to_units`). Returns False when nothing
    was moved (the job changed meanwhile, the partitions are full, or too many
    concurrent writers) or the launch failed (the job is then requeued by
    ``ctl._launch_or_requeue``)."""
    now = ctl.clock()
    old_alloc, old_shards = job.status.allocation_id, list(job.status.placement)
    if shards is None:
        shards = []
        for s in old_shards:
            n = types_pb2.Shard()
            n.CopyFrom(s)
            for pid in s.partition_ids:
                if units and (s.node, pid) in units:
                    n.units = units[(s.node, pid)]
            shards.append(n)
    alloc_id = "a-" + secrets.token_hex(6)
    want = adapter.shard_units(shards, nodes)
    caps = ctl._capacity(nodes)
    q = quota if quota is not None else job.status.last_decision.quota or 1.0

    async def fn(j):
        if j.status.allocation_id != old_alloc or j.status.phase not in ACTIVE:
            return None
        try:
            cmp, ops = await ctl.store.realloc_ops(drop=old_alloc, drop_keys=alloc_keys(j.status.placement),
                                                   add=alloc_id, add_units=want, capacity=caps)
        except CapacityExceeded as e:
            ctl.log.info(f"{action} skipped: partition full", job_id=j.id, error=str(e), decision_id=decision_id)
            return None
        busy_to_units(j, adapter.shard_units(j.status.placement, nodes), want)
        forget_step_times(j)
        del j.status.placement[:]
        j.status.placement.extend(shards)
        j.status.allocation_id = alloc_id
        j.status.attempts += 1
        j.status.preemptions += 1
        if mutate is not None:
            mutate(j)
        decide(j, ctl.policy.name, action, f"{reason}; checkpoint and relaunch", now, decision_id, q)
        transition(j, P.SCHEDULED, f"{action}: checkpoint and relaunch{where} ({reason})"[:500], now)
        return cmp, ops

    try:
        job = await ctl._rmw(job.id, fn)
    except Conflict:
        ctl.log.info(f"{action} skipped: too many concurrent updates", job_id=job.id, decision_id=decision_id)
        return False
    if job.status.allocation_id != alloc_id:
        return False
    ctl.log.info(f"job {action} by relaunch", job_id=job.id, allocation=alloc_id, old_allocation=old_alloc,
                 reason=reason, decision_id=decision_id)
    # The old ranks checkpoint on SIGTERM and release their grants before the new ones start.
    await ctl._stop_alloc(old_alloc, old_shards, f"{action}: checkpoint for a relaunch")
    return await ctl._launch_or_requeue(job, nodes, f"relaunch after {action}")


def repartition_plan(rp: Repartition, jobs: dict[str, types_pb2.Job], nodes: dict
                     ) -> tuple[str, list[tuple[str, int, int]], types_pb2.Partition | None, str]:
    """Pure: (problem, [(job id, old units, new units)] shrinks first, the partition, node)
    for ``rp`` over the active ``jobs``; problem is "" when it can be carried out."""
    members = [(jid, q) for jid, q in rp.quotas if jid in jobs and jobs[jid].status.phase in ACTIVE]
    if not members:
        return "no running member", [], None, ""
    where = set()
    for jid, _ in members:
        pl = jobs[jid].status.placement
        if len(pl) != 1 or len(pl[0].partition_ids) != 1:
            return f"member {jid} is not on exactly one partition", [], None, ""
        where.add((pl[0].node, pl[0].partition_ids[0]))
    if len(where) != 1:
        return f"members are on different partitions ({sorted(where)})", [], None, ""
    ((node, pid),) = where
    part = next((p for p in adapter.node_partitions(nodes[node]) if p.id == pid), None) if node in nodes else None
    if part is None:
        return f"partition {pid} on {node} is unknown", [], None, ""
    if not all(0.0 < q <= 1.0 for _, q in members):
        return f"quotas must be in (0, 1]: {members}", [], None, ""
    steps = []
    for jid, q in members:
        old = jobs[jid].status.placement[0].units or part.capacity_units
        new = adapter.quota_units(q, part.capacity_units)
        if new != old:
            steps.append((jid, old, new))
    if not steps:
        return "the quotas already hold", [], part, node
    steps.sort(key=lambda s: s[2] - s[1])  # shrinks first: they free what the grows take
    return "", steps, part, node


async def repartition(ctl, rp: Repartition, jobs: dict[str, types_pb2.Job], nodes: dict, decision_id: str) -> int:
    """See the module docstring. Returns how many members got their new quota."""
    why, steps, part, node = repartition_plan(rp, jobs, nodes)
    if why:
        ctl.log.info("repartition skipped", group=rp.group_id, why=why, decision_id=decision_id)
        return 0
    live = part.kind in LIVE_KINDS
    done = 0
    for jid, old, new in steps:
        reason = f"{rp.reason or 'repartition'}: {part.id} on {node} {old} -> {new} {part.unit}"
        quota = new / part.capacity_units
        if not live:
            # relaunch rescales busy to the new units (busy_to_units)
            ok = await relaunch(ctl, jobs[jid], "repartition", f"{reason} ({part.kind}: not live)", nodes,
                                decision_id, units={(node, part.id): new}, quota=quota)
        else:
            ok = await _repartition_live(ctl, jobs[jid], node, part, old, new, f"{reason}, live", quota, decision_id)
        done += ok
        if not ok and new < old:
            break  # a shrink not done: the grows after it would not fit
    return done


def forget_step_times(job: types_pb2.Job) -> None:
    """The measured step times (``status.step_time_s``, ``step_time_median_s``) describe
    the quota and plan the job ran under; when those change (a relaunch, a live
    repartition, a new placement) they are cleared (0 = none yet), so that ``tessera get``
    never shows the old setup's steps beside the new setup's estimate. The executor's
    next PROGRESS reports measure them again (the agent restarts its window too)."""
    job.status.step_time_s = 0.0
    job.status.step_time_median_s = 0.0


def rescale_busy(job: types_pb2.Job, old: int, new: int) -> None:
    """``status.busy`` is a fraction of the job's *current* quota; when its units change
    from ``old`` to ``new`` it is rescaled to the same amount of work under the new quota,
    ``clamp(busy * old / new, MIN_BUSY, 1)`` (0 = not measured stays 0). Rescaled rather
    than reset: a reset would make the next round fall back to the requested share, and a
    busy kept as is would be multiplied by the new quota (a member that used its cores
    would shrink round after round)."""
    b = job.status.busy
    if b > 0.0 and old > 0 and new > 0 and old != new:
        job.status.busy = min(max(b * old / new, measured.MIN_BUSY), 1.0)


def busy_to_units(job: types_pb2.Job, old: dict[tuple[str, str], int], new: dict[tuple[str, str], int]) -> None:
    """A relaunch moves ``job`` from the units ``old`` to ``new`` ((node, partition id) ->
    units, ``adapter.shard_units``): its ``status.busy`` follows. The same units per
    partition everywhere before and after: :func:`rescale_busy` (same partitions and units:
    unchanged); mixed units per partition on either side (units swapped between
    partitions included): reset to 0 (not measured; the
    next PROGRESS reports measure it under the new quota)."""
    if old == new:
        return
    ov, nv = set(old.values()), set(new.values())
    if len(ov) == 1 and len(nv) == 1:  # uniform on both sides (e.g. more ranks of the same units)
        rescale_busy(job, ov.pop(), nv.pop())
    else:
        job.status.busy = 0.0


# UpdateGrant errors that mean the agent checked the request and changed nothing. Any other
# (DEADLINE_EXCEEDED, UNAVAILABLE, CANCELLED, INTERNAL, ...): the outcome is unknown, the
# agent may have applied it.
REFUSALS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.INVALID_ARGUMENT)


async def _set_units(ctl, job_id: str, alloc_id: str, node: str, part: types_pb2.Partition, new: int,
                     action: str, reason: str, quota: float, decision_id: str, caps: dict) -> bool:
    """One fenced transaction: the job's shard units and the partition's allocation record,
    with ``status.busy`` rescaled to the new units (:func:`rescale_busy`). False (logged)
    when nothing was written: the job changed or is gone, the partition is full, or too
    many concurrent updates."""
    from .core import NotFound  # core imports this module

    now = ctl.clock()
    wrote = [False]

    async def fn(j):
        if j.status.allocation_id != alloc_id or j.status.phase not in ACTIVE:
            return None
        try:
            cmp, ops = await ctl.store.realloc_ops(add=alloc_id, add_units={(node, part.id): new}, capacity=caps)
        except CapacityExceeded as e:
            ctl.log.info("repartition skipped: partition full", job_id=j.id, error=str(e), decision_id=decision_id)
            return None
        rescale_busy(j, j.status.placement[0].units or part.capacity_units, new)
        forget_step_times(j)
        j.status.placement[0].units = new
        decide(j, ctl.policy.name, action, reason, now, decision_id, quota)
        wrote[0] = True
        return cmp, ops

    try:
        await ctl._rmw(job_id, fn)
    except (Conflict, NotFound) as e:
        ctl.log.warning("repartition: units not written", job_id=job_id, units=new, error=str(e),
                        decision_id=decision_id)
        return False
    return wrote[0]


async def _repartition_live(ctl, job: types_pb2.Job, node: str, part: types_pb2.Partition, old: int, new: int,
                            reason: str, quota: float, decision_id: str) -> bool:
    alloc_id = job.status.allocation_id
    caps = {(node, part.id): part.capacity_units}
    if not await _set_units(ctl, job.id, alloc_id, node, part, new, "repartition", reason, quota, decision_id, caps):
        return False
    n = await ctl.store.get_node(node)
    address = n.value.agent_address if n is not None else ""
    rank = job.status.placement[0].first_rank  # one partition id: one rank
    err, code = "", None
    try:
        r = await ctl.agents.stub(address).UpdateGrant(agent_pb2.UpdateGrantRequest(
            allocation_id=alloc_id, rank=rank, units=new, fencing_token=ctl.store.fencing_token or 0), timeout=10)
        ctl.log.info("executor re-pinned", job_id=job.id, allocation=alloc_id, rank=rank, pid=r.pid,
                     cores=list(r.cores), old_units=r.old_units, units=r.units, decision_id=decision_id)
    except grpc.aio.AioRpcError as e:
        code = e.code()
        err = f"{code.name}: {e.details()}"
    if not err:
        return True
    if code in REFUSALS:
        # The agent refused (its own check): the records go back to what the agent holds.
        ctl.log.warning("live repartition refused by the agent", job_id=job.id, error=err, decision_id=decision_id)
        keep, why = old, f"repartition refused by the agent ({err}); keeps {old} {part.unit}"
    else:
        # Unknown outcome: the agent may hold either. The records keep the larger, so that
        # the partition is never under-counted (a grow stays written, a shrink goes back).
        keep = max(old, new)
        ctl.log.warning("live repartition outcome unknown; records keep the larger units", job_id=job.id,
                        error=err, old_units=old, units=new, kept=keep, decision_id=decision_id)
        why = f"repartition outcome unknown ({err}); records keep {keep} {part.unit}"
    if keep != new and not await _set_units(ctl, job.id, alloc_id, node, part, keep, "repartition", why,
                                            keep / part.capacity_units, decision_id, caps):
        ctl.log.error("repartition: could not write the units back; the records may not match the agent",
                      job_id=job.id, allocation=alloc_id, units=new, agent_units=keep, decision_id=decision_id)
    return False
