"""The request lifecycle, as the order of its steps; each step is a module of its own.

    getting_in   drain, hop, validation, estimate, admission ticket, quota reservation
    watch        the lifecycle runs as a task the client's leaving cancels
    hold         a declared model with no ready backend yet: wait for its first one
    attempt      pick -> lease -> (prefill_leg) -> upstream -> pump; again on another
                 backend while nothing reached the client (Failover)
    migrate      a stream that broke after it began goes on elsewhere
    fallback     a request its model cannot serve goes on as its fallback model's
    account      tokens, quota and admission corrected, usage book, log line, metrics, span

What a step takes it gives back itself, in reverse order, also on error and cancel; here only
the drain count (taken around the task) and getting in's holds (closed with the tokens used).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Set
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from router.core.endpoints import BY_ROUTE, Endpoint
from router.core.errors import (
    BadRequest,
    FallbackReason,
    NoCapacity,
    ProxyError,
    answer,
    sse_error_event,
)
from router.request.admit.admission import QueueTimeout
from router.request.admit.holding import Demand, no_backend
from router.request.admit.quota import KeyLimits
from router.request.lifecycle import account
from router.request.lifecycle.attempt import attempts_for
from router.request.lifecycle.call import Call
from router.request.lifecycle.endings import Broken, NoneLeft, Refusal, Retry
from router.request.lifecycle.fallback import MODEL_HEADER, answer_whole, fall_back, moved
from router.request.lifecycle.getting_in import get_in, let_go
from router.request.lifecycle.hold import QueueHold, hold, hold_for
from router.request.lifecycle.migrate import Again, carry_on
from router.request.lifecycle.parts import Parts
from router.request.lifecycle.watch import run_watched
from router.request.placement.fallbacks import context_limit, too_long
from router.request.placement.response_ids import ANONYMOUS
from router.request.placement.slo import NO_SLO, Slo

CHAT = BY_ROUTE[("POST", "/v1/chat/completions")]


class Proxy(Parts):
    """The parts every request uses; `prepare` gets a request in and hands it its lifecycle."""

    async def prepare(
        self,
        request: Request,
        endpoint: Endpoint = CHAT,
        allowed_models: Set[str] | None = None,
        key_name: str | None = None,
        priority: str = "standard",
        weight: float = 1.0,
        limits: KeyLimits | None = None,
        response_id: str | None = None,
        owner: str = ANONYMOUS,
        fallbacks: bool = True,
        slo: Slo = NO_SLO,
    ) -> ProxyCall:
        """`endpoint`: its row (`router/core/endpoints.py`); `allowed_models`: the public names
        the client's key may use (None: any); `priority`, `weight`: the key's admission band
        and share; `response_id`: the id in the path of an endpoint that follows a stored
        response; `owner`: the key's tag on the stored responses it makes and may reach
        (router/request/placement/response_ids.py); `fallbacks` False: the key's entry turned
        model fallbacks off; `slo`: the key's default objectives. A request that may not get in
        raises a `Refused`, which the web face answers in the endpoint's format; a `ProxyCall`
        answers its own `ProxyError` with the same `answer()`."""
        call = await get_in(
            self,
            request,
            endpoint,
            allowed_models,
            key_name,
            priority,
            weight,
            limits,
            response_id,
            owner,
            fallbacks,
            slo,
        )
        return ProxyCall(self, call)


class ProxyCall(Response):
    """An ASGI response that runs the lifecycle of a request that got in."""

    def __init__(self, parts: Parts, call: Call) -> None:
        self.background = None
        self.status_code = 200
        self.parts = parts
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        parts = self.parts
        call = self.call
        try:
            call.trace = parts.tracing.begin(call.client_headers, call.record)
            parts.lifecycle.enter()
            try:
                await run_watched(self._run(send), scope, receive, call.record)
            finally:
                parts.lifecycle.leave()
        finally:
            settle(parts, call)

    async def _run(self, send: Send) -> None:
        call = self.call
        try:
            # A declared model's (scale_from_zero) only; any other pays this one dict miss.
            demand = self.parts.holding.models.get(call.model)
            if demand is None:
                await self._attempts(send)
            else:
                await self._declared(send, demand)
        except (ProxyError, BadRequest) as exc:
            rec = call.record
            rec.status = exc.status
            rec.error = exc.code
            exc.request_id = rec.request_id
            if call.started:  # a held stream has its head: the refusal is its last event
                body = sse_error_event(str(exc), exc.type_ or "", exc.code or "", call.anthropic)
                await send({"type": "http.response.body", "body": body})
                return
            model = (MODEL_HEADER, call.model.encode())

            async def with_model(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message["headers"], model]}
                await send(message)

            await answer(exc, call.anthropic)({"type": "http"}, _no_receive, with_model)

    async def _declared(self, send: Send, demand: Demand) -> None:
        """A declared model's request: held while no backend is ready (in the admission queue
        when there is one), then counted in its model's demand while it is served."""
        parts = self.parts
        holding = parts.holding
        call = self.call
        model = call.model
        if holding.needs_hold(model):
            if call.ticket is None:
                await hold(parts, call, send)
            else:
                await self._held_in_queue(send)
                return
        elif not call.backends:  # its first backend came between getting in and here
            call.rebind(parts, parts.registry.snapshot)
        holding.begin(demand, model)
        try:
            await self._attempts(send)
        finally:
            holding.end(demand, model)

    async def _held_in_queue(self, send: Send) -> None:
        parts = self.parts
        call = self.call
        held = QueueHold(parts, call, send, hold_for(parts, call))
        try:
            await self._attempts(send)
        except QueueTimeout:
            if call.held is None:
                raise  # it had a backend, and no room on it within its deadline
            raise no_backend(call.model, held.within) from None
        finally:
            if call.held is not None:
                await held.end(ready=False)
            held.landed()

    async def _attempts(self, send: Send) -> None:
        parts = self.parts
        call = self.call
        route = call.fallback
        if route is not None and route.chains.context_window is not None:
            await self._fits()
        while True:
            attempts = await attempts_for(parts, call, send)
            try:
                try:
                    await parts.failover.run(attempts)
                except Broken as broken:
                    elsewhere = self._elsewhere(send) if route is not None else None
                    await carry_on(
                        parts, call, send, broken, attempts.again, attempts.exclude, elsewhere
                    )
            # attempts, deadline, budget or backends ran out; or the admission queue's
            # wait did (a NoCapacity)
            except (Retry, NoneLeft, NoCapacity) as ended:
                if isinstance(ended, NoCapacity) or not await attempts.resend_whole():
                    if fall_back(parts, call, FallbackReason.ERROR):
                        continue
                    if isinstance(ended, NoCapacity):
                        raise
                    await attempts.give_up()
            except Refusal as refusal:  # a context-window or content-policy refusal
                if fall_back(parts, call, refusal.reason):
                    continue
                await answer_whole(call, send, refusal.response)
            return

    async def _fits(self) -> None:
        """The context-window check before the call: a prompt its model's engines cannot take
        goes to the model's context-window fallback at once. The prompt is counted by its
        model's tokenizer where it has one (a round trip with `via: engine`), else it counts
        as 0: only `max_tokens` is checked, and the engine's own 400 decides after the call."""
        parts = self.parts
        call = self.call
        if parts.readings is None:
            return
        limit = context_limit(call.backends, parts.readings())
        if limit is None:
            return
        payload = call.parsed()
        prompt = 0
        if parts.affinity.counts(call.model):
            eligible = parts.health.eligible(call.backends, call.model)
            prompt = await parts.affinity.prompt_tokens(call.model, payload, eligible) or 0
        if too_long(prompt, payload, limit):
            fall_back(parts, call, FallbackReason.CONTEXT_WINDOW)

    def _elsewhere(self, send: Send) -> Callable[[], Awaitable[Again | None]]:
        """For a broken stream none of its model's engines continued: its next fallback model's
        attempts (None: no model is left, or its chain says `mid_stream: error`)."""
        parts = self.parts
        call = self.call

        async def elsewhere() -> Again | None:
            route = call.fallback
            assert route is not None
            target = route.next(
                FallbackReason.MID_STREAM, call.snapshot.by_model, call.endpoint.errors
            )
            if target is None:
                return None
            moved(parts, call, target, FallbackReason.MID_STREAM)
            attempts = await attempts_for(parts, call, send)
            if call.plan is not None and call.plan.skip_openai:
                attempts.exclude.update(b.name for b in call.backends if b.kind == "openai")
            return attempts.again

        return elsewhere


def settle(parts: Parts, call: Call) -> None:
    """A request's end, however it ended: its tokens charged, getting in's holds closed with
    them, the usage booked and the log line, metrics and span emitted (also the endpoint
    picker's, router/picker/)."""
    used = account.tokens(call)
    charged = account.charged(call, used)
    let_go(parts, call, charged)
    if call.stored_id is not None:  # what a request continuing it will carry along
        parts.response_ids.sized(call.stored_id, call.owner, math.ceil(charged))
    account.book(parts, call, used)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}
