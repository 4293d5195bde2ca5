"""A lean HTTP/1.1 transport for httpx: asyncio protocols, httptools parsing, an O(1) idle stack.

The proxy keeps httpx's client API (requests, responses, timeouts, the exception tree); this
replaces only what sits under it. httpcore's pool re-scans every connection several times per
request (quadratic in the pool size) and polls each idle socket, and every body chunk climbs
about eight async-generator layers through httpcore, h11 and anyio: in profiles that was most of
the router's CPU. Here a body chunk is one parser callback, and everything the parser produced
from one socket read reaches the proxy as one piece (so it becomes one client write).

Semantics kept from httpx: `Timeout(connect, read, write, pool)` (read = longest silence),
`Limits(max_connections, max_keepalive_connections, keepalive_expiry)`, and the exceptions
(ConnectError, ConnectTimeout, ReadTimeout, WriteTimeout, PoolTimeout, RemoteProtocolError,
ReadError), plus `InvalidUpstreamResponse` (a `RemoteProtocolError`) for an answer a proxy must
not relay: a head over `MAX_HEAD_BYTES` or `MAX_HEADERS`, a 101, a status outside 100-599. Closing a
response before its end resets the connection, so the backend sees the client leave; a completed
response returns its connection to the pool. Reading pauses while more than `HIGH_WATER` bytes
wait for a slow consumer, so backpressure reaches the backend.

A request is written at most once: a pooled connection the OS already reports closed or readable
while idle (EOF, or bytes nobody asked for) is dropped before writing, and a connection that
closes after the request went out fails the exchange (the caller counts it as an attempt and may
go elsewhere); it is never re-sent here.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import httptools
import httpx

from router.core.errors import InvalidUpstreamResponse, UpstreamTlsError
from router.core.netpolicy import NetPolicy, NetworkRefused
from router.core.tls import default_context

HIGH_WATER = 256 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
_LINGER_RESET = struct.pack("ii", 1, 0)


class _Conn(asyncio.Protocol):
    """One upstream connection; at most one exchange at a time."""

    def __init__(self, transport_owner: LeanTransport) -> None:
        self.owner = transport_owner
        self.transport: asyncio.Transport | None = None
        # The parser's body callback is the list's own `append` (bound before the parser reads
        # its callbacks): no Python call per chunk of a chunked body, the same list for the
        # connection's life (emptied in place).
        self.chunks: list[bytes] = []
        self.on_body: Callable[[bytes], None] = self.chunks.append
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.counted = True  # still counted against the owner's connection cap
        self.idle_since = 0.0
        self.last_rx = 0.0
        self._reset()

    def _reset(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0  # received before the final head completed, 1xx heads included
        self.head_size = 0  # names + values of the current head
        self.status = 0
        self.reusable = False
        self.headers_done: asyncio.Future[None] | None = None
        self.chunks.clear()
        self.buffered = 0  # bytes read since the consumer last took the body (framing counted)
        self.complete = False
        self.in_body = False  # between the final head and the end of the message
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        # Offered each read of the body while its consumer waits (`_Body.divert`): True when it
        # passed the bytes on itself, so the consumer is not woken for them.
        self.sink: Callable[[bytes], bool] | None = None
        self.paused = False
        self.write_waiter: asyncio.Future[None] | None = None
        self.write_paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if not self.in_body:
            self._data_outside_body(data)
            return
        # The hot path, once per upstream read of a body: no more work than parsing it.
        self.last_rx = time.monotonic()
        self.buffered += len(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._parse_failed(exc)
            return
        sink = self.sink
        waiter = self.waiter
        if sink is not None and waiter is not None and not self.complete and not waiter.done():
            # The consumer waits and was not woken, so everything before these bytes has been
            # passed on: the sink may pass them on too, in order, without waking its task.
            chunks = self.chunks
            if chunks and sink(chunks[0] if len(chunks) == 1 else b"".join(chunks)):
                chunks.clear()
                self.buffered = 0
                return
        self._wake()
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _data_outside_body(self, data: bytes) -> None:
        if self.headers_done is None or self.complete:
            # Bytes nobody asked for (idle, or after the response ended): this connection's
            # framing can no longer be trusted, so it carries nothing more.
            self.reusable = False
            self.close()
            return
        self.last_rx = time.monotonic()
        self.buffered += len(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._parse_failed(exc)
            return
        if not self.status:
            # Bounded however the head is sliced: the parser holds at most this much of it.
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._fail(InvalidUpstreamResponse("backend sent a response head over 64 KiB"))
                self.abort()
                return
        self._wake()
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _parse_failed(self, exc: Exception) -> None:
        cause = exc.__context__
        if isinstance(exc, httptools.HttpParserUpgrade):
            self._fail(InvalidUpstreamResponse("backend switched protocols (101)"))
        elif isinstance(cause, InvalidUpstreamResponse):
            self._fail(cause)
        else:
            self._fail(InvalidUpstreamResponse(f"malformed upstream response: {exc}"))
        self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and exc is None and self.status and self._delimited_by_close():
            self.complete = True
        if not self.complete:
            if exc is not None:
                self._fail(httpx.ReadError("connection to the backend was reset"))
            elif self.status:
                self._fail(
                    httpx.RemoteProtocolError(
                        "backend closed the connection before the response ended"
                    )
                )
            else:
                self._fail(httpx.RemoteProtocolError("backend closed the connection"))
        self._wake()
        if self.write_waiter is not None and not self.write_waiter.done():
            self.write_waiter.set_result(None)
        self.owner._lost(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.write_waiter is not None and not self.write_waiter.done():
            self.write_waiter.set_result(None)

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer in the same read: nobody asked for it
            raise InvalidUpstreamResponse("backend sent bytes after its response")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size += len(name) + len(value) + 4
        if len(self.headers) >= MAX_HEADERS:
            raise InvalidUpstreamResponse(f"backend sent more than {MAX_HEADERS} response headers")
        if self.head_size > MAX_HEAD_BYTES:
            raise InvalidUpstreamResponse("backend sent a response head over 64 KiB")
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status == 101 or not 100 <= status <= 599:
            raise InvalidUpstreamResponse(f"backend answered with status {status}")
        if status < 200:  # 1xx: informational, the real answer follows
            self.headers = []
            self.head_size = 0
            return
        self.status = status
        self.in_body = True
        # Read here: the parser's answer is only meaningful while this message is current.
        self.reusable = self.parser.should_keep_alive()
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_message_complete(self) -> None:
        if self.status:
            self.complete = True
            self.in_body = False

    # helpers
    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_exception(exc)
            self.headers_done.exception()  # mark retrieved: the caller may be gone

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection with a reset: the backend learns at once that nobody reads, and
        no TIME_WAIT is left behind on our side for every stream a client abandoned."""
        if self.transport is None or self.closed:
            return
        self.closed = True
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError, NotImplementedError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        self.transport.abort()

    def _delimited_by_close(self) -> bool:
        """A body with neither length nor chunking ends when the backend closes (HTTP/1.0)."""
        names = {k.lower() for k, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def keep_alive(self) -> bool:
        return self.complete and not self.closed and self.reusable


class _Body(httpx.AsyncByteStream):
    """The response body: each step returns everything buffered since the last one."""

    def __init__(self, conn: _Conn, read_timeout: float | None) -> None:
        self._conn = conn
        self._timeout = read_timeout
        self._done = False
        self._timer: asyncio.TimerHandle | None = None

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        while True:
            if conn.chunks:
                chunks = conn.chunks
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                conn.buffered = 0
                if conn.paused and conn.transport is not None:
                    conn.paused = False
                    conn.transport.resume_reading()
                return data
            if conn.complete:
                self._finish()
                raise StopAsyncIteration
            if conn.error is not None:
                self._finish()
                raise conn.error
            if self._done:
                raise StopAsyncIteration
            waiter = conn.waiter = asyncio.get_running_loop().create_future()
            if self._timeout is not None and self._timer is None:
                self._arm(self._timeout)
            try:
                await waiter
            except httpx.ReadTimeout:
                conn.close()
                self._finish()
                raise
            finally:
                conn.waiter = None

    def _arm(self, delay: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(delay, self._check_silence)

    def _check_silence(self) -> None:
        """One timer per response, re-armed only when it fires: no timer work per chunk."""
        self._timer = None
        if self._done or self._timeout is None:
            return
        silent = time.monotonic() - self._conn.last_rx
        if silent < self._timeout:
            self._arm(self._timeout - silent)
            return
        waiter = self._conn.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(httpx.ReadTimeout("backend sent nothing within the read timeout"))
        else:
            self._arm(self._timeout)

    def peer(self) -> str | None:
        """The connection's peer address, when known."""
        transport = self._conn.transport
        name = transport.get_extra_info("peername") if transport is not None else None
        return str(name[0]) if isinstance(name, tuple) and name else None

    def divert(self, sink: Callable[[bytes], bool] | None) -> None:
        """Offer each later read to `sink` first, while this body's consumer waits for one: the
        bytes it takes (returns True for) are not returned by `__anext__`."""
        if not self._done:
            self._conn.sink = sink

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._conn.sink = None  # the connection goes back to the pool: nothing of ours
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._conn.owner._release(self._conn)

    async def aclose(self) -> None:
        if not self._done:
            if not self._conn.complete:
                self._conn.abort()  # the consumer left early: stop the backend
            self._finish()


class Headers:
    """An answer's headers as they came (`raw`), with httpx's case-insensitive `get`."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode("latin-1")
        found = [v for k, v in self.raw if k.lower() == key]
        return b", ".join(found).decode("latin-1") if found else default


class Answer:
    """What `LeanTransport.send` returns: the parts of an `httpx.Response` the proxy reads (the
    status, the headers, the body's chunks, `aiter_raw`, `aclose`)."""

    __slots__ = ("headers", "status_code", "stream")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], stream: _Body) -> None:
        self.status_code = status
        self.headers = Headers(headers)
        self.stream = stream

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's chunks, then the connection released (as httpx's does)."""
        async for chunk in self.stream:
            yield chunk
        await self.stream.aclose()

    async def aclose(self) -> None:
        await self.stream.aclose()

    def peer(self) -> str | None:
        """The address the answer came from (its connection's peer), when known."""
        return self.stream.peer()


class Outgoing:
    """A request as this transport writes it: the URL it connects by, and its bytes, made once.

    What `httpx.Request` would send, without building one (its header normalisation, URL and
    stream wrapper were a fifth of the router's CPU per request): `Host` from the URL unless the
    caller gave one, the body's true `Content-Length`, no `Transfer-Encoding`, the caller's other
    headers in their order."""

    __slots__ = ("body", "head", "timeouts", "url")

    def __init__(
        self,
        method: str,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        timeouts: dict[str, float | None],
    ) -> None:
        self.url = url
        self.body = body
        self.timeouts = timeouts
        lines = [method.encode("ascii"), b" ", url.raw_path, b" HTTP/1.1\r\n", b""]
        has_host = False
        for k, v in headers:
            lk = k.lower()
            if lk in _WRITTEN_HERE:
                continue
            if lk == b"host":
                has_host = True
            lines += [k, b": ", v, b"\r\n"]
        if not has_host:
            lines[4] = b"Host: " + url.netloc + b"\r\n"
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        self.head = b"".join(lines)


_WRITTEN_HERE = frozenset({b"content-length", b"transfer-encoding"})


class LeanTransport(httpx.AsyncBaseTransport):
    """One host's connections: a LIFO stack of idle ones and a cap on how many exist."""

    def __init__(
        self,
        limits: httpx.Limits,
        ssl_context: ssl.SSLContext | None = None,
        policy: NetPolicy | None = None,
        server_name: str | None = None,
    ) -> None:
        # Backends added at run time: each new connection resolves the host, checks every
        # address against the policy and connects only to those (router/core/netpolicy.py).
        self._policy = policy
        self._max = limits.max_connections or 10**9
        self._max_idle = (
            limits.max_keepalive_connections
            if limits.max_keepalive_connections is not None
            else self._max
        )
        self._expiry = limits.keepalive_expiry
        self._idle: list[_Conn] = []
        self._count = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        # The backend's TLS policy (router/core/tls.py), shared with its probes and scrapes;
        # None: the process's default context, looked up at the first https connect.
        self._ssl = ssl_context
        self._server_name = server_name
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """httpx's transport interface: probes, scrapes and admin calls through an httpx client
        (the proxy's own exchanges go through `send`)."""
        timeouts: dict[str, float | None] = request.extensions.get("timeout", {})
        body = (
            request.content
            if isinstance(request.stream, httpx.ByteStream)
            else (await request.aread())
        )
        conn = await self._open(request.url, _request_head(request), body, timeouts)
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(conn, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def send(self, request: Outgoing) -> Answer:
        """An exchange built by `Pools.request`, answered by an `Answer` (an `httpx.Response`
        normalises its headers and builds its state: 9 us, measured)."""
        timeouts = request.timeouts
        conn = await self._open(request.url, request.head, request.body, timeouts)
        return Answer(conn.status, conn.headers, _Body(conn, timeouts.get("read")))

    async def _open(
        self, url: httpx.URL, head: bytes, body: bytes, timeouts: dict[str, float | None]
    ) -> _Conn:
        """A connection that has sent the request and read the answer's head."""
        conn = await self._acquire(url, timeouts)
        try:
            await self._exchange(conn, head, body, timeouts)
        except BaseException:
            # Written (or partly written) and failed, or cancelled because the client left:
            # never re-sent from here, the connection is dropped.
            conn.abort()
            self._release(conn)
            raise
        return conn

    async def _exchange(
        self, conn: _Conn, head: bytes, body: bytes, timeouts: dict[str, float | None]
    ) -> None:
        loop = asyncio.get_running_loop()
        conn._reset()
        conn.headers_done = loop.create_future()
        assert conn.transport is not None
        conn.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            conn.transport.write(body)
        if conn.write_paused:
            conn.write_waiter = loop.create_future()
            try:
                async with asyncio.timeout(timeouts.get("write")):
                    await conn.write_waiter
            except TimeoutError:
                raise httpx.WriteTimeout("could not send the request in time") from None
        if conn.error is not None:
            raise conn.error
        # A timer that fails the head's future, not `asyncio.timeout` (its context manager and
        # task cancellation cost ~1.8 us an exchange, measured).
        read = timeouts.get("read")
        timer = None if read is None else loop.call_later(read, _head_late, conn.headers_done)
        try:
            await conn.headers_done
        finally:
            if timer is not None:
                timer.cancel()

    async def _acquire(self, url: httpx.URL, timeouts: dict[str, float | None]) -> _Conn:
        now = time.monotonic()
        idle = self._idle
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if (self._expiry is not None and now - conn.idle_since > self._expiry) or _readable(
                conn
            ):
                conn.close()
                continue
            return conn
        if self._count >= self._max:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(timeouts.get("pool")):
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
            return await self._acquire(url, timeouts)
        self._count += 1
        try:
            return await self._connect(url, timeouts.get("connect"))
        except BaseException:
            self._count -= 1
            self._notify()
            raise

    async def _connect(self, url: httpx.URL, connect_timeout: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        secure = url.scheme == "https"
        if secure and self._ssl is None:
            self._ssl = default_context()
        port = url.port or (443 if secure else 80)
        try:
            async with asyncio.timeout(connect_timeout):
                if self._policy is None:
                    _, conn = await loop.create_connection(
                        lambda: _Conn(self),
                        url.host,
                        port,
                        ssl=self._ssl if secure else None,
                        server_hostname=(self._server_name or url.host) if secure else None,
                    )
                else:
                    conn = await self._connect_checked(url.host, port, secure)
        except TimeoutError:
            raise httpx.ConnectTimeout("could not connect to the backend in time") from None
        except NetworkRefused as exc:
            raise httpx.ConnectError(str(exc)) from None
        except ssl.SSLCertVerificationError as exc:
            raise UpstreamTlsError(
                f"the backend's TLS certificate was refused: {exc.verify_message}"
            ) from None
        except ssl.SSLError as exc:
            raise UpstreamTlsError(f"TLS with the backend failed: {exc.reason or exc}") from None
        except OSError as exc:
            raise httpx.ConnectError(f"could not connect to the backend: {exc.strerror}") from None
        return conn

    async def _connect_checked(self, host: str, port: int, secure: bool) -> _Conn:
        """Connect to an address of `host` the policy allows (the name is resolved once, here,
        so what is checked is what is connected to)."""
        assert self._policy is not None
        loop = asyncio.get_running_loop()
        last: OSError | None = None
        for address in await self._policy.addresses(host, port):
            try:
                _, conn = await loop.create_connection(
                    lambda: _Conn(self),
                    address,
                    port,
                    ssl=self._ssl if secure else None,
                    server_hostname=(self._server_name or host) if secure else None,
                )
                return conn
            except OSError as exc:
                last = exc
        raise last or OSError("no address to connect to")

    def _release(self, conn: _Conn) -> None:
        """The exchange on `conn` is over: keep it for the next request, or let it go."""
        if conn.keep_alive() and not self._closed and len(self._idle) < self._max_idle:
            conn.idle_since = time.monotonic()
            conn.headers_done = None
            self._idle.append(conn)
            self._notify()
            return
        conn.close()
        self._forget(conn)

    def _forget(self, conn: _Conn) -> None:
        if conn.counted:
            conn.counted = False
            self._count -= 1
            self._notify()

    def _lost(self, conn: _Conn) -> None:
        if conn in self._idle:
            self._idle.remove(conn)
        if conn.headers_done is None or conn.complete or conn.error is not None:
            # Not in an exchange any more (idle, or the exchange already failed/finished).
            self._forget(conn)

    def _notify(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def retire(self) -> None:
        """Take no new requests: idle connections close now, busy ones when their stream ends."""
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def aclose(self) -> None:
        self.retire()


def _head_late(head: asyncio.Future[None]) -> None:
    if not head.done():
        head.set_exception(httpx.ReadTimeout("backend sent no response headers in time"))


def _readable(conn: _Conn) -> bool:
    """An idle connection the OS reports readable has EOF or unasked bytes waiting: it cannot
    carry a request (one poll, no read; the event loop may not have seen it yet)."""
    transport = conn.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _request_head(request: httpx.Request) -> bytes:
    target = request.url.raw_path
    lines = [request.method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
    has_length = False
    for k, v in request.headers.raw:
        lk = k.lower()
        if lk == b"content-length":
            has_length = True
        if lk == b"transfer-encoding":
            continue
        lines += [k, b": ", v, b"\r\n"]
    if not has_length:
        lines.append(b"content-length: %d\r\n" % len(request.content))
    lines.append(b"\r\n")
    return b"".join(lines)
