"""The upstream HTTP/1.1 transport: aiohttp's client under httpx's interface, one per backend.

The proxy and the probes speak httpx (`httpx.Request` in, `httpx.Response` out, httpx's
`Timeout`/`Limits` and exception tree); aiohttp does the wire work: its C parser, header count and
line limits, connection reuse. What this module adds on top:

- Reads are coalesced: each body step returns everything buffered since the last one, so one
  upstream read becomes one client write. Buffering is bounded (`READ_BUFSIZE`): past it aiohttp
  stops reading the socket, so backpressure reaches the backend.
- A response the consumer leaves early resets its connection (SO_LINGER 0): the backend learns at
  once that nobody reads, and no TIME_WAIT stays behind for each abandoned stream.
- A request is written at most once. aiohttp never re-sends a POST; a pooled connection the OS
  already knows is closed or readable (EOF, or bytes nobody asked for) is dropped *before*
  writing, and a connection that closes after the request went out is the caller's failure to
  count (`RemoteProtocolError`), never retried here.
- Limits: at most `max_connections` exchanges per backend (waiting up to the pool timeout, then
  `PoolTimeout`), a response head of at most `MAX_HEAD_BYTES` and `MAX_HEADERS` headers, a final
  status within 200-599 (`InvalidResponse` otherwise, connection dropped).

Timeouts keep httpx's meaning: connect, read (the longest silence, also before the head), pool.
`write` is not enforced separately: aiohttp has no write timeout, so a backend that stops
reading the request body is caught by the read timeout.

Exceptions (aiohttp's mapped once, in `_mapped`):
    httpx.PoolTimeout           our own cap on connections to this backend, no slot in time
    httpx.ConnectTimeout        connect did not finish in time
    httpx.ConnectError          connect refused / DNS / TLS failure
    httpx.ReadTimeout           the backend was silent longer than the read timeout
    httpx.RemoteProtocolError   closed before or during the response, or a malformed response
      └── InvalidResponse       a response we refuse: head too large, status outside 200-599
    httpx.ReadError             the connection failed with an OS error mid-exchange
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import struct
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import httpx

READ_BUFSIZE = 128 * 1024  # aiohttp pauses reading past twice this (~256 KiB per response)
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
MAX_LINE = 8190
_LINGER_RESET = struct.pack("ii", 1, 0)


class InvalidResponse(httpx.RemoteProtocolError):
    """The backend answered something a proxy must not relay (the connection is dropped)."""


class _Connector(aiohttp.TCPConnector):
    """aiohttp's connector, plus a check before a pooled connection carries a request: one the
    OS already reports closed or readable while idle (EOF, or bytes nobody asked for) is closed
    instead of used, so no request is written to a connection that cannot answer it."""

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:
        while True:
            conn = await super().connect(req, traces, timeout)
            if not _stale(conn):
                return conn
            proto = conn.protocol
            if proto is not None:
                proto.force_close()
            conn.close()

    def retire(self) -> None:
        """Idle connections close now; busy ones close when their exchange ends."""
        self._force_close = True
        for conns in self._conns.values():
            for proto, _ in conns:
                proto.close()
        self._conns.clear()


def _stale(conn: Any) -> bool:
    proto = conn.protocol
    if proto is None or not proto.is_connected() or proto.should_close:
        return True
    transport = conn.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


@contextlib.contextmanager
def _mapped(connecting: bool) -> Iterator[None]:
    """aiohttp's exceptions as httpx's, the one place they are translated."""
    try:
        yield
    except httpx.HTTPError:
        raise
    except aiohttp.ConnectionTimeoutError:
        raise httpx.ConnectTimeout("could not connect to the backend in time") from None
    except aiohttp.ServerTimeoutError:
        raise httpx.ReadTimeout("backend sent nothing within the read timeout") from None
    except aiohttp.ClientConnectorError as exc:
        raise httpx.ConnectError(f"could not connect to the backend: {exc.strerror}") from None
    except aiohttp.ServerDisconnectedError:
        if connecting:
            raise httpx.RemoteProtocolError("backend closed the connection") from None
        raise httpx.RemoteProtocolError(
            "backend closed the connection before the response ended"
        ) from None
    except aiohttp.ClientResponseError as exc:  # aiohttp's parser refused the response head
        raise InvalidResponse(f"malformed upstream response: {exc.message}") from None
    except aiohttp.ClientPayloadError:
        raise httpx.RemoteProtocolError(
            "backend closed the connection before the response ended"
        ) from None
    except aiohttp.ClientOSError:
        raise httpx.ReadError("connection to the backend was reset") from None
    except aiohttp.ClientError as exc:
        raise httpx.RemoteProtocolError(f"upstream exchange failed: {type(exc).__name__}") from None
    except TimeoutError:
        raise httpx.ReadTimeout("backend sent nothing within the read timeout") from None


def _reset(resp: aiohttp.ClientResponse) -> None:
    """Drop the response's connection with a reset (see the module docstring)."""
    conn = resp.connection
    transport = conn.transport if conn is not None else None
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError, NotImplementedError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        transport.abort()
    resp.close()


class _Body(httpx.AsyncByteStream):
    """The response body: each step returns everything buffered since the last one."""

    def __init__(self, resp: aiohttp.ClientResponse, release: Any) -> None:
        self._resp = resp
        self._content = resp.content
        self._release = release
        self._done = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        try:
            with _mapped(False):
                data = await self._content.readany()
        except BaseException:
            await self.aclose()
            raise
        if data:
            return data
        # aiohttp ends a body that stopped short with an error, never with b"" here.
        self._finish(reuse=True)
        raise StopAsyncIteration

    def _finish(self, reuse: bool) -> None:
        if self._done:
            return
        self._done = True
        if reuse:
            self._resp.release()
        else:
            _reset(self._resp)
        self._release()

    async def aclose(self) -> None:
        if not self._done:
            self._finish(reuse=self._content.at_eof() and self._content.exception() is None)


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One backend's connections: aiohttp's keep-alive pool and a cap on exchanges in progress."""

    def __init__(self, limits: httpx.Limits, verify: ssl.SSLContext | bool = True) -> None:
        self._max = limits.max_connections or 10**9
        self._expiry = limits.keepalive_expiry
        self._verify = verify
        self._count = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._session: aiohttp.ClientSession | None = None
        self._retired = False

    def _open(self) -> aiohttp.ClientSession:
        ssl_arg: ssl.SSLContext | bool = True
        if isinstance(self._verify, ssl.SSLContext):
            ssl_arg = self._verify
        elif self._verify is False:
            ssl_arg = False
        connector = _Connector(
            limit=0,  # the cap is ours (below): exchanges, with httpx's pool timeout
            keepalive_timeout=self._expiry,
            ssl=ssl_arg,
            enable_cleanup_closed=False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,  # bodies are forwarded byte for byte
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            read_bufsize=READ_BUFSIZE,
            max_line_size=MAX_LINE,
            max_field_size=MAX_LINE,
            max_headers=MAX_HEADERS,
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._retired:
            raise httpx.ConnectError("the pool for this backend was closed")
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        session = self._session or self._open()
        body = (
            request.content
            if isinstance(request.stream, httpx.ByteStream)
            else (await request.aread())
        )
        headers = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in request.headers.raw
            if k.lower() not in (b"content-length", b"transfer-encoding")
        ]
        await self._acquire(timeouts.get("pool"))
        try:
            with _mapped(True):
                resp = await session.request(
                    request.method,
                    str(request.url),
                    headers=headers,
                    data=body or None,
                    allow_redirects=False,
                    compress=None,
                    timeout=aiohttp.ClientTimeout(
                        total=None,
                        connect=None,
                        sock_connect=timeouts.get("connect"),
                        sock_read=timeouts.get("read"),
                    ),
                )
        except BaseException:
            self._free()
            raise
        status = resp.status
        raw = resp.raw_headers
        if not 200 <= status <= 599:
            _reset(resp)
            self._free()
            raise InvalidResponse(f"backend answered with status {status}")
        if sum(len(k) + len(v) + 4 for k, v in raw) > MAX_HEAD_BYTES:
            _reset(resp)
            self._free()
            raise InvalidResponse("backend sent a response head larger than 64 KiB")
        return httpx.Response(
            status,
            headers=list(raw),
            stream=_Body(resp, self._free),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _acquire(self, pool_timeout: float | None) -> None:
        while self._count >= self._max:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(pool_timeout):
                    await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled():
                    self._notify()  # handed a free slot we won't use: pass it on
                if isinstance(exc, TimeoutError):
                    raise httpx.PoolTimeout("no upstream connection free in time") from None
                raise
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        self._count += 1

    def _free(self) -> None:
        self._count -= 1
        self._notify()

    def _notify(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def retire(self) -> None:
        """Take no new requests: idle connections close now, busy ones when their stream ends."""
        self._retired = True
        session = self._session
        if session is not None and isinstance(session.connector, _Connector):
            session.connector.retire()

    async def aclose(self) -> None:
        self._retired = True
        if self._session is not None:
            await self._session.close()
