"""The step of a declared model's request (`scale_from_zero`) that finds no ready backend: it
waits for one (router/request/admit/holding.py), then routes within the snapshot that brought it.

A stream waits with its response head sent and `: waiting for a backend` comment lines every
`keepalive_s` (the first after that long: a hold that ends sooner still answers a plain 503),
so that proxies and clients do not time it out; SSE clients skip comment lines. Its answer then
continues that stream (the attempt sees the head sent, as for a migration), and a refusal after
the head is an error event.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import Send

from router.request.admit.admission import timeout_of
from router.request.lifecycle.call import Call
from router.request.lifecycle.parts import Parts

WAITING = b": waiting for a backend\n\n"
_HEAD = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def hold(parts: Parts, call: Call, send: Send) -> None:
    """Wait until the model has a ready backend (or raise `NoBackend`, `TooManyHeld`), then bind
    the call to the registry's snapshot now."""
    holding = parts.holding
    rec = call.record
    own = timeout_of(Headers(raw=call.client_headers), rec.request_id)  # may be a BadRequest
    timeout = holding.cfg.hold_timeout_s if own is None else min(own, holding.cfg.hold_timeout_s)

    async def keepalive() -> None:
        if not call.started:
            headers = [*_HEAD, (b"x-request-id", rec.request_id.encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            call.started = True
            rec.status = 200
        await send({"type": "http.response.body", "body": WAITING, "more_body": True})

    await holding.hold(call.model, timeout, len(call.body), keepalive if call.stream else None)
    call.rebind(parts, parts.registry.snapshot)
