"""The upstream transport on its own, against the raw-socket hostile backend: a pooled connection
the OS already reports closed or readable is not used, even before the event loop has noticed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from router.upstream.transport import Headers, LeanTransport, Outgoing
from tests.support.hostile_backend import HostileBackend
from tests.support.wait import wait_for

TIMEOUTS = httpx.Timeout(connect=2, read=5, write=2, pool=2).as_dict()


def _request(h: HostileBackend, mode: str, rid: str) -> httpx.Request:
    return httpx.Request(
        "POST",
        h.url + "/v1/chat/completions",
        headers={"x-request-id": rid, "content-type": "application/json"},
        content=json.dumps({"model": mode}).encode(),
        extensions={"timeout": TIMEOUTS},
    )


@pytest.mark.parametrize("mode", ["ok-then-close", "ok-then-junk"])
def test_stale_idle_connection_is_dropped_before_writing(
    hostile: HostileBackend, mode: str
) -> None:
    async def main() -> tuple[int, bytes]:
        transport = LeanTransport(httpx.Limits(max_connections=4, max_keepalive_connections=4))
        try:
            acts = hostile.idle_acts
            first = await transport.handle_async_request(_request(hostile, mode, f"t-{mode}-1"))
            await first.aread()
            assert first.status_code == 200
            # Block this loop (not the backend's): the backend closes or writes on the idle
            # connection, and only the OS knows; the loop has not read it yet.
            wait_for(
                lambda: hostile.idle_acts > acts, "the backend acted on the idle connection", 5
            )
            second = await transport.handle_async_request(_request(hostile, "ok", f"t-{mode}-2"))
            return second.status_code, await second.aread()
        finally:
            await transport.aclose()

    connections = hostile.connections
    status, body = asyncio.run(main())
    assert status == 200 and body.count(b"tok") == 3
    assert hostile.seen[f"t-{mode}-2"] == 1
    assert hostile.connections == connections + 2  # the stale one was replaced, not reused


def test_an_answer_reads_its_headers_as_httpx_does() -> None:
    """The proxy's `Answer` stands in for an `httpx.Response`: the same lookups, the same raw
    list (what goes back to the client)."""
    raw = [
        (b"Content-Type", b"text/event-stream"),
        (b"x-multi", b"a"),
        (b"X-Multi", b"b"),
        (b"retry-after", b"3"),
    ]
    ours, theirs = Headers(raw), httpx.Headers(raw)
    for name in ("content-type", "CONTENT-TYPE", "x-multi", "Retry-After", "absent"):
        assert ours.get(name) == theirs.get(name), name
    assert ours.get("absent", "identity") == theirs.get("absent", "identity") == "identity"
    assert ours.raw == theirs.raw


def test_a_diverted_body_passes_reads_to_the_sink_in_order_and_not_after_it_ends() -> None:
    """`_Body.divert`: each read that arrives while the consumer waits goes to the sink first;
    what the sink refuses reaches the consumer, in order; the connection goes back to the pool
    with no sink, so the next answer on it is read whole by its own consumer."""
    pieces = [b"data: one\n\n", b"data: two\n\n", b"data: REFUSED\n\n", b"data: four\n\n"]

    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        for _ in range(2):  # two requests on one kept-alive connection
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)  # the body: {}
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in pieces:
                await ready.wait()  # the consumer waits: this read is the sink's to take
                ready.clear()
                writer.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                await writer.drain()
            await ready.wait()  # the end alone: a read holding it goes to the consumer
            ready.clear()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        await reader.read()

    ready = asyncio.Event()

    async def main() -> tuple[list[bytes], list[bytes], list[bytes]]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        transport = LeanTransport(httpx.Limits(max_connections=1, max_keepalive_connections=1))
        sunk: list[bytes] = []
        order: list[bytes] = []

        def sink(data: bytes) -> bool:
            if b"REFUSED" in data:
                return False
            sunk.append(data)
            order.append(data)
            ready.set()  # the next piece may come: this one was taken
            return True

        async def read(divert: bool) -> list[bytes]:
            url = httpx.URL(f"http://127.0.0.1:{port}/")
            answer = await transport.send(Outgoing("POST", url, [], b"{}", TIMEOUTS))
            got: list[bytes] = []
            if divert:
                answer.stream.divert(sink)
            ready.set()
            async for chunk in answer.stream:
                got.append(chunk)
                order.append(chunk)
                ready.set()
            await answer.aclose()
            return got

        try:
            first = await read(divert=True)
            second = await read(divert=False)
        finally:
            await transport.aclose()
            server.close()
            await server.wait_closed()
        return first, second, order

    first, second, order = asyncio.run(asyncio.wait_for(main(), 20))
    assert first == [b"data: REFUSED\n\n"]
    assert order[:4] == pieces  # the sink's and the consumer's, as they came
    assert b"".join(second) == b"".join(pieces)  # no sink left on the reused connection
    assert len(connections) == 1
