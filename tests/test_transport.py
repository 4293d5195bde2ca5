"""The upstream transport on its own, against the raw-socket hostile backend: a pooled connection
the OS already reports closed or readable is not used, even before the event loop has noticed."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from router.upstream.transport import Headers, LeanTransport
from tests.hostile_backend import HostileBackend

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
            first = await transport.handle_async_request(_request(hostile, mode, f"t-{mode}-1"))
            await first.aread()
            assert first.status_code == 200
            # Block this loop (not the backend's): the backend closes or writes on the idle
            # connection, and only the OS knows; the loop has not read it yet.
            time.sleep(0.3)  # noqa: ASYNC251 - blocking on purpose, see above
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
