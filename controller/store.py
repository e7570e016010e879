"""Cluster state in etcd: jobs, nodes, allocations, idempotency keys, rank exits.

Layout under the configurable prefix P (default ``/tessera``)::

    P/leader                      controller id, on the leader's lease
    P/jobs/<job_id>               Job (protobuf bytes)
    P/idem/<tenant>/<key>         job id of an idempotent submission
    P/nodes/<name>                Node (protobuf bytes)
    P/allocs/<node>/<device_id>   allocation id holding the device (one key per device:
                                  a device can never be held twice at any revision)
    P/exits/<alloc_id>/<rank>     exit code of a rank of an allocation

Every write is one etcd transaction. Read-modify-writes compare the mod revision read
(optimistic concurrency: ``Conflict`` when someone else wrote first) and, when a
fencing token is set, the create revision of the leader key: a deposed controller's
transaction fails with ``Fenced`` and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import aetcd

from tessera.api.v1 import types_pb2


class Conflict(Exception):
    """A compared revision changed: re-read and retry (or give up)."""


class Fenced(Exception):
    """This controller is no longer the leader: stop writing."""


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

    # -- keys -------------------------------------------------------------------------
    def k(self, *parts: str) -> bytes:
        return "/".join((self.prefix, *parts)).encode()

    def leader_key(self) -> bytes:
        return self.k("leader")

    def job_key(self, job_id: str) -> bytes:
        return self.k("jobs", job_id)

    def node_key(self, name: str) -> bytes:
        return self.k("nodes", name)

    def alloc_key(self, node: str, device_id: str) -> bytes:
        return self.k("allocs", node, device_id)

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
        fence = self._fence()
        ok, resp = await self.c.transaction(compare=fence + compare, success=success, failure=[])
        if ok:
            for r in resp:
                if hasattr(r, "HasField") and r.HasField("response_put"):
                    return int(r.response_put.header.revision)
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

    async def list_allocs(self) -> dict[tuple[str, str], str]:
        """(node, device_id) -> allocation id, for every held device."""
        r = await self.c.get_prefix(self.k("allocs") + b"/")
        out = {}
        base = len(self.k("allocs")) + 1
        for kv in r:
            node, dev = kv.key[base:].decode().split("/", 1)
            out[(node, dev)] = kv.value.decode()
        return out

    async def rank_exits(self, alloc_id: str) -> dict[int, int]:
        r = await self.c.get_prefix(self.k("exits", alloc_id) + b"/")
        return {int(kv.key.rsplit(b"/", 1)[1]): int(kv.value) for kv in r}

    async def get_idem(self, tenant: str, key: str) -> str | None:
        g = await self.c.get(self.idem_key(tenant, key))
        return None if g is None else g.value.decode()

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

    def alloc_ops(self, alloc_id: str, shards) -> tuple[list, list]:
        """Compares (every device free) and puts that take the devices of ``shards``."""
        cmp, ops = [], []
        for s in shards:
            for d in s.device_ids:
                key = self.alloc_key(s.node, d)
                cmp.append(self.c.transactions.version(key) == 0)
                ops.append(self.c.transactions.put(key, alloc_id.encode()))
        return cmp, ops

    def release_ops(self, alloc_id: str, shards) -> tuple[list, list]:
        """Compares (each device still held by ``alloc_id``) and deletes that free the
        devices of ``shards`` and forget the allocation's rank exits."""
        cmp, ops = [], []
        for s in shards:
            for d in s.device_ids:
                key = self.alloc_key(s.node, d)
                cmp.append(self.c.transactions.value(key) == alloc_id.encode())
                ops.append(self.c.transactions.delete(key))
        ex = self.k("exits", alloc_id) + b"/"
        ops.append(self.c.transactions.delete(ex, range_end=_prefix_end(ex)))
        return cmp, ops

    async def put_node(self, node: types_pb2.Node, mod_revision: int | None) -> int:
        cmp = [] if mod_revision is None else [self.c.transactions.mod(self.node_key(node.name)) == mod_revision]
        return await self.txn(cmp, [self.c.transactions.put(self.node_key(node.name), node.SerializeToString())])

    async def put_exit(self, alloc_id: str, rank: int, code: int) -> None:
        await self.txn([], [self.c.transactions.put(self.exit_key(alloc_id, rank), str(code).encode())])


def _prefix_end(prefix: bytes) -> bytes:
    b = bytearray(prefix)
    b[-1] += 1
    return bytes(b)
