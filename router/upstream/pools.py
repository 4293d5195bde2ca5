"""Every connection to a backend: its traffic pool, and the transports its probes and scrapes use.

`backend_transport` is the one place that decides how the router reaches a backend: the lean
transport (router/upstream/transport.py) with the backend's TLS context and SNI name
(router/core/tls.py) and, for backends not from the file, the network policy. Traffic, health
probes, engine scrapes, discovery's `models: auto` and the KV-event sources question all get
their transport from it, so a backend behind a private CA passes or fails them all alike. The
background ones get transports of their own on purpose (the same class and the same shared
SSLContext, not the traffic pool): a probe or a scrape never waits for, or takes, a slot of the
traffic pool (a full pool must not make a backend look dead), and the traffic pool's limits stay
the operator's. `/tokenize` and LoRA loads, which serve requests, use the traffic pool.

`Pools` holds one traffic transport per backend (small pools: bookkeeping grows with the size),
reuses keep-alive connections across requests and closes them all at shutdown.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlencode

import httpx

from router.core.backend import Backend
from router.core.netpolicy import NetPolicy
from router.core.settings import PoolLimits, Timeouts
from router.upstream.transport import Answer, LeanTransport, Outgoing


def backend_transport(
    backend: Backend, limits: httpx.Limits, policy: NetPolicy | None = None
) -> LeanTransport:
    """A transport to `backend`: its TLS policy always, `policy` when it is not from the file
    (backends added at run time reach only the networks allowed, router/core/netpolicy.py)."""
    return LeanTransport(
        limits,
        ssl_context=backend.ssl_context,
        policy=policy if backend.source != "file" else None,
        server_name=backend.server_name,
    )


def join_url(base: httpx.URL, query: bytes, path: str) -> httpx.URL:
    """`path` (maybe with the client's query, kept byte for byte) under `base` (a backend's URL
    and a slash), the backend's own `query` (encoded once) appended."""
    rel = httpx.URL(path)
    raw = base.raw_path + rel.raw_path.lstrip(b"/")
    if query:
        raw += (b"&" if rel.query else b"?") + query
    return base.copy_with(raw_path=raw)


_ONE = httpx.Limits(max_connections=1, max_keepalive_connections=0)  # one question, then closed


async def ask(
    backend: Backend, url: httpx.URL | str, max_bytes: int, policy: NetPolicy | None = None
) -> tuple[int, bytes]:
    """One GET of `url` on `backend` (a question beside its traffic: `/v1/models`,
    `/kv_event_sources`), on a connection of its own made as traffic's, closed after. The
    status and, for a 2xx, the body read up to `max_bytes` (ValueError past it); no timeout of
    its own: the caller bounds the whole answer."""
    request = httpx.Request(
        "GET",
        url,
        headers=[(b"accept", b"application/json"), *backend.auth_headers],
        extensions={"timeout": dict.fromkeys(("connect", "read", "write", "pool"), None)},
    )
    r = await backend_transport(backend, _ONE, policy).handle_async_request(request)
    try:
        if not 200 <= r.status_code < 300:
            return r.status_code, b""
        body = bytearray()
        async for chunk in r.aiter_raw():
            body += chunk
            if len(body) > max_bytes:
                raise ValueError("answer too large")
        return r.status_code, bytes(body)
    finally:
        await r.aclose()


class Sender(Protocol):
    """What sends one request to a backend: a pool's `LeanTransport`, or the transport given
    to `create_app` (tests, embedding)."""

    async def send(self, request: Outgoing) -> Answer: ...


class Pools:
    """Backend name -> its traffic transport. It outlives config swaps that keep the URL, the
    query and the TLS context. `transport`, when given, sends every request in its place
    (`create_app(settings, transport=...)`): backend -> its sender."""

    def __init__(
        self,
        timeouts: Timeouts,
        limits: PoolLimits,
        policy: NetPolicy | None = None,
        transport: Callable[[Backend], Sender] | None = None,
    ) -> None:
        self._transport = transport
        # Held to backends not from the file (admin API, discovery): their traffic and probes.
        self._policy = policy
        self._limits = httpx.Limits(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive,
            keepalive_expiry=limits.keepalive_expiry,
        )
        self._pools: dict[str, _Pool] = {}
        self._timeout = httpx.Timeout(
            connect=timeouts.connect, read=timeouts.read, write=timeouts.write, pool=timeouts.pool
        ).as_dict()

    @property
    def policy(self) -> NetPolicy | None:
        return self._policy

    def request(
        self,
        backend: Backend,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        method: str = "POST",
        cache: bool = True,
    ) -> tuple[Sender, Outgoing]:
        """The pool for `backend` and a `method` request to `path` on it, built without
        re-parsing URLs (`cache` False: a path that names one resource, never kept).

        The proxy sends through the pool's transport directly: an httpx client's own layers
        (auth, redirects, cookies, event hooks, stream wrappers) are all off for a proxy, and
        each of them costs time on every request and every body chunk."""
        pool = self._get(backend)
        url = pool.urls.get(path) if cache else None
        if url is None:
            url = join_url(pool.base, pool.encoded_query, path)
            if cache:
                pool.urls[path] = url
        sender = pool.transport if self._transport is None else self._transport(backend)
        return sender, Outgoing(method, url, headers, body, self._timeout)

    def transport(self, backend: Backend) -> LeanTransport:
        return self._get(backend).transport

    def _get(self, backend: Backend) -> _Pool:
        pool = self._pools.get(backend.name)
        if pool is not None and pool.backend is backend:
            return pool  # the request path's case: the snapshot's own value, already checked
        guarded = self._policy is not None and backend.source != "file"
        if (
            pool is not None
            and pool.url == backend.url
            and pool.query == backend.query
            and pool.guarded == guarded
            and pool.ssl_context is backend.ssl_context
            and pool.server_name == backend.server_name
        ):
            pool.backend = backend
            return pool
        if pool is not None:
            # The URL changed: the old pool finishes its streams in flight, takes nothing new.
            pool.transport.retire()
        transport = backend_transport(backend, self._limits, self._policy)
        pool = self._pools[backend.name] = _Pool(
            backend.url,
            httpx.URL(backend.url + "/"),
            urlencode(backend.query).encode("ascii"),
            backend.query,
            transport,
            guarded,
            backend.ssl_context,
            backend.server_name,
            backend,
        )
        return pool

    def names(self) -> set[str]:
        return set(self._pools)

    async def discard(self, name: str) -> None:
        pool = self._pools.pop(name, None)
        if pool is not None:
            await pool.transport.aclose()

    async def aclose(self) -> None:
        pools = list(self._pools.values())
        self._pools.clear()
        for pool in pools:
            await pool.transport.aclose()


@dataclass(slots=True)
class _Pool:
    url: str
    base: httpx.URL  # the URL with a trailing slash, parsed once
    encoded_query: bytes  # the backend's `query`, encoded once
    query: tuple[tuple[str, str], ...]
    transport: LeanTransport
    guarded: bool  # held to the network policy
    ssl_context: ssl.SSLContext | None  # the backend's when the pool was made (by identity)
    server_name: str | None
    backend: Backend  # the value last checked against the fields above
    urls: dict[str, httpx.URL] = field(default_factory=dict)  # request path -> full URL
