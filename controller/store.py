"""Cluster state in etcd: jobs, nodes, allocations, idempotency keys, rank exits.

Layout under the configurable prefix P (default ``/tessera``)::

    P/leader                      controller id, on the leader's lease
    P/jobs/<job_id>               Job (protobuf bytes)
    P/idem/<tenant>/<key>         job id of an idempotent submission (deleted with the job)
    P/nodes/<name>                Node (protobuf bytes)
    P/allocs/<node>/<partition>   JSON {allocation id: units} of the allocations holding
                                  quotas of the partition (one key per partition, written
                                  with a compare on its mod revision after checking that the
                                  units sum to at most the partition's capacity: a partition
                                  is never allocated beyond capacity at any revision)
    P/exits/<alloc_id>/<rank>     exit code of a rank of an allocation

A finished job is removed ``finished_job_ttl_s`` after it ended (``delete_job``): its
record, its idempotency key when it still names the job, its allocation's rank exits and
any partition units its allocation still holds, in one fenced transaction compared on the
job's mod revision. No other key is keyed by job or allocation.

Every write is one etcd transaction. Read-modify-writes compare the mod revision read
(optimistic concurrency: ``Conflict`` when someone else wrote first) and, when a
fencing token is set, the create revision of the leader key: a deposed controller's
transaction fails with ``Fenced`` and changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import aetcd

from tessera.api.v1 import types_pb2


class Conflict(Exception):
    """A compared revision changed: re-read and retry (or give up)."""


class Fenced(Exception):
    """This controller is no longer the leader: stop writing."""


class CapacityExceeded(Exception):
    """An allocation would take a partition beyond its capacity (data, not an error:
    the job waits). The message names the partition, the amounts and the holders."""


@dataclass
class Versioned:
    """A decoded record and the etcd mod revision it was read at (0: absent)."""

    value: object
    mod_revision: int


class Store:
    def __init__(self, client: aetcd.Client, prefix: str = "/tessera") -> None:
        self.c = client
        self.prefix = prefix.rstrip("/")
        self.fencing_token: int | None = None  # create revision of our leader key
        # Set when this controller's leadership ended (lost or resigned) and cleared when it
        # is elected again: every transaction then fails with Fenced, also the ones of a
        # round or an RPC that passed its leader check before the loss (a fence of None
        # would compare nothing and let them through).
        self.deposed = False

    # -- keys -------------------------------------------------------------------------
    def k(self, *parts: str) -> bytes:
        return "/".join((self.prefix, *parts)).encode()

    def leader_key(self) -> bytes:
        return self.k("leader")

    def job_key(self, job_id: str) -> bytes:
        return self.k("jobs", job_id)

    def node_key(self, name: str) -> bytes:
        return self.k("nodes", name)

    def alloc_key(self, node: str, partition_id: str) -> bytes:
        return self.k("allocs", node, partition_id)

    def idem_key(self, tenant: str, key: str) -> bytes:
        return self.k("idem", tenant, key)

    def exit_key(self, alloc_id: str, rank: int) -> bytes:
        return self.k("exits", alloc_id, str(rank))

    # -- transactions -----------------------------------------------------------------
    def _fence(self) -> list:
        if self.fencing_token is None:
            return []
        return [self.c.transactions.create(self.leader_key()) == self.fencing_token]

    async def txn(self, compare: list, success: list) -> int:
        """Run a fenced transaction; return its header revision. Raises ``Fenced`` when
        the leader check failed, ``Conflict`` when another compare failed."""
        if self.deposed:
            raise Fenced("this controller lost its leadership: it writes nothing until elected again")
        fence = self._fence()
        ok, resp = await self.c.transaction(compare=fence + compare, success=success, failure=[])
        if ok:
            for r in resp:
                if hasattr(r, "HasField") and r.HasField("response_put"):
                    return int(r.response_put.header.revision)
                if hasattr(r, "HasField") and r.HasField("response_delete_range"):
                    return int(r.response_delete_range.header.revision)
            return 0
        if fence and not await self.is_leader():
            raise Fenced("leader key changed: this controller was deposed")
        raise Conflict("a compared revision changed")

    async def is_leader(self) -> bool:
        g = await self.c.get(self.leader_key())
        return g is not None and self.fencing_token is not None and g.create_revision == self.fencing_token

    # -- reads ------------------------------------------------------------------------
    async def get_job(self, job_id: str) -> Versioned | None:
        g = await self.c.get(self.job_key(job_id))
        if g is None:
            return None
        job = types_pb2.Job.FromString(g.value)
        job.revision = g.mod_revision
        return Versioned(job, g.mod_revision)

    async def list_jobs(self) -> tuple[list[types_pb2.Job], int]:
        """Every job, oldest id order is not meaningful: callers sort. Returns (jobs, revision)."""
        r = await self.c.get_prefix(self.k("jobs") + b"/")
        jobs = []
        for kv in r:
            j = types_pb2.Job.FromString(kv.value)
            j.revision = kv.mod_revision
            jobs.append(j)
        return jobs, int(r.header.revision)

    async def list_nodes(self) -> list[Versioned]:
        r = await self.c.get_prefix(self.k("nodes") + b"/")
        return [Versioned(types_pb2.Node.FromString(kv.value), kv.mod_revision) for kv in r]

    async def get_node(self, name: str) -> Versioned | None:
        g = await self.c.get(self.node_key(name))
        return None if g is None else Versioned(types_pb2.Node.FromString(g.value), g.mod_revision)

    async def list_holders(self) -> dict[tuple[str, str], dict[str, int]]:
        """(node, partition id) -> {allocation id: units} for every held partition."""
        r = await self.c.get_prefix(self.k("allocs") + b"/")
        out = {}
        base = len(self.k("allocs")) + 1
        for kv in r:
            node, pid = kv.key[base:].decode().split("/", 1)
            out[(node, pid)] = _holders(kv.value)
        return out

    async def rank_exits(self, alloc_id: str) -> dict[int, int]:
        r = await self.c.get_prefix(self.k("exits", alloc_id) + b"/")
        return {int(kv.key.rsplit(b"/", 1)[1]): int(kv.value) for kv in r}

    async def get_idem(self, tenant: str, key: str) -> str | None:
        g = await self.c.get(self.idem_key(tenant, key))
        return None if g is None else g.value.decode()

    async def get_idem_versioned(self, tenant: str, key: str) -> Versioned | None:
        """The job id an idempotency key names (str) and the key's mod revision; None if absent."""
        g = await self.c.get(self.idem_key(tenant, key))
        return None if g is None else Versioned(g.value.decode(), g.mod_revision)

    # -- writes -----------------------------------------------------------------------
    def put_job_op(self, job: types_pb2.Job):
        j = types_pb2.Job()
        j.CopyFrom(job)
        j.revision = 0  # the revision is etcd's, never stored
        return self.c.transactions.put(self.job_key(job.id), j.SerializeToString())

    async def create_job(self, job: types_pb2.Job, idem: str) -> int:
        """Create a job (and its idempotency key). ``Conflict`` if the key or id exists."""
        cmp = [self.c.transactions.version(self.job_key(job.id)) == 0]
        ops = [self.put_job_op(job)]
        if idem:
            ik = self.idem_key(job.spec.tenant, idem)
            cmp.append(self.c.transactions.version(ik) == 0)
            ops.append(self.c.transactions.put(ik, job.id.encode()))
        return await self.txn(cmp, ops)

    async def update_job(self, job: types_pb2.Job, mod_revision: int, extra_cmp=(), extra_ops=()) -> int:
        """Write ``job`` if its record is still at ``mod_revision``."""
        cmp = [self.c.transactions.mod(self.job_key(job.id)) == mod_revision, *extra_cmp]
        return await self.txn(cmp, [self.put_job_op(job), *extra_ops])

    async def delete_job(self, job: types_pb2.Job, mod_revision: int, extra_cmp=(), extra_ops=()) -> int:
        """Remove ``job``'s record if it is still at ``mod_revision`` (``Conflict`` when it
        changed or is gone; ``Fenced`` when deposed), with the caller's compares and writes,
        and its idempotency key when that still names this job (compared on its mod
        revision: a key rewritten meanwhile fails the transaction with ``Conflict``)."""
        cmp = [self.c.transactions.mod(self.job_key(job.id)) == mod_revision, *extra_cmp]
        ops = [self.c.transactions.delete(self.job_key(job.id)), *extra_ops]
        if job.idempotency_key:
            iv = await self.get_idem_versioned(job.spec.tenant, job.idempotency_key)
            if iv is not None and iv.value == job.id:
                ik = self.idem_key(job.spec.tenant, job.idempotency_key)
                cmp.append(self.c.transactions.mod(ik) == iv.mod_revision)
                ops.append(self.c.transactions.delete(ik))
        return await self.txn(cmp, ops)

    async def delete_idem(self, tenant: str, key: str, mod_revision: int) -> int:
        """Remove an idempotency key that names a job no longer stored, if still at
        ``mod_revision`` (``Conflict`` otherwise)."""
        ik = self.idem_key(tenant, key)
        return await self.txn([self.c.transactions.mod(ik) == mod_revision], [self.c.transactions.delete(ik)])

    async def realloc_ops(self, drop: str = "", drop_keys=(), add: str = "",
                          add_units: dict[tuple[str, str], int] | None = None,
                          capacity: dict[tuple[str, str], int] | None = None) -> tuple[list, list]:
        """Compares and writes that remove allocation ``drop`` from the partitions
        ``drop_keys`` ((node, partition id) pairs; its rank exits are forgotten too) and
        give allocation ``add`` ``add_units`` of each partition, in one transaction with
        the caller's own compares. Each partition record is compared on the mod revision
        read here, so the capacity check below holds at the revision written. Raises
        ``CapacityExceeded`` when ``add`` would take a partition beyond ``capacity``."""
        add_units = add_units or {}
        capacity = capacity or {}
        cmp, ops = [], []
        for key in sorted(set(drop_keys) | set(add_units)):
            k = self.alloc_key(*key)
            g = await self.c.get(k)
            holders = _holders(g.value) if g is not None else {}
            before = dict(holders)
            if drop:
                holders.pop(drop, None)
            if key in add_units:
                cap = capacity.get(key, 0)
                used = sum(u for a, u in holders.items() if a != add)
                if cap and used + add_units[key] > cap:
                    raise CapacityExceeded(
                        f"partition {key[1]} on {key[0]}: asks {add_units[key]} of {cap} units, {cap - used} free "
                        f"(held by {', '.join(f'{a}:{u}' for a, u in sorted(holders.items()) if a != add)})")
                holders[add] = add_units[key]
            if holders == before:
                continue
            cmp.append(self.c.transactions.version(k) == 0 if g is None else self.c.transactions.mod(k) == g.mod_revision)
            ops.append(self.c.transactions.put(k, json.dumps(holders, sort_keys=True).encode()) if holders
                       else self.c.transactions.delete(k))
        if drop:
            ex = self.k("exits", drop) + b"/"
            ops.append(self.c.transactions.delete(ex, range_end=_prefix_end(ex)))
        return cmp, ops

    async def put_node(self, node: types_pb2.Node, mod_revision: int | None) -> int:
        cmp = [] if mod_revision is None else [self.c.transactions.mod(self.node_key(node.name)) == mod_revision]
        return await self.txn(cmp, [self.c.transactions.put(self.node_key(node.name), node.SerializeToString())])

    def put_exit_op(self, alloc_id: str, rank: int, code: int):
        """The write of one rank's exit code (for a caller's transaction)."""
        return self.c.transactions.put(self.exit_key(alloc_id, rank), str(code).encode())


def _holders(raw: bytes) -> dict[str, int]:
    """Decode a partition record (an older record is a bare allocation id: whole)."""
    try:
        d = json.loads(raw)
    except ValueError:
        d = None
    if isinstance(d, dict):
        return {str(a): int(u) for a, u in d.items()}
    return {raw.decode(): 0}


def _prefix_end(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    b[-1] += 1
    return bytes(b)
