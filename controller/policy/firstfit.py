"""First-fit of whole devices, in submission order: the foundation's policy."""

from __future__ import annotations

from .types import Infeasible, JobView, Placement, ScheduleReply, ScheduleRequest, Shard


class FirstFit:
    """Places each pending job, oldest first, on the first devices that are free.

    A job goes on one node when one node has enough free matching devices, else it
    spans nodes (ranks in node order). A job that fits nowhere is listed infeasible
    with the reason; it does not block younger jobs (no head-of-line blocking).
    """

    name = "firstfit"

    def schedule(self, request: ScheduleRequest) -> ScheduleReply:
        used: set[tuple[str, str]] = set()
        for r in request.running:
            for s in r.placement.shards:
                used.update((s.node, d) for d in s.device_ids)
        free: dict[str, list[str]] = {}
        kinds: dict[tuple[str, str], str] = {}
        for n in sorted(request.nodes, key=lambda n: n.name):
            if not n.ready:
                continue
            free[n.name] = []
            for d in n.devices:
                kinds[(n.name, d.device_id)] = d.kind
                if (n.name, d.device_id) not in used:
                    free[n.name].append(d.device_id)
        total = {n.name: len(n.devices) for n in request.nodes if n.ready}

        placements: list[Placement] = []
        infeasible: list[Infeasible] = []
        for job in sorted(request.pending, key=lambda j: (j.submit_time, j.job_id)):
            p = _fit(job, free, kinds)
            if p is None:
                infeasible.append(Infeasible(job.job_id, _why(job, free, kinds, total)))
                continue
            for s in p.shards:
                free[s.node] = [d for d in free[s.node] if d not in s.device_ids]
            placements.append(p)
        return ScheduleReply(placements=tuple(placements), infeasible=tuple(infeasible))


def _matching(job: JobView, node: str, devs: list[str], kinds: dict) -> list[str]:
    return [d for d in devs if not job.device_kind or kinds[(node, d)] == job.device_kind]


def _fit(job: JobView, free: dict[str, list[str]], kinds: dict) -> Placement | None:
    for node, devs in free.items():
        m = _matching(job, node, devs, kinds)
        if len(m) >= job.num_devices:
            return Placement(job.job_id, (Shard(node, tuple(m[: job.num_devices])),), "first fit on one node")
    shards, need = [], job.num_devices
    for node, devs in free.items():
        m = _matching(job, node, devs, kinds)[:need]
        if m:
            shards.append(Shard(node, tuple(m)))
            need -= len(m)
        if need == 0:
            return Placement(job.job_id, tuple(shards), f"first fit across {len(shards)} nodes")
    return None


def _why(job: JobView, free: dict, kinds: dict, total: dict) -> str:
    kind = job.device_kind or "any"
    cap = sum(len([1 for (n, d), k in kinds.items() if n == node and (not job.device_kind or k == job.device_kind)]) for node in total)
    if cap < job.num_devices:
        return f"needs {job.num_devices} {kind} devices; the ready nodes have {cap} in all"
    avail = sum(len(_matching(job, n, d, kinds)) for n, d in free.items())
    return f"needs {job.num_devices} {kind} devices; {avail} free now"
