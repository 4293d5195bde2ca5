"""The request lifecycle, as the order of its steps; each step is a module of its own.

    getting_in   drain, hop, validation, estimate, admission ticket, quota reservation
    watch        the lifecycle runs as a task the client's leaving cancels
    attempt      pick -> lease -> (prefill_leg) -> upstream -> pump; again on another
                 backend while nothing reached the client (Failover)
    migrate      a stream that broke after it began goes on elsewhere
    account      tokens, quota and admission corrected, usage book, log line, metrics, span

What a step takes it gives back itself, in reverse order, also on error and cancel; here only
the drain count (taken around the task) and getting in's holds (closed with the tokens used).
"""

from __future__ import annotations

import math
from collections.abc import Set
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.core.endpoints import BY_ROUTE, Endpoint
from router.core.errors import ProxyError, answer
from router.request.admit.quota import KeyLimits
from router.request.lifecycle import account
from router.request.lifecycle.attempt import attempts_for
from router.request.lifecycle.call import Call
from router.request.lifecycle.endings import Broken, NoneLeft, Retry
from router.request.lifecycle.getting_in import get_in, let_go
from router.request.lifecycle.migrate import carry_on
from router.request.lifecycle.parts import Parts
from router.request.lifecycle.watch import run_watched
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
        slo: Slo = NO_SLO,
    ) -> ProxyCall:
        """`endpoint`: its row (`router/core/endpoints.py`); `allowed_models`: the public names
        the client's key may use (None: any); `priority`, `weight`: the key's admission band
        and share; `response_id`: the id in the path of an endpoint that follows a stored
        response; `owner`: the key's tag on the stored responses it makes and may reach
        (router/request/placement/response_ids.py); `slo`: the key's default objectives. A
        request that may not get in raises a `Refused`, which the web face answers in the
        endpoint's format; a `ProxyCall` answers its own `ProxyError` with the same `answer()`."""
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
            used = account.tokens(call)
            charged = account.charged(call, used)
            let_go(parts, call, charged)
            if call.stored_id is not None:  # what a request continuing it will carry along
                parts.response_ids.sized(call.stored_id, call.owner, math.ceil(charged))
            account.book(parts, call, used)

    async def _run(self, send: Send) -> None:
        parts = self.parts
        call = self.call
        attempts = await attempts_for(parts, call, send)
        try:
            try:
                try:
                    await parts.failover.run(attempts)
                except Broken as broken:
                    await carry_on(parts, call, send, broken, attempts.again, attempts.exclude)
            except (Retry, NoneLeft):  # attempts, deadline, budget or backends ran out
                if not await attempts.resend_whole():
                    await attempts.give_up()
        except ProxyError as exc:
            rec = call.record
            rec.status = exc.status
            rec.error = exc.code
            exc.request_id = rec.request_id
            await answer(exc, call.anthropic)({"type": "http"}, _no_receive, send)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}
