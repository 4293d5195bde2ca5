"""A lean HTTP/1.1 load generator for the benchmark: raw asyncio protocols on uvloop.

Each virtual user holds one keep-alive connection and sends one pre-built request after another.
It records, per request, the time to the first body byte (the first token's chunk) and to the end
of the response. Parsing is the minimum needed to find those two instants, so the generator's
own CPU stays a small share of a core (it reports it, to prove it).
Loopback only: `host` must be a 127.0.0.0/8 address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import resource
import time
from dataclasses import dataclass, field


@dataclass
class Result:
    ttfb: list[float] = field(default_factory=list)  # seconds
    total: list[float] = field(default_factory=list)
    ok: int = 0
    errors: int = 0
    aborted: int = 0
    elapsed: float = 0.0
    cpu_s: float = 0.0


def build_request(
    host: str,
    port: int,
    path: str,
    body: bytes,
    extra: str = "",
    content_type: str = "application/json",
) -> bytes:
    """`extra`: more header lines, each ending in CRLF."""
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: {content_type}\r\n"
        f"{extra}content-length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Conn(asyncio.Protocol):
    """One keep-alive connection; completes `self.done` per response (or on close)."""

    def __init__(self, abort_after_chunks: int = 0) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.done: asyncio.Future[bool] | None = None
        self.first: float = 0.0
        self.in_body = False
        self.chunked = False
        self.length = -1
        self.status = 0
        self.body_bytes = 0
        self.chunks_seen = 0
        self.tail = b""
        self.abort_after = abort_after_chunks
        self.closed = asyncio.get_event_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, request: bytes) -> asyncio.Future[bool]:
        self.buf.clear()
        self.first = 0.0
        self.in_body = False
        self.length = -1
        self.body_bytes = 0
        self.chunks_seen = 0
        self.tail = b""
        self.done = asyncio.get_event_loop().create_future()
        assert self.transport is not None
        self.transport.write(request)
        return self.done

    def _finish(self, ok: bool) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(ok)

    def data_received(self, data: bytes) -> None:
        if not self.in_body:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).lower()
            self.status = int(head[9:12])
            self.chunked = b"transfer-encoding: chunked" in head
            if not self.chunked:
                i = head.find(b"content-length:")
                if i >= 0:
                    j = head.find(b"\r\n", i)
                    self.length = int(head[i + 15 : j if j > 0 else None])
            data = bytes(self.buf[end + 4 :])
            self.buf.clear()
            self.in_body = True
            if not data:
                return
        if not self.first:
            self.first = time.perf_counter()
        self.chunks_seen += 1
        if self.abort_after and self.chunks_seen >= self.abort_after:
            self.transport.close()  # type: ignore[union-attr]
            self._finish(False)
            return
        if self.chunked:
            # A chunked body ends with the zero-size chunk; the last 7 bytes are enough to see it.
            self.tail = (self.tail + data)[-7:]
            if self.tail.endswith(b"\r\n0\r\n\r\n") or self.tail == b"0\r\n\r\n":
                self._finish(self.status < 400)
        else:
            self.body_bytes += len(data)
            if self.length >= 0 and self.body_bytes >= self.length:
                self._finish(self.status < 400)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(False)
        if not self.closed.done():
            self.closed.set_result(None)


async def run_load(
    host: str,
    port: int,
    path: str,
    body: bytes,
    concurrency: int,
    duration: float = 0.0,
    requests: int = 0,
    abort_after_chunks: int = 0,
    request_timeout: float = 120.0,
    ramp: float = 0.0,
    extra_headers: str = "",
    content_type: str = "application/json",
    rate: float = 0.0,
) -> Result:
    """`concurrency` users until `requests` are done or `duration` seconds pass (bounded).

    With `rate` (requests per second) the requests start on a fixed schedule, each taken by
    whichever user is free (open loop, as long as `concurrency` users suffice for the rate):
    routers compared at one rate do the same work per second, whereas at one concurrency the
    faster one runs more requests per event-loop turn and so pays less per request."""
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError("the load generator only targets loopback addresses")
    if not duration and not requests:
        raise ValueError("give a duration or a request count")
    loop = asyncio.get_running_loop()
    req = build_request(host, port, path, body, extra_headers, content_type)
    res = Result()
    stop_at = time.perf_counter() + (duration or request_timeout)
    budget = [requests or 10**9]
    slot = [time.perf_counter()]  # when the next request is due (with `rate`)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)

    async def user(i: int) -> None:
        if ramp:
            # Users join over `ramp` seconds: a steady state, not one burst of connects.
            await asyncio.sleep(ramp * i / concurrency)
        conn: _Conn | None = None
        while budget[0] > 0 and time.perf_counter() < stop_at:
            budget[0] -= 1
            if rate:
                due = slot[0]
                slot[0] = due + 1.0 / rate
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                    if time.perf_counter() >= stop_at:
                        break
            if conn is None or conn.transport is None or conn.transport.is_closing():
                try:
                    _, conn = await loop.create_connection(
                        lambda: _Conn(abort_after_chunks), host, port
                    )
                except OSError:
                    res.errors += 1
                    await asyncio.sleep(0.05)
                    continue
            t0 = time.perf_counter()
            try:
                ok = await asyncio.wait_for(conn.start(req), request_timeout)
            except TimeoutError:
                ok = False
                conn.transport.close()  # type: ignore[union-attr]
            t1 = time.perf_counter()
            if conn.first:
                res.ttfb.append(conn.first - t0)
            if abort_after_chunks and not ok and conn.chunks_seen >= abort_after_chunks:
                res.aborted += 1
                conn = None
                continue
            if ok:
                res.ok += 1
                res.total.append(t1 - t0)
            else:
                res.errors += 1
                if conn.transport is not None:
                    conn.transport.close()
                conn = None
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    t_start = time.perf_counter()
    await asyncio.gather(*(user(i) for i in range(concurrency)))
    res.elapsed = time.perf_counter() - t_start
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    res.cpu_s = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return res
