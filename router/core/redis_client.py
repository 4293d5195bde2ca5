"""Which Redis, and how to reach it: one place that turns settings into a redis-py asyncio client.

`RedisConfig` is every `redis_*` setting as one value, built once; its `client()` is the one
client (one connection pool) a process shares between its stores, the registry sync, usage and
response ids. That client has no socket timeout: each caller bounds its own calls (a hot-path
store by `redis_timeout`, the registry by seconds), and a per-read timer would cost CPU on
every request. Its pool blocks up to `redis_timeout` for a free connection.

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
from dataclasses import dataclass
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.connection import Connection, SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError

from router.core.errors import STORE_FAILURES
from router.core.settings import Settings

Client = Redis | RedisCluster

# Connections the shared pool may open: each store's batcher holds one, the registry's
# subscription one; the rest serve the registry, usage and response-id calls of the moment.
POOL_SIZE = 32
CONNECT_TIMEOUT = 2.0  # a TLS handshake on a busy node; hot-path callers bound theirs tighter


@dataclass(frozen=True)
class RedisTarget:
    url: str | None = None
    sentinels: tuple[str, ...] = ()
    sentinel_master: str | None = None
    sentinel_password: str | None = None
    cluster: bool = False

    @classmethod
    def from_settings(cls, s: Settings) -> RedisTarget | None:
        """None when no Redis is configured (counts and the registry stay in-process)."""
        if s.redis_url is None and not s.redis_sentinels:
            return None
        return cls(
            url=s.redis_url.get_secret_value() if s.redis_url else None,
            sentinels=tuple(s.redis_sentinels),
            sentinel_master=s.redis_sentinel_master,
            sentinel_password=(
                s.redis_sentinel_password.get_secret_value() if s.redis_sentinel_password else None
            ),
            cluster=s.redis_cluster,
        )

    @property
    def kind(self) -> str:
        return "cluster" if self.cluster else "sentinel" if self.sentinels else "standalone"

    def client(
        self,
        *,
        timeout: float,
        max_connections: int,
        blocking: bool = False,
        **options: Any,
    ) -> Client:
        """A client whose every call gives up after `timeout`; `blocking` makes a standalone
        pool wait (up to `timeout`) for a free connection instead of failing at once."""
        common: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "max_connections": max_connections,
            **options,
        }
        if self.cluster:
            assert self.url is not None  # settings insist on it
            return RedisCluster.from_url(self.url, **common)
        if self.sentinels:
            return self._sentinel_master(common)
        assert self.url is not None
        if blocking:
            return Redis.from_pool(
                BlockingConnectionPool.from_url(self.url, timeout=timeout, **common)
            )
        return Redis.from_url(self.url, **common)

    def _sentinel_master(self, common: dict[str, Any]) -> Redis:
        assert self.sentinel_master is not None
        # The URL's host names nothing here (the sentinels do); its scheme, user, password and
        # db apply to the master.
        master: dict[str, Any] = dict(parse_url(self.url)) if self.url else {}
        master.pop("host", None)
        master.pop("port", None)
        tls = master.pop("connection_class", None) is SSLConnection
        sentinel_kwargs: dict[str, Any] = {
            k: v for k, v in common.items() if k.startswith("socket_")
        }
        if self.sentinel_password:
            sentinel_kwargs["password"] = self.sentinel_password
        if tls:
            master["ssl"] = True
            sentinel_kwargs["ssl"] = True
            for k, v in master.items():
                if k.startswith("ssl_"):
                    sentinel_kwargs[k] = v
        addrs = [(h, int(p)) for h, _, p in (a.rpartition(":") for a in self.sentinels)]
        sentinel = Sentinel(addrs, sentinel_kwargs=sentinel_kwargs)
        client: Redis = sentinel.master_for(self.sentinel_master, **{**common, **master})
        return client


@dataclass(frozen=True)
class RedisConfig:
    """The flat `redis_*` settings (the public config keys) as one value."""

    target: RedisTarget
    timeout: float = 0.05  # a hot-path call's bound (`redis_timeout`)
    lease_ttl: float = 10.0  # in-flight leases and quota slots outlive a crash by this
    prefix: str = "sluicegate"  # every key starts with it, the registry's included

    @classmethod
    def from_settings(cls, s: Settings) -> RedisConfig | None:
        """None when no Redis is configured (everything stays in-process)."""
        target = RedisTarget.from_settings(s)
        if target is None:
            return None
        return cls(target, s.redis_timeout, s.redis_lease_ttl, s.redis_prefix)

    def client(self) -> Client:
        """The process's one client: no retries and no socket timeout (callers bound their
        calls), a pool that waits up to `timeout` for a free connection."""
        return self.target.client(
            timeout=self.timeout,
            max_connections=POOL_SIZE,
            blocking=True,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=None,
            socket_connect_timeout=max(self.timeout, CONNECT_TIMEOUT),
        )


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
