"""What works on a redis-py asyncio client, for the modules that talk to Redis: the `Client`
type, the Cluster's slot map, Sentinel's master, raw connections by key. The settings' value
(`RedisConfig`, `RedisTarget`) and the client it builds are in router/core/redis_config.py, which
loads redis-py only when Redis is configured; this module loads it at import.

Three shapes, the same for every Redis user (shared in-flight counts, registry sync):
- standalone: `redis_url` with `redis://`, `rediss://` (TLS) or `unix://`;
- Sentinel: `redis_sentinels` + `redis_sentinel_master`; the sentinels name the master, and a
  failover moves every connection to the new one (credentials, TLS and db from `redis_url`);
- Cluster: `redis_cluster: true`, `redis_url` naming any node; slots are discovered from it.

Keys one script or transaction touches share a hash tag (`{sluicegate}:...`), so they live in one
slot: Cluster then runs them on one shard, and `KeyConnections` hands the batched writer raw
connections to the server that owns that slot (the primary on Cluster, the master on Sentinel).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ClusterDownError

from router.core.errors import STORE_FAILURES
from router.core.redis_config import RedisConfig as RedisConfig
from router.core.redis_config import RedisTarget as RedisTarget

Client = Redis | RedisCluster


def client_for(redis: str | RedisTarget | Client, timeout: float) -> tuple[Client, bool]:
    """A client from what a part was given, and whether the part owns (closes) it: a URL or a
    target gets one of its own (tests, tools), a client is the app's, shared."""
    if isinstance(redis, Redis | RedisCluster):
        return redis, False
    target = RedisTarget(url=redis) if isinstance(redis, str) else redis
    return RedisConfig(target, timeout).client(), True


class SlotNotCovered(ClusterDownError):
    """No primary serves the slot (a failover in progress): like Redis's CLUSTERDOWN."""


async def ready(client: Client) -> None:
    """Cluster learns its slot map before anything that does not route by itself (pub/sub)."""
    if isinstance(client, RedisCluster):
        await client.initialize()


async def follow_master(client: Client, limit: float) -> bool:
    """Sentinel: ask who the master is now and close idle connections to a former one; True when
    it changed. A promoted replica does not end connections to the old master, which stays
    writable until the sentinels demote it, so long-lived connections must look (each
    heartbeat or resync). Sentinels that don't answer leave things as they are."""
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool):
        return False
    before = pool.master_address
    try:
        async with asyncio.timeout(limit):
            after = await pool.get_master_address()
    except STORE_FAILURES:
        return False
    return before is not None and after != before


def off_master(client: Client, conn: Connection | None) -> bool:
    """Sentinel: `conn` is connected to a server other than the master the client last learnt
    (from any of its users' `follow_master`): a held connection or a subscription to close."""
    pool = getattr(client, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool) or conn is None or not conn.is_connected:
        return False
    master = pool.master_address
    return master is not None and (conn.host, conn.port) != master


Release = Callable[[], Awaitable[None]]


class KeyConnections:
    """Raw connections to the server that owns `key`'s slot, for commands packed by hand.

    Standalone and Sentinel: the client's own pool (Sentinel's reconnects to the current
    master). Cluster: the pool of the primary owning the slot; after a redirect or a lost
    connection `stale()` re-reads the slot map in the background, once at a time.
    """

    def __init__(self, client: Client, key: str) -> None:
        self._client = client
        self._key = key
        self._refresh: asyncio.Task[None] | None = None

    async def get(self) -> tuple[Connection, Release]:
        client = self._client
        if isinstance(client, RedisCluster):
            await client.initialize()  # discovers the slots once; a no-op afterwards
            node = client.get_node_from_key(self._key)
            if node is None:
                raise SlotNotCovered(self._key)
            conn = node.acquire_connection()

            async def release_node() -> None:
                node.release(conn)

            return conn, release_node
        pool = client.connection_pool
        pooled = await pool.get_connection()

        async def release_pooled() -> None:
            await pool.release(pooled)

        return pooled, release_pooled

    def stale(self) -> None:
        """The slot may have moved (redirect, failover, lost node): look again, off the hot path."""
        if not isinstance(self._client, RedisCluster) or self._refresh is not None:
            return
        self._refresh = asyncio.get_running_loop().create_task(self._reread(self._client))

    async def _reread(self, client: RedisCluster) -> None:
        try:
            with contextlib.suppress(*STORE_FAILURES):
                await client.nodes_manager.initialize()
        finally:
            self._refresh = None
