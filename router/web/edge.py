"""Client connection limits: uvicorn's httptools protocol with a header timeout and a connection
cap, and the process's file-descriptor limit.

- `header_timeout`: a request whose head (request line and headers) is not complete this many
  seconds after its first byte, or after the connection opened, is closed. uvicorn times out
  only idle keep-alive connections (`keepalive_timeout`), so an idle fresh socket or a slowloris
  client would otherwise hold a file descriptor for ever.
- `body_timeout`: a request body not complete this many seconds after its head is answered
  408 and its connection closed (or only closed, when the answer has begun). Without it a body
  that stops short holds its connection and every byte read so far for ever.
- `max_connections` (per worker process): a connection past the cap is answered with a short 503
  and closed at once, before anything is read. uvicorn's own `limit_concurrency` is not used: it
  still accepts and parses, and answers 503 to requests on connections already open whenever
  the count is over.
- `raise_fd_limit()`: soft RLIMIT_NOFILE up to the hard limit, and a warning when it cannot hold
  the client connections plus the backend pools.

Cost on the request path: a set-size check per new connection, and a timer armed and cancelled
per request only when its head or its body takes more than one read.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from router.core.client_link import BODY_WRITE, ON_CLIENT_LOST
from router.core.endpoints import ANTHROPIC_PATHS
from router.core.errors import anthropic_payload, error_payload

log = logging.getLogger("sluicegate.app")


def _closing_answer(status: bytes, body: bytes, extra: bytes = b"") -> bytes:
    """A whole answer, written to the transport before it is closed."""
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: "
        + str(len(body)).encode()
        + b"\r\n"
        + extra
        + b"connection: close\r\n\r\n"
        + body
    )


REFUSAL = _closing_answer(
    b"503 Service Unavailable",
    error_payload(
        "The router has too many open connections; retry shortly.",
        "api_error",
        "too_many_connections",
    ),
    b"retry-after: 1\r\n",
)


_SLOW_MESSAGE = "The request body did not arrive in time (server.body_timeout)."
SLOW_BODY = _closing_answer(
    b"408 Request Timeout",
    error_payload(_SLOW_MESSAGE, "invalid_request_error", "request_timeout"),
)
# The Messages API's clients read Anthropic's error shape (`answer()`'s type for a 4xx).
SLOW_BODY_ANTHROPIC = _closing_answer(
    b"408 Request Timeout", anthropic_payload(_SLOW_MESSAGE, "invalid_request_error")
)


class EdgeProtocol(HttpToolsProtocol):
    def __init__(
        self,
        *args: Any,
        header_timeout: float,
        max_connections: int,
        body_timeout: float = 30.0,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self._header_timeout = header_timeout
        self._body_timeout = body_timeout
        self._max_connections = max_connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._on_lost: Callable[[], None] | None = None  # ON_CLIENT_LOST's registration
        self._lost = False  # the connection is gone (a registration after it is told at once)
        self._watch = self._when_lost  # ON_CLIENT_LOST, bound once per connection
        # A head begun and not ended, a body begun and not ended, as of the parser's last call:
        # their timers are armed after the read that left them open, so a request that comes
        # whole in one read (most do) arms and cancels none.
        self._head_open = False
        self._body_open = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._max_connections:
            transport.write(REFUSAL)
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._header_timeout, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open = True  # the next request on a kept-alive connection: the same limit

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_open:
            self._arm()
        elif self._body_open and self._body_timer is None:
            # Measured from the head: a body trickled byte by byte gets no more time than a
            # silent one.
            self._body_timer = self.loop.call_later(self._body_timeout, self._body_too_slow)

    def _body_too_slow(self) -> None:
        self._body_timer = None
        transport = self.transport
        if transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            anthropic = cycle is not None and cycle.scope["path"] in ANTHROPIC_PATHS
            # the app, still reading, sees the client gone
            transport.write(SLOW_BODY_ANTHROPIC if anthropic else SLOW_BODY)
        transport.close()

    def on_headers_complete(self) -> None:
        self._head_open = False
        self._disarm()
        self._body_open = True
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade: a request cycle
            # Its ASGI task has not run yet: the extension is in the scope it will read.
            scope: dict[str, Any] = self.scope  # type: ignore[assignment]
            extensions = scope.setdefault("extensions", {})
            extensions[BODY_WRITE] = BodyWriter(cycle).write
            extensions[ON_CLIENT_LOST] = self._watch

    def on_message_complete(self) -> None:
        self._body_open = False
        timer = self._body_timer
        if timer is not None:
            timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().connection_lost(exc)
        self._lost = True
        lost = self._on_lost
        if lost is not None:
            self._on_lost = None
            lost()

    def _when_lost(self, callback: Callable[[], None], watching: bool) -> None:
        """ON_CLIENT_LOST: the request being served registers what to call when the client's
        connection is lost, and unregisters it (only if still its own: a pipelined request's
        may have replaced it). A request whose client left before it registered (while its quota
        was checked) is told on the loop's next turn, once its task waits: a cancel then lands
        on what it waits for."""
        if watching:
            self._on_lost = callback
            if self._lost:
                self.loop.call_soon(self._tell, callback)
        elif self._on_lost is callback:
            self._on_lost = None

    def _tell(self, callback: Callable[[], None]) -> None:
        if self._on_lost is callback:  # not unregistered meanwhile
            self._on_lost = None
            callback()


class BodyWriter:
    """`BODY_WRITE` for one request of a uvicorn httptools connection: its cycle's own framing
    and state, written to the transport without the `send` coroutine. The cycle is held weakly:
    its scope holds this writer, and a reference cycle per request would outlive the request
    until the collector's next walk."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = weakref.ref(cycle)

    def write(self, chunk: bytes) -> bool:
        cycle = self.cycle()
        if (
            cycle is None
            or cycle.flow.write_paused
            or cycle.disconnected
            or cycle.response_complete
            or not cycle.response_started
            or not cycle.chunked_encoding
            or not chunk
        ):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True


def protocol(header_timeout: float, max_connections: int, body_timeout: float = 30.0) -> Any:
    """What to give uvicorn as `http=`: picklable, so it reaches every worker process."""
    return partial(
        EdgeProtocol,
        header_timeout=header_timeout,
        max_connections=max_connections,
        body_timeout=body_timeout,
    )


def raise_fd_limit(needed: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; warn when it is below `needed`.
    Returns (soft, hard) afterwards."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
    if soft != target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning(
            "file descriptor limit is below what the settings can use",
            extra={"fields": {"nofile": soft, "needed": needed}},
        )
    return soft, hard
