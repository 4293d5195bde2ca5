"""The one httpx connection pool each backend gets.

One `httpx.AsyncClient` per backend keeps each pool small (pool bookkeeping grows with its size),
reuses keep-alive connections across requests, and closes them all at shutdown.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from router.core.backend import Backend
from router.core.netpolicy import NetPolicy
from router.core.settings import PoolLimits, Timeouts
from router.upstream.transport import LeanTransport


class NoCookies(httpx.Cookies):
    """A jar that stores nothing: a proxy must not carry one client's cookies to another, and
    skipping the jar saves work on every request."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None

    def set_cookie_header(self, request: httpx.Request) -> None:
        return None


def make_client(
    backend: Backend, timeouts: Timeouts, limits: PoolLimits, policy: NetPolicy | None = None
) -> tuple[httpx.AsyncClient, LeanTransport]:
    pool_limits = httpx.Limits(
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive,
        keepalive_expiry=limits.keepalive_expiry,
    )
    transport = LeanTransport(pool_limits, policy=policy)
    client = httpx.AsyncClient(
        base_url=backend.url,
        timeout=httpx.Timeout(
            connect=timeouts.connect, read=timeouts.read, write=timeouts.write, pool=timeouts.pool
        ),
        transport=transport,
        params=dict(backend.query) or None,
        trust_env=False,
        follow_redirects=False,
    )
    client._cookies = NoCookies()  # httpx has no public switch for "no jar"
    # No default Accept-Encoding (httpx asks for gzip): the backend compresses only when the
    # client asked, since the body is forwarded as is.
    client.headers = httpx.Headers({})
    return client, transport


class Pools:
    """Backend name -> its client and transport. They outlive config swaps that keep the URL."""

    def __init__(
        self, timeouts: Timeouts, limits: PoolLimits, policy: NetPolicy | None = None
    ) -> None:
        self._timeouts = timeouts
        # Held to backends not from the file (admin API, discovery): their traffic and probes.
        self._policy = policy
        self._limits = limits
        self._pools: dict[str, _Pool] = {}
        self._timeout = httpx.Timeout(
            connect=timeouts.connect, read=timeouts.read, write=timeouts.write, pool=timeouts.pool
        ).as_dict()

    def request(
        self, backend: Backend, path: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[LeanTransport, httpx.Request]:
        """The pool for `backend` and a POST to `path` on it, built without re-parsing URLs.

        The proxy sends through the pool's transport directly: the client's own layers (auth,
        redirects, cookies, event hooks, stream wrappers) are all off for a proxy, and each of
        them costs time on every request and every body chunk."""
        pool = self._get(backend)
        url = pool.urls.get(path)
        if url is None:
            url = pool.urls[path] = pool.client.build_request("POST", path).url
        request = httpx.Request(
            "POST", url, headers=headers, content=body, extensions={"timeout": self._timeout}
        )
        return pool.transport, request

    def get(self, backend: Backend) -> httpx.AsyncClient:
        return self._get(backend).client

    def _get(self, backend: Backend) -> _Pool:
        pool = self._pools.get(backend.name)
        guarded = self._policy is not None and backend.source != "file"
        if (
            pool is not None
            and pool.url == backend.url
            and pool.query == backend.query
            and pool.guarded == guarded
        ):
            return pool
        if pool is not None:
            # The URL changed: the old pool finishes its streams in flight, takes nothing new.
            pool.transport.retire()
        policy = self._policy if guarded else None
        client, transport = make_client(backend, self._timeouts, self._limits, policy)
        pool = self._pools[backend.name] = _Pool(
            backend.url, backend.query, client, transport, guarded
        )
        return pool

    def names(self) -> set[str]:
        return set(self._pools)

    async def discard(self, name: str) -> None:
        pool = self._pools.pop(name, None)
        if pool is not None:
            await pool.client.aclose()

    async def aclose(self) -> None:
        pools = list(self._pools.values())
        self._pools.clear()
        for pool in pools:
            await pool.client.aclose()


@dataclass(slots=True)
class _Pool:
    url: str
    query: tuple[tuple[str, str], ...]
    client: httpx.AsyncClient
    transport: LeanTransport
    guarded: bool  # held to the network policy
    urls: dict[str, httpx.URL] = field(default_factory=dict)  # request path -> full URL
