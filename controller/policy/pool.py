"""Free-device bookkeeping for one scheduling round (pure, per-round state).

Devices are grouped in *units*: the devices of one type on one node. Each unit sits in
a bucket by its number of free devices, so finding ``n`` units with ``g`` free devices
each (best fit: fullest units first, to keep whole nodes free for large jobs) costs
O(buckets) rather than O(nodes). Devices of running jobs start *soft-held*: they stay
with their job unless a higher-priority job takes them (preemption), which lets one
greedy pass in priority order decide keep, move and preempt together.
"""

from __future__ import annotations

from .types import NodeView, Placement, RunningJob, Shard

Unit = tuple[str, str]  # (node name, gpu type)


class Pool:
    """Whole-device pool over the ready nodes. Not thread-safe; one per round."""

    def __init__(self, nodes: tuple[NodeView, ...]):
        self.free: dict[Unit, list[str]] = {}
        self.size: dict[Unit, int] = {}
        self.soft: dict[Unit, dict[str, str]] = {}      # unit -> device -> holding job
        self.held_by: dict[str, list[tuple[Unit, str]]] = {}
        self.types: dict[str, list[Unit]] = {}
        self.buckets: dict[str, list[dict[Unit, None]]] = {}
        self.total_free: dict[str, int] = {}
        self.device_type: dict[tuple[str, str], str] = {}
        for n in sorted(nodes, key=lambda n: n.name):
            if not n.ready:
                continue
            for d in n.devices:
                u = (n.name, d.model)
                self.free.setdefault(u, []).append(d.device_id)
                self.device_type[(n.name, d.device_id)] = d.model
        for u, devs in self.free.items():
            self.size[u] = len(devs)
            self.soft[u] = {}
            self.types.setdefault(u[1], []).append(u)
        for t, units in self.types.items():
            mx = max(self.size[u] for u in units)
            self.buckets[t] = [dict() for _ in range(mx + 1)]
            for u in units:
                self.buckets[t][len(self.free[u])][u] = None
            self.total_free[t] = sum(len(self.free[u]) for u in units)

    _last: tuple | None = None  # (nodes, pristine pool): rounds over one snapshot share the build

    @classmethod
    def fresh(cls, nodes: tuple[NodeView, ...]) -> "Pool":
        """A pool with every ready device free; reuses the last build for the same
        ``nodes`` object (the structure is copied, the read-only maps are shared)."""
        last = cls._last
        if last is None or last[0] is not nodes:
            last = cls._last = (nodes, cls(nodes))
        src = last[1]
        p = cls.__new__(cls)
        p.free = {u: list(d) for u, d in src.free.items()}
        p.size, p.types, p.device_type = src.size, src.types, src.device_type
        p.soft = {u: {} for u in src.soft}
        p.held_by = {}
        p.buckets = {t: [dict(b) for b in bs] for t, bs in src.buckets.items()}
        p.total_free = dict(src.total_free)
        return p

    # -- bucket upkeep -------------------------------------------------------------
    def _set_free(self, u: Unit, devs: list[str]) -> None:
        t = u[1]
        old = len(self.free[u])
        del self.buckets[t][old][u]
        self.free[u] = devs
        self.buckets[t][len(devs)][u] = None
        self.total_free[t] += len(devs) - old

    def free_count(self, gpu_type: str) -> int:
        return self.total_free.get(gpu_type, 0)

    def capacity(self, gpu_type: str) -> int:
        return sum(self.size[u] for u in self.types.get(gpu_type, ()))

    def has_unit(self, node: str, gpu_type: str) -> bool:
        return (node, gpu_type) in self.free

    # -- soft holds of running jobs --------------------------------------------------
    def hold(self, job_id: str, placement: Placement) -> bool:
        """Soft-hold a running job's devices; False when some are gone (node not ready)."""
        got = []
        ok = True
        for s in placement.shards:
            t = self.device_type.get((s.node, s.device_ids[0])) if s.device_ids else None
            u = (s.node, t)
            free = self.free.get(u)
            if free is None:
                ok = False
                continue
            mine = [d for d in s.device_ids if d in free and self.device_type.get((s.node, d)) == t]
            if len(mine) < len(s.device_ids):
                ok = False
            if mine:
                self._set_free(u, [x for x in free if x not in mine])
                soft = self.soft[u]
                for d in mine:
                    soft[d] = job_id
                    got.append((u, d))
        self.held_by[job_id] = got
        return ok

    def intact(self, job_id: str, n_devices: int) -> bool:
        """Whether the job still soft-holds all ``n_devices`` of its devices."""
        got = self.held_by.get(job_id, [])
        return len(got) == n_devices and all(self.soft[u].get(d) == job_id for u, d in got)

    def confirm(self, job_id: str) -> None:
        """The job keeps its soft-held devices (they stop being preemptible this round)."""
        for u, d in self.held_by.pop(job_id, []):
            if self.soft[u].get(d) == job_id:
                del self.soft[u][d]

    def release(self, job_id: str) -> None:
        """Return whatever the job still soft-holds to the free pool."""
        for u, d in self.held_by.pop(job_id, []):
            if self.soft[u].get(d) == job_id:
                del self.soft[u][d]
                self._set_free(u, self.free[u] + [d])

    def give_back(self, shards: tuple[Shard, ...]) -> None:
        """Undo a ``take`` (devices become free again)."""
        for s in shards:
            u = (s.node, self.device_type[(s.node, s.device_ids[0])])
            self._set_free(u, self.free[u] + list(s.device_ids))

    # -- taking devices ------------------------------------------------------------
    def take(self, gpu_type: str, n_nodes: int, per_node: int) -> tuple[Shard, ...] | None:
        """``n_nodes`` units of ``gpu_type`` with ``per_node`` free devices each, best fit."""
        if self.total_free.get(gpu_type, 0) < n_nodes * per_node:
            return None
        buckets = self.buckets[gpu_type]
        chosen: list[Unit] = []
        for k in range(per_node, len(buckets)):
            for u in buckets[k]:
                chosen.append(u)
                if len(chosen) == n_nodes:
                    break
            if len(chosen) == n_nodes:
                break
        if len(chosen) < n_nodes:
            return None
        shards = []
        for u in chosen:
            devs = self.free[u]
            shards.append(Shard(u[0], tuple(devs[:per_node])))
            self._set_free(u, devs[per_node:])
        return tuple(shards)

    def take_exact(self, shards: tuple[Shard, ...]) -> bool:
        """Take exactly these devices if all are free (used to restore a placement)."""
        for s in shards:
            u = (s.node, self.device_type.get((s.node, s.device_ids[0])))
            if u not in self.free or not set(s.device_ids) <= set(self.free[u]):
                return False
        for s in shards:
            u = (s.node, self.device_type[(s.node, s.device_ids[0])])
            self._set_free(u, [d for d in self.free[u] if d not in s.device_ids])
        return True

    def take_preempting(self, gpu_type: str, n_nodes: int, per_node: int,
                        victims_ok) -> tuple[tuple[Shard, ...], set[str]] | None:
        """Like ``take`` but may also use devices soft-held by jobs for which
        ``victims_ok(job_id)`` is true; prefers units needing the fewest victims.
        Returns the shards and the victim jobs, or None. O(units of the type)."""
        scored = []
        for u in self.types.get(gpu_type, ()):
            free = self.free[u]
            if len(free) >= per_node:
                scored.append((0, -len(free), u, list(free[:per_node]), ()))
                continue
            need = per_node - len(free)
            soft = [(d, j) for d, j in self.soft[u].items() if victims_ok(j)]
            if len(soft) < need:
                continue
            # Take devices of as few victims as possible: group by holder.
            by_job: dict[str, list[str]] = {}
            for d, j in soft:
                by_job.setdefault(j, []).append(d)
            picked, jobs = [], []
            for j, ds in sorted(by_job.items(), key=lambda kv: -len(kv[1])):
                picked += ds
                jobs.append(j)
                if len(picked) >= need:
                    break
            scored.append((len(jobs), 0, u, list(free) + picked[:need], tuple(jobs)))
        if len(scored) < n_nodes:
            return None
        scored.sort(key=lambda x: (x[0], x[1]))
        shards, victims = [], set()
        for _, _, u, devs, jobs in scored[:n_nodes]:
            victims.update(jobs)
            for d in devs:
                if d in self.soft[u]:
                    del self.soft[u][d]
            self._set_free(u, [d for d in self.free[u] if d not in devs])
            shards.append(Shard(u[0], tuple(devs)))
        return tuple(shards), victims


def running_devices(running: tuple[RunningJob, ...]) -> set[tuple[str, str]]:
    """(node, device) pairs held by running jobs."""
    return {(s.node, d) for r in running for s in r.placement.shards for d in s.device_ids}
