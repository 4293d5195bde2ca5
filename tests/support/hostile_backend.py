"""A backend that misbehaves on purpose, on a raw socket: the request's `model` picks how.

It runs an asyncio server on a loopback port in a thread of the test process, so tests read what
it saw directly: every request id it received (`seen`), per connection. `GET /health` answers 200.
Modes (the `model` of a POST; unknown names behave like `ok`):

    ok            a short SSE stream (chunked), connection kept alive
    close         reads the whole request, then closes without a byte of answer
    ok-then-close answers like `ok`, then closes the idle connection shortly after
    ok-then-junk  answers like `ok`, then writes part of a stray response on the idle connection
    head-flood    a status line, then headers without end (until the peer drops it, or 8 MB)
    many-headers  a complete head with 101 headers
    hundred       a complete head with exactly 100 headers (the most a router should take)
    early-hints   a `103 Early Hints` head, then the answer of `ok`
    big-head      a complete head of about 80 KiB in 3 headers
    status-600    `HTTP/1.1 600 Weird`, a small body
    status-101    `HTTP/1.1 101 Switching Protocols`
    short-stream  an SSE stream declaring Content-Length 4000, sending ~200 bytes, then closing
    slow-stream   one SSE event every 20 ms, 200 of them (for clients that leave)

It does not model a real engine (see `router/tools/mock/upstream.py` for that): only the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections import Counter
from typing import Any

SSE_EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'


class HostileBackend:
    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()  # request id -> times received
        self.connections = 0
        self.open = 0
        self.dropped_floods = 0  # head-flood connections the peer cut
        self.idle_acts = 0  # ok-then-close/-junk: closes and stray writes done on idle connections
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HostileBackend:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("hostile backend did not start")
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                method, headers, body = request
                if method == "GET":
                    writer.write(_response(200, b'{"ok":true}', b"application/json"))
                    await writer.drain()
                    continue
                rid = headers.get("x-request-id", "")
                self.seen[rid] += 1
                try:
                    mode = str(json.loads(body).get("model", "ok"))
                except ValueError:
                    mode = "ok"
                if not await self._answer(mode, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self.open -= 1
            writer.close()

    async def _answer(
        self, mode: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer one request; False: the connection ends here."""
        if mode == "close":
            return False
        if mode == "head-flood":
            writer.write(b"HTTP/1.1 200 OK\r\n")
            try:
                for i in range(200_000):  # ~8 MB at most
                    if writer.transport.is_closing():
                        raise ConnectionResetError
                    writer.write(b"x-flood-%06d: %s\r\n" % (i, b"v" * 24))
                    if i % 100 == 0:
                        await asyncio.wait_for(writer.drain(), 5)
            except (ConnectionError, TimeoutError):
                self.dropped_floods += 1
            return False
        if mode == "many-headers":
            extra = b"".join(b"x-h%03d: v\r\n" % i for i in range(101))
            writer.write(b"HTTP/1.1 200 OK\r\n" + extra + b"content-length: 2\r\n\r\n{}")
        elif mode == "hundred":
            extra = b"".join(b"x-h%03d: v\r\n" % i for i in range(98))
            writer.write(
                b"HTTP/1.1 200 OK\r\n"
                + extra
                + b"content-type: text/plain\r\ncontent-length: 2\r\n\r\nhi"
            )
        elif mode == "early-hints":
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>; rel=preload\r\n\r\n")
            await writer.drain()
            events = SSE_EVENT * 3 + b"data: [DONE]\n\n"
            writer.write(_chunked_head() + _chunk(events) + b"0\r\n\r\n")
        elif mode == "big-head":
            extra = b"".join(b"x-big%d: %s\r\n" % (i, b"v" * 27000) for i in range(3))
            writer.write(b"HTTP/1.1 200 OK\r\n" + extra + b"content-length: 2\r\n\r\n{}")
        elif mode == "status-600":
            writer.write(b"HTTP/1.1 600 Weird\r\ncontent-length: 2\r\n\r\n{}")
        elif mode == "status-101":
            writer.write(
                b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
                b"connection: upgrade\r\n\r\n"
            )
        elif mode == "short-stream":
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"content-length: 4000\r\n\r\n" + SSE_EVENT * 4
            )
            await writer.drain()
            return False
        elif mode == "slow-stream":
            writer.write(_chunked_head())
            for _ in range(200):
                writer.write(_chunk(SSE_EVENT))
                await writer.drain()
                await asyncio.sleep(0.02)
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            events = SSE_EVENT * 3 + b"data: [DONE]\n\n"
            writer.write(_chunked_head() + _chunk(events) + b"0\r\n\r\n")
        await writer.drain()
        if mode in ("many-headers", "big-head", "status-600", "status-101"):
            await _wait_closed(reader)  # the router must be the one to drop it
            return False
        if mode == "ok-then-close":
            await asyncio.sleep(0.05)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            self.idle_acts += 1  # closed: the peer's OS has the FIN
            return False
        if mode == "ok-then-junk":
            # A head and part of a body nobody asked for; then it serves on as if all was well.
            await asyncio.sleep(0.05)
            writer.write(b'HTTP/1.1 200 X\r\ncontent-length: 40\r\n\r\n{"stale":true}')
            await writer.drain()
            self.idle_acts += 1
        return True


async def _wait_closed(reader: asyncio.StreamReader) -> None:
    try:
        await asyncio.wait_for(reader.read(65536), 10)
    except (TimeoutError, ConnectionError):
        pass


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    method = lines[0].split(" ", 1)[0]
    headers: dict[str, Any] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, headers, body


def _response(status: int, body: bytes, ctype: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (
        status,
        ctype,
        len(body),
        body,
    )


def _chunked_head() -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
