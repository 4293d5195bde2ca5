"""Which Redis: every `redis_*` setting as one value (`RedisConfig`, `RedisTarget`), and the one
place that turns it into a redis-py asyncio client (`client()`).

`RedisConfig` is built once; its `client()` is the one client (one connection pool) a process
shares between its stores, the registry sync, usage and response ids. That client has no socket
timeout: each caller bounds its own calls (a hot-path store by `redis_timeout`, the registry by
seconds), and a per-read timer would cost CPU on every request. Its pool blocks up to
`redis_timeout` for a free connection.

redis-py is imported when a client is built: a process without Redis never loads it (a third of
the router's import time; every start pays it). What works on a client is in
router/core/redis_client.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.core.settings import Settings

if TYPE_CHECKING:
    from redis.asyncio import Redis, RedisCluster

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
    ) -> Redis | RedisCluster:
        """A client whose every call gives up after `timeout`; `blocking` makes a standalone
        pool wait (up to `timeout`) for a free connection instead of failing at once."""
        common: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "max_connections": max_connections,
            **options,
        }
        from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster

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
        from redis.asyncio.connection import SSLConnection, parse_url
        from redis.asyncio.sentinel import Sentinel

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

    def client(self) -> Redis | RedisCluster:
        """The process's one client: no retries and no socket timeout (callers bound their
        calls), a pool that waits up to `timeout` for a free connection."""
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        return self.target.client(
            timeout=self.timeout,
            max_connections=POOL_SIZE,
            blocking=True,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=None,
            socket_connect_timeout=max(self.timeout, CONNECT_TIMEOUT),
        )
