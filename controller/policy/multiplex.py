"""Multiplexing decisions (pure helpers): shared-device packing, LoRA fusion,
multimodal module colocation, encoder:LLM resharding and quota repartitioning.

The whole-device search in ``engine.py`` calls these for jobs that underuse a device
(``gpu_fraction < 1``) or carry a backbone / modality mix. Quotas are shares of one
device in (0, 1]; the members' quotas on a device never sum above 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .types import ColocationGroup, JobView, Placement, Repartition, Reshard, RunningJob, Shard

# Fused LoRA tasks share one frozen backbone in one executor, so each extra task needs
# only its adapter, optimizer state and activations: its device demand is discounted.
FUSED_DEMAND_DISCOUNT = 0.6
QUOTA_EPS = 1e-9
UNIT_EPS = 1e-6   # tolerance when a share becomes whole units (0.3333 x 6 is 2 units, not 1)


@dataclass
class SharedDevice:
    """One device split by quotas among members (job id -> quota)."""

    node: str
    device: str
    gpu_type: str
    members: dict[str, float] = field(default_factory=dict)
    backbones: dict[str, str] = field(default_factory=dict)
    confirmed: bool = True   # False while a running group may still lose its device this round

    @property
    def group_id(self) -> str:
        return f"share:{self.node}/{self.device}"

    @property
    def used(self) -> float:
        return sum(self.members.values())

    def fused(self) -> bool:
        """All members are LoRA tasks of one backbone (one fused executor)."""
        bbs = set(self.backbones.get(j, "") for j in self.members)
        return len(self.members) > 1 and len(bbs) == 1 and "" not in bbs


def demand(job: JobView, dev: SharedDevice) -> float:
    """Quota ``job`` needs on ``dev``: its fraction, discounted when it fuses with a
    member on the same backbone."""
    f = min(max(job.gpu_fraction, 0.01), 1.0)
    if job.backbone and dev.members and all(dev.backbones.get(j) == job.backbone for j in dev.members):
        return f * FUSED_DEMAND_DISCOUNT
    return f


def pick_shared(job: JobView, devices: list[SharedDevice], max_members: int) -> SharedDevice | None:
    """Best fit: the shared device with the least room left that still takes the job;
    devices whose members share the job's backbone win ties (they fuse)."""
    best, best_key = None, None
    for dev in devices:
        if not dev.confirmed or len(dev.members) >= max_members:
            continue
        q = demand(job, dev)
        room = 1.0 - dev.used - q
        if room < -QUOTA_EPS:
            continue
        same = bool(job.backbone) and all(dev.backbones.get(j) == job.backbone for j in dev.members)
        key = (0 if same else 1, room, dev.node, dev.device)
        if best_key is None or key < best_key:
            best, best_key = dev, key
    return best


def pick_fusable(job: JobView, devices: list[SharedDevice], max_members: int,
                 intact=None) -> SharedDevice | None:
    """A shared device of *running* jobs, all on ``job``'s backbone, that the job can join
    even before the group's own turn in the round (``confirmed`` False): fusing into their
    executor takes nothing from its members, so it beats preempting the group or waiting.
    ``intact(dev)``, when given, says whether the group still holds its device this round
    (a job earlier in the round may have taken it by preemption): only those are offered.
    Best fit by room left; None when the job has no backbone or nothing fits."""
    if not job.backbone:
        return None
    best, best_key = None, None
    for dev in devices:
        if not dev.members or len(dev.members) >= max_members:
            continue
        if intact is not None and not intact(dev):
            continue
        if any(dev.backbones.get(j) != job.backbone for j in dev.members):
            continue
        room = 1.0 - dev.used - demand(job, dev)
        if room < -QUOTA_EPS:
            continue
        key = (room, dev.node, dev.device)
        if best_key is None or key < best_key:
            best, best_key = dev, key
    return best


def join(job: JobView, dev: SharedDevice) -> Placement:
    """Add ``job`` to ``dev`` and return its placement (quota = its demand there)."""
    q = round(demand(job, dev), 9)  # quota_units' tolerance absorbs this rounding
    dev.members[job.job_id] = q
    dev.backbones[job.job_id] = job.backbone
    why = "fused with LoRA tasks on backbone " + job.backbone if dev.fused() else "packed on a shared device"
    return Placement(job.job_id, (Shard(dev.node, (dev.device,)),), why, gpu_type=dev.gpu_type,
                     quota=q, group=dev.group_id)


def group_of(dev: SharedDevice) -> ColocationGroup:
    """The colocation group a shared device forms."""
    mode = "fused-spatial" if dev.fused() else "mps"
    return ColocationGroup(dev.group_id, dev.node, (dev.device,),
                           tuple(sorted(dev.members.items())), mode,
                           f"{len(dev.members)} jobs, quota used {dev.used:.2f}")


def shared_from_running(running: tuple[RunningJob, ...], device_type: dict) -> dict[tuple[str, str], SharedDevice]:
    """Rebuild shared devices from running placements that hold a quota below 1."""
    out: dict[tuple[str, str], SharedDevice] = {}
    for r in running:
        p = r.placement
        if p.quota >= 1.0 or len(p.shards) != 1 or len(p.shards[0].device_ids) != 1:
            continue
        node, dev = p.shards[0].node, p.shards[0].device_ids[0]
        sd = out.get((node, dev))
        if sd is None:
            sd = out[(node, dev)] = SharedDevice(node, dev, device_type.get((node, dev), p.gpu_type))
        sd.members[r.job.job_id] = p.quota
        sd.backbones[r.job.job_id] = r.job.backbone
    return out


def encoder_split(encoder_share: float, ranks: int) -> int:
    """Encoder ranks for a multimodal job: proportional to the encoder's share of step
    time, at least one rank for each side when there are two or more ranks."""
    if ranks < 2:
        return 0
    s = encoder_share if math.isfinite(encoder_share) else 0.0
    return min(ranks - 1, max(1, round(min(max(s, 0.0), 1.0) * ranks)))


def reshard_action(r: RunningJob, cost_s: float, min_gain: float = 0.10) -> Reshard | None:
    """Re-decide a running multimodal job's encoder:LLM split when its measured modality
    mix (``encoder_share``) moved far enough that the slower side gains ``min_gain``.

    The pipeline runs at the pace of its slower side: with e encoder ranks of n, the step
    is ~ max(share / e, (1 - share) / (n - e)). Reshard when the best split beats the
    current one by ``min_gain`` (relative); the restart cost is charged in ``cost_s``.

    None (keep the current split) when the share is not measured (0, or not finite) or
    the current split is not a valid one of the job's ranks (0 < encoder ranks < ranks)."""
    job, plan = r.job, r.placement.plan
    if job.workload != "multimodal" or plan is None:
        return None
    s = job.encoder_share
    if not (math.isfinite(s) and 0.0 < s <= 1.0):
        return None
    n = plan.num_devices
    cur = plan.encoder_ranks
    if n < 2 or not 0 < cur < n:
        return None
    best = encoder_split(s, n)
    if best == cur:
        return None

    def pace(e: int) -> float:
        return max(s / e, (1 - s) / (n - e))

    if pace(best) > (1 - min_gain) * pace(cur):
        return None
    return Reshard(job.job_id, best, n - best, cost_s,
                   f"encoder share {job.encoder_share:.2f}: split {cur}:{n - cur} -> {best}:{n - best}")


def module_group(job: JobView, placement: Placement) -> ColocationGroup | None:
    """A multimodal job on one device runs its encoder and LLM modules colocated, with
    quotas proportional to their measured share of the step (Mosaic-style)."""
    if job.workload != "multimodal" or placement.num_devices != 1:
        return None
    s = job.encoder_share if math.isfinite(job.encoder_share) else 0.0  # not finite: not measured
    s = min(max(s, 0.05), 0.95)
    sh = placement.shards[0]
    return ColocationGroup(f"modules:{job.job_id}", sh.node, sh.device_ids,
                           ((f"{job.job_id}:encoder", round(s, 3)), (f"{job.job_id}:llm", round(1 - s, 3))),
                           "modules", "encoder and LLM colocated with quotas")


def quota_units(quota: float, capacity: int) -> int:
    """Whole units of a partition of ``capacity`` for a share ``quota`` in (0, 1]: rounded
    down (within :data:`UNIT_EPS`, so 0.3333 x 6 is 2), at least 1 — a quota never
    exceeds its share. The controller carries quotas out by this same function
    (``controller.adapter`` re-exports it)."""
    if not math.isfinite(quota) or quota <= 0.0:
        return 1
    if quota >= 1.0 - QUOTA_EPS:
        return capacity
    return max(1, min(capacity, math.floor(quota * capacity + UNIT_EPS)))


def split_units(shares: dict[str, float], capacity: int) -> dict[str, int]:
    """Whole units of ``capacity`` for members' shares (summing to at most 1): each gets
    its share rounded down (within :data:`UNIT_EPS`), at least 1; the units the partition
    gives them in all (their total share, rounded down the same way) that the floors leave
    over go out by largest remainder, so no whole unit is lost to rounding."""
    raw = {j: min(max(q, 0.0), 1.0) * capacity for j, q in shares.items()}
    target = min(capacity, max(len(raw), math.floor(sum(raw.values()) + UNIT_EPS)))
    units = {j: max(1, math.floor(v + UNIT_EPS)) for j, v in raw.items()}
    rem = lambda j: raw[j] - math.floor(raw[j] + UNIT_EPS)
    while sum(units.values()) < target:
        j = max(sorted(units), key=lambda j: (rem(j), raw[j]))
        units[j] += 1
        raw[j] = float(units[j])  # its remainder is spent
    while sum(units.values()) > target:
        over = [j for j in sorted(units) if units[j] > 1]
        if not over:
            break
        j = min(over, key=lambda j: (raw[j] - (units[j] - 1), -units[j]))
        units[j] -= 1
    return units


def repartition_action(group: ColocationGroup, jobs: dict[str, JobView], restart_cost_s: float,
                       threshold: float = 0.10, capacity: int = 0) -> Repartition | None:
    """New quotas for a colocation group from its members' measured demand
    (``gpu_fraction``), scaled down to fit when they sum above 1. Emitted only when some
    quota moves by more than ``threshold``: a repartition by relaunch costs a restart.
    With the device's ``capacity`` in whole units (> 1), also only when some member's
    units (``quota_units``) change: a decision that rounds to the units already held would
    be repeated every round and carried out as nothing."""
    if group.mode == "modules":
        return None
    want = {j: min(max(jobs[j].gpu_fraction, 0.01), 1.0) for j, _ in group.members
            if j in jobs and math.isfinite(jobs[j].gpu_fraction)}
    if not want:
        return None
    if group.mode.startswith("fused"):
        # One backbone copy serves all fused tasks: all but the largest get the discount.
        top = max(sorted(want), key=lambda j: want[j])
        want = {j: (q if j == top else q * FUSED_DEMAND_DISCOUNT) for j, q in want.items()}
    total = sum(want.values())
    scale = 1.0 / total if total > 1.0 else 1.0
    if capacity > 1:
        # Decide in the whole units the quotas are carried out in (``quota_units``).
        new = {j: u / capacity for j, u in split_units({j: q * scale for j, q in want.items()}, capacity).items()}
    else:
        new = {j: round(q * scale, 4) for j, q in want.items()}
    old = dict(group.members)
    if max(abs(new[j] - old.get(j, 0.0)) for j in new) <= threshold:
        return None
    if capacity > 1 and all(quota_units(new[j], capacity) == quota_units(old.get(j, 0.0), capacity) for j in new):
        return None
    live = group.mode == "cpuset"
    return Repartition(group.group_id, tuple(sorted(new.items())), live, 0.0 if live else restart_cost_s,
                       "measured load shifted" + ("" if live else "; checkpoint and relaunch"))
