"""Translation between the controller's live state (protobuf records read from etcd) and
the pure policy's value objects, both ways. Pure: no etcd, gRPC calls, clock or I/O, so
it is unit tested on plain messages; ``core.Controller`` does the reads, the fenced
writes and the agent RPCs around it.

- :func:`node_partitions` — a node's partitions (an agent that reported none: one whole
  partition per device).
- :func:`build_request` — nodes (one ``DeviceView`` per partition), pending jobs, and
  running jobs with their placements and quotas -> ``ScheduleRequest``; measured inputs:
  a multimodal job's ``encoder_share`` (``status.encoder_share``, ``controller.measured``),
  a disaggregated one's current split as its placement's ``plan.encoder_ranks``
  (:func:`encoder_ranks_now`), ``groups`` for partitions several running jobs share
  (:func:`groups_of`), and those members' demand from their measured CPU busy fraction
  (``status.busy``, :func:`with_measured_demand`).
- :func:`shards_for` — a policy ``Placement`` -> ``Shard`` messages naming partitions
  and each rank's quota in units (what the etcd allocation and the agents get).
- :func:`replan` — the parallelism plan of a job moved to another device count.
- :func:`quota_units` — a quota in (0, 1] of a partition -> whole units.
- :func:`job_shape` / :func:`device_classes` — what the live estimator
  (``controller.policy.snapshot_estimator``) needs: a ``gpt`` job's model, batch and plan,
  a ``peft`` / ``multimodal`` job's step shape (its policy model key is ``job_key`` of
  that), and per device type the perf model's kind, per-partition quota and memory.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from controller import fusion, measured
from controller.records import is_profile_job
from controller.policy import DeviceView, JobView, NodeView, Placement, RunningJob, ScheduleRequest, Shard
from controller.policy.multiplex import quota_units  # the one rounding rule, policy and carrying-out alike
from controller.policy.types import ColocationGroup, Plan
from controller.policy.snapshot_estimator import DeviceClass, JobShape, job_key, plan_for
from tessera import manifest
from tessera.errors import SpecError
from tessera.quota import partition_quota
from tessera.modelkey import arch_key, shape_key
from tessera.api.v1 import types_pb2

P = types_pb2.JobPhase
ACTIVE = (P.SCHEDULED, P.RUNNING)


def node_partitions(node: types_pb2.Node) -> list[types_pb2.Partition]:
    """The node's partitions; for a node registered without any (an older agent), one
    partition per device holding its whole capacity (id = device id)."""
    if node.partitions:
        return list(node.partitions)
    return [types_pb2.Partition(id=d.id, kind="device", device_id=d.id, capacity_units=max(d.capacity, 1),
                                unit="cores" if d.kind == "cpu" else "sm_percent", memory_bytes=d.memory_bytes)
            for d in node.devices]


def hide_unreleased(nodes: list[types_pb2.Node], holders: dict, reports: dict) -> list[types_pb2.Node]:
    """``nodes`` without the partitions that no allocation holds in etcd but whose agent
    still reported units granted (``free_units`` < capacity at its last report): an
    executor of a stopped or cancelled allocation that has not exited yet. The policy
    must not hand such a partition out (the launch would be refused as busy); it comes
    back with the agent's next report. ``holders``: (node, partition id) -> {allocation:
    units}; ``reports``: node -> {partition id: reported Partition}. A node left with
    no partition is shown not ready. Copies; the inputs are not modified."""
    out = []
    for n in nodes:
        rep = reports.get(n.name, {})
        hide = {p.id for p in node_partitions(n)
                if not holders.get((n.name, p.id)) and p.id in rep and rep[p.id].free_units < p.capacity_units}
        if not hide:
            out.append(n)
            continue
        c = types_pb2.Node()
        c.CopyFrom(n)
        keep = [p for p in node_partitions(n) if p.id not in hide]
        del c.partitions[:]
        c.partitions.extend(keep)
        if not keep:
            c.state = types_pb2.NOT_READY
        out.append(c)
    return out


def device_type(dev: types_pb2.Device) -> str:
    """The policy's device type: "cpu" for every CPU core set (core sets of one machine
    type are interchangeable), the GPU model for GPUs (the grid ranks models)."""
    return "cpu" if dev.kind == "cpu" else (dev.model or "gpu")


def _job_kind(job: types_pb2.Job, types_by_kind: dict[str, set[str]]) -> str:
    """The policy's device_kind for a job: "" (any), or the one type of the asked kind."""
    k = job.spec.resources.device_kind
    if not k:
        return ""
    models = types_by_kind.get(k, set())
    if len(models) == 1:
        return next(iter(models))
    return "" if models else k  # several models of that kind: any; none: a kind nothing matches


def job_shape(job: types_pb2.Job) -> JobShape | None:
    """The perf model's view of a job: for ``gpt`` its module key
    (``tessera.modelkey.arch_key``), global batch, asked plan and device count; for
    ``peft`` / ``multimodal`` its step shape over its devices (``shape_key``, the key its
    profiling job files steps under; ``JobShape.fixed``). None for an incomplete model or
    a spec that does not validate."""
    w = job.spec.workload
    m = w.model
    if w.type in ("peft", "multimodal"):
        return _workload_shape(job.spec.SerializeToString(deterministic=True))
    if w.type != "gpt" or min(m.layers, m.hidden, m.heads, m.vocab, m.seq_len, w.batch_size) <= 0:
        return None
    module = arch_key({"type": "gpt", "model": {"layers": m.layers, "hidden": m.hidden, "heads": m.heads,
                                                "seq_len": m.seq_len, "vocab": m.vocab}})
    p = w.plan
    return JobShape(module, m.layers, m.hidden, m.heads, m.vocab, m.seq_len, w.batch_size, max(p.micro_batches, 1),
                    max(p.tp, 1), max(p.pp, 1), max(job.spec.resources.devices, 1))


@lru_cache(maxsize=4096)
def _workload_shape(spec_bytes: bytes) -> JobShape | None:
    """``job_shape`` of a peft / multimodal spec (memoised on the serialised spec: a job's
    spec never changes, and the shape key validates the manifest, which every policy
    round would otherwise repeat per job)."""
    spec = types_pb2.JobSpec.FromString(spec_bytes)
    try:
        doc = manifest.validate(manifest.from_proto(spec))
    except SpecError:
        return None
    w, md, devices = doc["workload"], doc["workload"]["model"], doc["resources"]["devices"]
    return JobShape(shape_key(w, devices), md["layers"], md["hidden"], md["heads"], md["vocab"], md["seq_len"],
                    w["batch_size"], w["plan"]["micro_batches"], 1, 1, devices, fixed=True)


def model_key(job: types_pb2.Job) -> str:
    """The policy's model key: ``job_key`` of the job's shape (grids and estimates are per
    model, batch and plan; for peft / multimodal per step shape), else the workload type."""
    s = job_shape(job)
    return job_key(s) if s is not None else (job.spec.workload.type or "gpt")


def device_classes(nodes: list[types_pb2.Node]) -> dict[str, DeviceClass]:
    """Per policy device type of the READY nodes: the perf model's kind, the quota of one
    whole partition (``tessera.quota.quota_of``, the rule of the controller's estimates and
    the agent's profiles: cores of the smallest CPU core set; the SM share of the smallest
    GPU partition — an MPS partition's whole GPU, a MIG instance's share of its SMs, a
    time slice's whole device) and the least partition memory (0 = unknown)."""
    out: dict[str, DeviceClass] = {}
    for n in nodes:
        if n.state != types_pb2.READY:
            continue
        devs = {d.id: d for d in n.devices}
        for p in node_partitions(n):
            d = devs.get(p.device_id)
            kind = d.kind if d is not None else "cpu"
            t = device_type(d) if d is not None else "cpu"
            q = partition_quota(kind, d.capacity if d is not None else 0, p, p.capacity_units)
            q = 1.0 if q is None else q  # a partition of an unknown device: all of one
            mem = float(p.memory_bytes or (d.memory_bytes if d else 0))
            cur = out.get(t)
            if cur is None:
                out[t] = DeviceClass(kind, q, mem)
            else:
                m2 = min(cur.memory_bytes, mem) if cur.memory_bytes and mem else (cur.memory_bytes or mem)
                out[t] = DeviceClass(kind, min(cur.quota, q), m2)
    return out


def job_view(job: types_pb2.Job, types_by_kind: dict[str, set[str]]) -> JobView:
    """A job as the policy sees it: its devices, share, total and done steps, its
    model key (``model_key``) and, for peft jobs, its frozen backbone
    (``fusion.backbone_of``: LoRA jobs on one backbone may be fused). A profiling job
    (``records.is_profile_job``) does not preempt (``JobView.preempts``): it runs on free
    devices, never by stopping a running job - the one it profiles least of all."""
    share = job.spec.resources.share
    return JobView(
        job.id, job.spec.tenant or "default", max(job.spec.resources.devices, 1), _job_kind(job, types_by_kind),
        job.created, model=model_key(job), workload=job.spec.workload.type,
        iterations=int(job.status.total_steps or job.spec.workload.steps), done_iterations=float(job.status.step),
        gpu_fraction=share if 0 < share < 1 else 1.0,
        encoder_share=job.status.encoder_share if job.spec.workload.type == "multimodal" else 0.0,
        backbone=fusion.backbone_of(job), preempts=not is_profile_job(job),
    )


def encoder_ranks_now(job: types_pb2.Job, world: int | None = None) -> int:
    """The encoder ranks a running *disaggregated multimodal* job runs with: the split a
    reshard decided (``status.encoder_ranks``), else the spec's pinned
    ``multimodal.disaggregated.encoder_ranks``; 0 when unknown ("auto": the runtime picks
    its own layout) or the job is not disaggregated multimodal. With the job's ``world``
    (ranks it runs on) the value is clamped as the runtime does, to [1, world - 1] (0
    below two ranks): a pinned count of the whole world, or a split decided on more ranks
    than the job holds since being re-placed, is not the split it runs."""
    if job.spec.workload.type != "multimodal":
        return 0
    mm = manifest.from_proto(job.spec)["workload"].get("multimodal", {}) or {}
    if mm.get("mode", "colocated") != "disaggregated":
        return 0
    if job.status.encoder_ranks:
        enc = int(job.status.encoder_ranks)
    else:
        pinned = (mm.get("disaggregated") or {}).get("encoder_ranks", "auto")
        enc = int(pinned) if isinstance(pinned, (int, float)) and not isinstance(pinned, bool) else 0
    if world is None or enc <= 0:
        return max(enc, 0)
    return min(enc, world - 1) if world >= 2 else 0


def groups_of(running: list[RunningJob], kinds: dict[tuple[str, str], str]) -> tuple[ColocationGroup, ...]:
    """Colocation groups of the running jobs: one per partition that several running jobs
    share (each on that one partition at quota < 1), members = (job id, its current quota),
    sorted by job id. ``mode`` is the partition's mechanism: "cpuset" for CPU core sets
    (quotas change live), "mig" / "timeslice" for those partition kinds, else "mps".
    The policy (``multiplex.repartition_action``) compares these quotas with each member's
    demand, ``JobView.gpu_fraction``, which ``build_request`` sets to the measured demand
    (:func:`with_measured_demand`). ``kinds``: (node, partition id) -> partition kind."""
    by_part: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for r in running:
        p = r.placement
        if p.quota < 1.0 and len(p.shards) == 1 and len(p.shards[0].device_ids) == 1:
            key = (p.shards[0].node, p.shards[0].device_ids[0])
            by_part.setdefault(key, []).append((r.job.job_id, p.quota))
    out = []
    for (node, pid), members in sorted(by_part.items()):
        if len(members) < 2:
            continue
        kind = kinds.get((node, pid), "")
        mode = "cpuset" if kind in ("cpu", "cpuset") else (kind if kind in ("mig", "timeslice") else "mps")
        out.append(ColocationGroup(f"share:{node}/{pid}", node, (pid,), tuple(sorted(members)), mode,
                                   f"{len(members)} running jobs share {pid} on {node}"))
    return tuple(out)


def placement_of(job: types_pb2.Job, capacity: dict[tuple[str, str], int], types: dict[tuple[str, str], str]) -> Placement:
    """A running job's placement in the policy's terms (partition ids, quota)."""
    shards, quota, gtype = [], 1.0, ""
    for s in job.status.placement:
        pids = tuple(s.partition_ids) or tuple(s.device_ids)
        shards.append(Shard(s.node, pids))
        for pid in pids:
            cap = capacity.get((s.node, pid), 0)
            gtype = gtype or types.get((s.node, pid), "")
            if cap and s.units and s.units < cap:
                quota = min(quota, s.units / cap)
    group = ""
    if quota < 1.0 and len(shards) == 1 and len(shards[0].device_ids) == 1:
        group = f"share:{shards[0].node}/{shards[0].device_ids[0]}"
    plan = None
    world = sum(len(s.device_ids) for s in shards)
    enc = encoder_ranks_now(job, world)
    if enc:
        # The policy's reshard rule needs the current split and the rank count.
        even = len({len(s.device_ids) for s in shards}) == 1
        plan = Plan(len(shards), len(shards[0].device_ids), encoder_ranks=enc) if even else Plan(1, world, encoder_ranks=enc)
    return Placement(job.id, tuple(shards), job.status.decision, gpu_type=gtype, quota=quota, group=group, plan=plan)


def build_request(nodes: list[types_pb2.Node], jobs: list[types_pb2.Job], now: float,
                  estimator: object | None = None) -> ScheduleRequest:
    """The policy's request: every node with one ``DeviceView`` per partition (only READY
    nodes take placements), pending jobs, and active jobs as running with their quota
    (jobs fused into another's executor are left out: their host stands for them)."""
    nv, capacity, types, by_kind, kinds = [], {}, {}, {}, {}
    for n in nodes:
        devs = {d.id: d for d in n.devices}
        views = []
        for p in node_partitions(n):
            d = devs.get(p.device_id)
            t = device_type(d) if d is not None else "cpu"
            kind = d.kind if d is not None else "cpu"
            views.append(DeviceView(p.id, kind, t, p.memory_bytes or (d.memory_bytes if d else 0), p.capacity_units))
            capacity[(n.name, p.id)] = p.capacity_units
            types[(n.name, p.id)] = t
            kinds[(n.name, p.id)] = "cpu" if kind == "cpu" else p.kind
            if n.state == types_pb2.READY:
                by_kind.setdefault(kind, set()).add(t)
        nv.append(NodeView(n.name, tuple(views), n.state == types_pb2.READY))
    pending = tuple(job_view(j, by_kind) for j in sorted(jobs, key=lambda j: (j.created, j.id))
                    if j.status.phase == P.PENDING)
    running = []
    for j in sorted(jobs, key=lambda j: (j.created, j.id)):
        # A job fused into another's executor (``status.fused_into``) holds no partition
        # units: its work rides on its host's grant, so the policy sees the host only.
        if j.status.phase in ACTIVE and j.status.placement and not j.status.fused_into:
            since = next((h.time for h in reversed(j.status.history) if h.phase == P.SCHEDULED), j.created)
            running.append(RunningJob(job_view(j, by_kind), placement_of(j, capacity, types), since))
    groups = groups_of(running, kinds)
    busy = {j.id: j.status.busy for j in jobs}
    return ScheduleRequest(nodes=tuple(nv), pending=pending, running=with_measured_demand(running, groups, busy),
                           now=now, estimator=estimator, groups=groups)


def with_measured_demand(running: list[RunningJob], groups: tuple[ColocationGroup, ...],
                         busy: dict[str, float]) -> tuple[RunningJob, ...]:
    """``running`` with each colocation-group member's ``JobView.gpu_fraction`` set to its
    measured demand (``controller.measured.group_demands``: busy x current quota when
    ``busy`` — ``JobStatus.busy``, 0 = not measured — says so, else the requested share;
    saturated members take the slack). Jobs outside a group are returned unchanged."""
    want: dict[str, float] = {}
    views = {r.job.job_id: r.job for r in running}
    for g in groups:
        members = {j: (q, busy.get(j, 0.0), views[j].gpu_fraction) for j, q in g.members if j in views}
        for j, d in measured.group_demands(members).items():
            want[j] = min(max(d, 0.01), 1.0)
    return tuple(replace(r, job=replace(r.job, gpu_fraction=want[r.job.job_id])) if r.job.job_id in want else r
                 for r in running)


def shards_for(p: Placement, nodes: dict[str, types_pb2.Node]) -> list[types_pb2.Shard]:
    """Shard messages for a policy placement: partition ids, each rank's device, and the
    quota in units (``p.quota`` of each partition, whole units). ``KeyError`` naming the
    node or partition when the placement does not match ``nodes`` (a bug or a race)."""
    out, rank = [], 0
    for s in p.shards:
        node = nodes[s.node]
        parts = {x.id: x for x in node_partitions(node)}
        missing = [pid for pid in s.device_ids if pid not in parts]
        if missing:
            raise KeyError(f"node {s.node} has no partition {', '.join(missing)}")
        units = {quota_units(p.quota, parts[pid].capacity_units) for pid in s.device_ids}
        # One quota per shard: partitions of a shard share their capacity in practice.
        u = min(units)
        whole = all(u == parts[pid].capacity_units for pid in s.device_ids)
        out.append(types_pb2.Shard(node=s.node, device_ids=[parts[pid].device_id for pid in s.device_ids],
                                   first_rank=rank, partition_ids=list(s.device_ids), units=0 if whole else u))
        rank += len(s.device_ids)
    return out


def shard_units(shards, nodes: dict[str, types_pb2.Node]) -> dict[tuple[str, str], int]:
    """(node, partition id) -> units an allocation of ``shards`` holds there (0 units in a
    shard = the whole partition; a shard without partition ids names devices)."""
    out: dict[tuple[str, str], int] = {}
    for s in shards:
        node = nodes.get(s.node)
        caps = {x.id: x.capacity_units for x in node_partitions(node)} if node is not None else {}
        for pid in (list(s.partition_ids) or list(s.device_ids)):
            u = s.units or caps.get(pid, 1)
            out[(s.node, pid)] = out.get((s.node, pid), 0) + u
    return out


def replan(plan: types_pb2.ParallelPlan, model: types_pb2.ModelConfig, batch_size: int, n: int,
           stages: int = 0) -> types_pb2.ParallelPlan | None:
    """A plan for ``n`` ranks close to ``plan``: keep tensor and pipeline degrees when they
    divide ``n`` (pipeline degree ``stages`` first when the policy named one), else drop
    them; data parallelism takes the rest. None when no candidate fits the model (heads
    divisible by tp, layers >= pp, batch divisible by dp x micro-batches)."""
    got = plan_for(plan.tp, plan.pp, plan.micro_batches, model.heads, model.hidden, model.layers, batch_size, n,
                   stages)
    if got is None:
        return None
    dp, tp, pp, mb = got
    return types_pb2.ParallelPlan(dp=dp, tp=tp, pp=pp, micro_batches=mb)
