"""The floor under the hop: a raw ASGI pass-through with nothing of sluicegate in it.

    HOP_FLOOR_UPSTREAM=http://127.0.0.1:PORT uvicorn bench.kit.hop_floor:app --loop uvloop \
        --http httptools --no-access-log

uvicorn with uvloop and httptools, and the router's upstream stack (router/upstream/transport.py)
under the request the router would build: what a Python proxy on this stack costs before it does
anything of its own (no validation, routing, leases, disconnect watcher, usage, metrics, log line).
bench/scenarios/hop.py runs it beside nginx and sluicegate.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from router.upstream.transport import LeanTransport, Outgoing

_UP = os.environ.get("HOP_FLOOR_UPSTREAM", "http://127.0.0.1:1")
_TRANSPORT = LeanTransport(httpx.Limits(max_connections=1000, max_keepalive_connections=1000))
_TIMEOUT: dict[str, float | None] = {"connect": 5.0, "read": 60.0, "write": 10.0, "pool": 10.0}
_URLS: dict[str, httpx.URL] = {}
_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    url = _URLS.get(scope["path"])
    if url is None:
        url = _URLS[scope["path"]] = httpx.URL(_UP + scope["path"])
    request = Outgoing("POST", url, [(b"content-type", b"application/json")], body, _TIMEOUT)
    response = await _TRANSPORT.send(request)
    try:
        await send(
            {"type": "http.response.start", "status": response.status_code, "headers": _HEADERS}
        )
        async for chunk in response.stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await response.aclose()
