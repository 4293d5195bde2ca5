"""The step of a declared model's request (`scale_from_zero`) that finds no ready backend: it
waits for one (router/request/admit/holding.py), then routes within the snapshot that brought it.

Without admission it waits in a plain per-model wait (`hold`). With admission it waits in the
admission queue (`QueueHold`): its ticket's deadline becomes the hold's, each try of the queue
finds no lease while the model has no ready backend (router/request/lifecycle/attempt.py), and
the first ready one wakes the queue; past the deadline the queue's timeout is answered as
`no_backend`.

A stream waits with its response head sent and `: waiting for a backend` comment lines every
`keepalive_s` (the first after that long: a hold that ends sooner still answers a plain 503),
so that proxies and clients do not time it out; SSE clients skip comment lines. Its answer then
continues that stream (the attempt sees the head sent, as for a migration), and a refusal after
the head is an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from starlette.datastructures import Headers
from starlette.types import Send

from router.request.admit.admission import timeout_of
from router.request.admit.holding import Demand
from router.request.lifecycle.call import Call
from router.request.lifecycle.parts import Parts

WAITING = b": waiting for a backend\n\n"
_HEAD = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


def hold_for(parts: Parts, call: Call) -> float:
    """Seconds the request may be held: `hold_timeout_s`, or its own `x-sluicegate-timeout`
    when shorter (a bad one is a `BadRequest`)."""
    own = timeout_of(Headers(raw=call.client_headers), call.record.request_id)
    limit = parts.holding.cfg.hold_timeout_s
    return limit if own is None else min(own, limit)


def _keepalive(call: Call, send: Send) -> Callable[[], Awaitable[None]]:
    rec = call.record

    async def keepalive() -> None:
        if not call.started:
            headers = [*_HEAD, (b"x-request-id", rec.request_id.encode())]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            call.started = True
            rec.status = 200
        await send({"type": "http.response.body", "body": WAITING, "more_body": True})

    return keepalive


async def hold(parts: Parts, call: Call, send: Send) -> None:
    """Wait until the model has a ready backend (or raise `NoBackend`, `TooManyHeld`), then bind
    the call to the registry's snapshot now."""
    keepalive = _keepalive(call, send) if call.stream else None
    await parts.holding.hold(call.model, hold_for(parts, call), keepalive)
    call.rebind(parts, parts.registry.snapshot)


class QueueHold:
    """A held request's wait in the admission queue: its count among the model's held requests
    and, for a stream, the keep-alive comments, until `end`."""

    def __init__(self, parts: Parts, call: Call, send: Send, within: float) -> None:
        self.parts = parts
        self.call = call
        self.within = within
        self._demand: Demand | None = parts.holding.enter(call.model)  # TooManyHeld past it
        assert call.ticket is not None
        # The queue's deadline is the hold's (request clock, as the ticket's own).
        call.ticket.deadline = call.record.started + within
        call.ticket.deadline_reason = "deadline"
        self._beats: asyncio.Task[None] | None = None
        self.flying: Demand | None = None  # counted in flight since the hold ended ready
        if call.stream:
            self._beats = asyncio.ensure_future(self._beat(_keepalive(call, send)))
        call.held = self

    async def _beat(self, keepalive: Callable[[], Awaitable[None]]) -> None:
        sleep = self.parts.holding.clock.sleep
        every = self.parts.holding.cfg.keepalive_s
        while True:
            await sleep(every)
            await keepalive()

    async def end(self, ready: bool = True) -> None:
        """The wait is over: a backend is ready (`ready`: the request is in flight from now,
        routed within the snapshot now), or the request leaves. The keep-alive stops before
        anything else is sent."""
        call = self.call
        call.held = None
        beats, self._beats = self._beats, None
        if beats is not None:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        holding = self.parts.holding
        demand, self._demand = self._demand, None
        if demand is not None:
            holding.leave(demand, call.model)
            if ready:
                holding.begin(demand, call.model)
                self.flying = demand
        if ready:
            call.rebind(self.parts, self.parts.registry.snapshot)

    def landed(self) -> None:
        """The request ended: out of its model's in-flight count if the hold ended ready."""
        flying, self.flying = self.flying, None
        if flying is not None:
            self.parts.holding.end(flying, self.call.model)
