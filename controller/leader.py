"""Leader election on an etcd lease, with a fencing token.

A ``Leadership`` grants a lease, then tries to create the leader key on it (a
transaction that succeeds only if the key does not exist). The winner's fencing token
is the key's create revision; every decision write compares it (see store.Store.txn).
The lease is kept alive at TTL/3; a failed renewal, or a leader key that is gone or
recreated, ends leadership at once (``on_lost`` is awaited) — before the lease can
expire on the server, so this controller stops writing before another can take over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aetcd

from tessera import log

from .store import Store


class Leadership:
    def __init__(self, client: aetcd.Client, store: Store, identity: str, ttl: int = 5) -> None:
        self.c = client
        self.store = store
        self.identity = identity
        self.ttl = ttl
        self.lease = None
        self.is_leader = asyncio.Event()
        self.log = log.get(component="leader", identity=identity)

    async def campaign(self, on_elected: Callable[[], Awaitable[None]], on_lost: Callable[[], Awaitable[None]]) -> None:
        """Run forever: wait to become leader, lead until the lease is lost, repeat."""
        while True:
            try:
                token = await self._acquire()
                if token is None:
                    await self._wait_vacant()
                    continue
                self.store.fencing_token = token
                self.store.deposed = False
                self.is_leader.set()
                self.log.info("elected", fencing_token=token)
                await on_elected()
                await self._keepalive()
            except asyncio.CancelledError:
                await self.resign()
                raise
            except Exception as e:  # etcd unreachable: retry after a pause
                self.log.warning("election error", error=str(e))
            if self.is_leader.is_set():
                self.is_leader.clear()
                self.store.deposed = True  # before the token goes: in-flight writes fail Fenced
                self.store.fencing_token = None
                self.log.warning("leadership lost")
                await on_lost()
            await asyncio.sleep(0.5)

    async def _acquire(self) -> int | None:
        self.lease = await self.c.lease(self.ttl)
        key = self.store.leader_key()
        ok, _ = await self.c.transaction(
            compare=[self.c.transactions.create(key) == 0],
            success=[self.c.transactions.put(key, self.identity.encode(), lease=self.lease.id)],
            failure=[],
        )
        if not ok:
            await self.c.revoke_lease(self.lease.id)
            self.lease = None
            return None
        g = await self.c.get(key)
        return None if g is None else g.create_revision

    async def _wait_vacant(self) -> None:
        """Return when the leader key is gone (or after at most a TTL, to re-check)."""
        key = self.store.leader_key()
        try:
            async with asyncio.timeout(self.ttl):
                watch = await self.c.watch(key, kind=aetcd.EventKind.DELETE)
                try:
                    if await self.c.get(key) is None:
                        return
                    async for _ in watch:
                        return
                finally:
                    await watch.cancel()
        except TimeoutError:
            return

    async def _keepalive(self) -> None:
        """Refresh the lease at TTL/3 until a refresh fails or the key is not ours."""
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                # Refresh and ownership check within one TTL/3: a slow etcd must end
                # leadership here, before the lease can expire on the server.
                async with asyncio.timeout(self.ttl / 3):
                    resp = await self.lease.refresh()
                    if resp is None or resp.TTL <= 0 or not await self.store.is_leader():
                        return
            except TimeoutError:
                return

    async def resign(self) -> None:
        """Give up leadership now (on shutdown), so a standby takes over at once."""
        if self.store.fencing_token is not None:
            self.store.deposed = True
        self.is_leader.clear()
        self.store.fencing_token = None
        if self.lease is not None:
            try:
                await self.c.revoke_lease(self.lease.id)
            except Exception:
                pass
            self.lease = None
