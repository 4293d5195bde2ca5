"""A backend as a frozen value, and the one httpx connection pool each backend gets.

One `httpx.AsyncClient` per backend keeps each pool small (pool bookkeeping grows with its size),
reuses keep-alive connections across requests, and closes them all at shutdown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import httpx

from router.settings import BackendConfig, HealthConfig, OutlierConfig, PoolLimits, Timeouts
from router.transport import LeanTransport


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    url: str
    kind: str
    models: MappingProxyType[str, str]  # public name -> the backend's own model id
    weight: float = 1.0
    max_inflight: int | None = None
    # Secret-bearing: never shown by repr, never serialised by `public()`.
    auth_headers: tuple[tuple[bytes, bytes], ...] = field(default=(), repr=False)
    query: tuple[tuple[str, str], ...] = ()
    has_key: bool = False
    health: HealthConfig | None = None
    outlier: OutlierConfig | None = None
    source: str = "file"  # "file" (the YAML file, maybe patched over the API) or "api"
    draining: bool = False
    key_header: str = "authorization"
    header_names: tuple[str, ...] = ()  # extra headers' names; their values may be secrets

    @classmethod
    def from_config(
        cls, cfg: BackendConfig, source: str = "file", draining: bool = False
    ) -> Backend:
        key = cfg.resolved_key()
        headers: list[tuple[bytes, bytes]] = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in cfg.headers.items()
        ]
        if key:
            hname = cfg.key_header.lower()
            value = f"Bearer {key}" if hname == "authorization" else key
            headers.append((hname.encode("latin-1"), value.encode("latin-1")))
        return cls(
            name=cfg.name,
            url=cfg.url,
            kind=cfg.kind,
            models=MappingProxyType(dict(cfg.models)),
            weight=cfg.weight,
            max_inflight=cfg.max_inflight,
            auth_headers=tuple(headers),
            query=tuple(cfg.query.items()),
            has_key=bool(key),
            health=cfg.health,
            outlier=cfg.outlier,
            source=source,
            draining=draining,
            key_header=cfg.key_header.lower(),
            header_names=tuple(k.lower() for k in cfg.headers),
        )

    def public(self) -> dict[str, Any]:
        """What the admin API may show: everything but secrets."""
        return {
            "name": self.name,
            "url": self.url,
            "kind": self.kind,
            "models": dict(self.models),
            "weight": self.weight,
            "max_inflight": self.max_inflight,
            "api_key": "***" if self.has_key else None,
            "key_header": self.key_header,
            # Values masked: extra headers and query parameters can carry credentials too.
            "headers": dict.fromkeys(self.header_names, "***"),
            "query": {k: "***" for k, _ in self.query},
            "source": self.source,
            "draining": self.draining,
        }


class NoCookies(httpx.Cookies):
    """A jar that stores nothing: a proxy must not carry one client's cookies to another, and
    skipping the jar saves work on every request."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None

    def set_cookie_header(self, request: httpx.Request) -> None:
        return None


def make_client(
    backend: Backend, timeouts: Timeouts, limits: PoolLimits
) -> tuple[httpx.AsyncClient, LeanTransport]:
    pool_limits = httpx.Limits(
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive,
        keepalive_expiry=limits.keepalive_expiry,
    )
    transport = LeanTransport(pool_limits)
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

    def __init__(self, timeouts: Timeouts, limits: PoolLimits) -> None:
        self._timeouts = timeouts
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
        if pool is not None and pool.url == backend.url and pool.query == backend.query:
            return pool
        if pool is not None:
            # The URL changed: the old pool finishes its streams in flight, takes nothing new.
            pool.transport.retire()
        client, transport = make_client(backend, self._timeouts, self._limits)
        pool = self._pools[backend.name] = _Pool(backend.url, backend.query, client, transport)
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
    urls: dict[str, httpx.URL] = field(default_factory=dict)  # request path -> full URL
