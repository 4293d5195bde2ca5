"""One request as it goes through the lifecycle's steps: what the client asked, fixed when it
got in, and how far it got (answer started, backend working, migrations, text relayed).

Built by router/request/lifecycle/getting_in.py; each later step reads it and records its progress
here, so no step reaches into another's locals. What the request's model routes to is decided
here, once, on the one registry snapshot the request keeps: its backends (a split model's
decode pool), the P/D pools, the LoRA adapter routed by base, the balancer, the migration plan.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from starlette.requests import Request

from router.core.backend import Backend
from router.core.client_link import body_write
from router.core.endpoints import Endpoint
from router.core.fastjson import with_member
from router.ops.tracing import NO_TRACE, RequestTrace
from router.registry.fleet import Snapshot
from router.request.admit.admission import Ticket
from router.request.admit.quota import Hold
from router.request.lifecycle.parts import Parts
from router.request.migration.policy import SHAPES, Plan
from router.request.migration.stitch import Stitch
from router.request.placement.fallbacks import Route
from router.request.placement.pd import RolePools, client_body
from router.request.placement.response_ids import ANONYMOUS
from router.request.placement.slo import NO_SLO, Slo
from router.request.usage.record import RequestRecord
from router.request.usage.strip import inject, needs_injection, with_usage
from router.request.wire.multipart import replace_span


class Held(Protocol):
    """A declared model's request held in the admission queue (router/request/lifecycle/hold.py)."""

    within: float

    async def end(self) -> None: ...


class Call:
    __slots__ = (
        "_injected",
        "adapter",
        "anthropic",
        "backends",
        "balancer",
        "body",
        "body_write",
        "broke",
        "carried",
        "client_headers",
        "continuation",
        "endpoint",
        "estimate",
        "fallback",
        "head",
        "held",
        "held_bytes",
        "hop",
        "inject",
        "method",
        "migrations",
        "model",
        "model_span",
        "owner",
        "path",
        "payload",
        "plan",
        "pools",
        "record",
        "remembers",
        "reservation",
        "segment",
        "slo",
        "snapshot",
        "started",
        "stitch",
        "stored_id",
        "stream",
        "text",
        "ticket",
        "trace",
        "why_not",
        "working",
    )

    def __init__(
        self,
        parts: Parts,
        snapshot: Snapshot,
        request: Request,
        path: str,
        body: bytes,
        payload: dict[str, Any],
        model: str,
        backends: Sequence[Backend],
        stream: bool,
        record: RequestRecord,
        ticket: Ticket | None,
        estimate: int,
        hop: bytes,
        endpoint: Endpoint,
        model_span: tuple[int, int] | None,
    ) -> None:
        self.hop = hop  # x-sluicegate-hop for every attempt's upstream request
        self.path = path
        self.body = body
        self.held_bytes = len(body)  # in the body budget until the request ends
        self.payload: dict[str, Any] | None = payload  # None while queued: parsed again after
        self.estimate = estimate
        self.working = False  # a backend has the request and no answer came back yet
        self.model = model
        self.backends = backends
        self.stream = stream
        self.record = record
        self.ticket = ticket
        self.reservation: Hold | None = None  # the quota's, taken last on the way in
        self.client_headers = request.headers.raw
        # The server's direct write to the client (router/core/client_link.py), when it has one.
        self.body_write = body_write(request.scope) if stream else None
        self.endpoint = endpoint
        self.model_span = model_span
        self.method = endpoint.method
        if endpoint.state == "follows":  # the id is in the path; GET's query goes along
            query = request.scope.get("query_string", b"")
            self.path = request.scope["path"] + ("?" + query.decode("latin-1") if query else "")
        self.inject = (
            parts.inject_usage and stream and endpoint.inject_usage and needs_injection(payload)
        )
        self.anthropic = endpoint.errors == "anthropic"
        # Remember a new stored response's id with its backend (`store: false`: none is kept).
        self.remembers = endpoint.state == "creates" and payload.get("store") is not False
        self.owner = ANONYMOUS  # the client key's tag on stored responses (set on getting in)
        self.slo: Slo = NO_SLO  # (ttft ms, tpot ms): read only for `balancer: latency`
        self.stored_id: str | None = None  # the id remembered for this response, once it is
        self._injected: bytes | None = None  # the body with include_usage, made once
        self.started = False  # the response head reached the client
        self.held: Held | None = None  # waiting in the admission queue for a ready backend
        self.trace: RequestTrace = NO_TRACE
        self.snapshot = snapshot  # the backend set it routes within, to its end
        # The LoRA adapter the request names, when it is routed by its base model.
        self.adapter = model if model in snapshot.adapters else None
        self.balancer = parts.registry.balancer_for(model)
        # Its way along its model's fallback chains (None: it has none, or they are off).
        self.fallback: Route | None = None
        # Migration: the plan (None: off, or a reason it may not), and the state of a stream
        # continued elsewhere: text relayed so far, tokens before the current attempt's, the
        # continuation's body and its stitch.
        plan = (
            parts.migration.plan(model, endpoint.usage, payload)
            if endpoint.usage in SHAPES
            else None
        )
        self.plan: Plan | None = plan if isinstance(plan, Plan) else None
        self.why_not: str | None = plan if isinstance(plan, str) else None
        self.migrations = 0
        # Engines that broke while working on it (mid-answer, or after it was sent): a request
        # that may migrate reaches at most 1 + max_migrations of them
        # (router/request/lifecycle/migrate.py).
        self.broke = 0
        self.text = ""
        self.carried = 0
        self.head: dict[str, object] | None = None
        self.continuation: dict[str, Any] | None = None
        self.stitch: Stitch | None = None
        # The last broken stream's text and content events, until the continuation's backend
        # counts its tokens (an event may carry several).
        self.segment: tuple[str, int] | None = None
        # Prefill/decode: a split model's requests are served by its decode pool; chat and
        # completions may also go through a prefill engine first (None: not a split model).
        pools = parts.pd.pools(model, backends)
        self.pools: RolePools | None = None
        if pools is not None:
            self.backends = pools.decode
            if endpoint.usage in SHAPES:
                self.pools = pools
            if model_span is None and body:  # a JSON body (a form carries no handoff)
                stripped = client_body(pools.rule, record.key_name, payload, body)
                if stripped is not None:
                    self.body = stripped

    def rebind(self, parts: Parts, snapshot: Snapshot) -> None:
        """A held request (router/request/lifecycle/hold.py) routes within the snapshot that
        brought its model's first ready backend; its body stays as it was read (the body budget
        gives back what it took)."""
        self.snapshot = snapshot
        self.backends = snapshot.by_model.get(self.model, ())
        self.adapter = self.model if self.model in snapshot.adapters else None
        pools = parts.pd.pools(self.model, self.backends)
        if pools is not None:
            self.backends = pools.decode
            self.pools = pools if self.endpoint.usage in SHAPES else None

    def retarget(self, parts: Parts, model: str) -> None:
        """From here the request is one for fallback model `model`: its backends, balancer,
        adapter and pools, the body's `model`, the record's (what is charged and logged)."""
        self.model = model
        self.record.model = model
        snapshot = self.snapshot
        self.backends = snapshot.by_model.get(model, ())
        self.adapter = model if model in snapshot.adapters else None
        self.balancer = parts.registry.balancer_for(model)
        self.pools = None
        pools = parts.pd.pools(model, self.backends)
        if pools is not None:
            self.backends = pools.decode
            if self.endpoint.usage in SHAPES:
                self.pools = pools
        payload = self.payload = {**self.parsed(), "model": model}
        self.body = with_member(self.body, "model", model) or json.dumps(payload).encode()
        self._injected = None

    def parked(self) -> None:
        """The request waits in the admission queue: its raw body is all it keeps meanwhile."""
        self.payload = None

    def parsed(self) -> dict[str, Any]:
        payload = self.payload
        if payload is None:
            payload = self.payload = json.loads(self.body)
        return payload

    def body_for(self, backend: Backend) -> bytes:
        target = backend.target(self.model)
        if self.continuation is not None:
            payload = {**self.continuation, "model": target}
            return json.dumps(with_usage(payload) if self.inject else payload).encode()
        if self.model_span is not None or not self.body:  # a multipart form, or no body
            if target == self.model or self.model_span is None:
                return self.body
            return replace_span(self.body, self.model_span, target.encode())
        if target == self.model:
            if not self.inject:
                return self.body
            if self._injected is None:
                self._injected = inject(self.body, self.parsed())
            return self._injected
        retargeted = with_member(self.body, "model", target)
        if retargeted is not None and not self.inject:
            return retargeted
        payload = {**self.parsed(), "model": target}
        if retargeted is not None:
            return inject(retargeted, payload)
        return json.dumps(with_usage(payload) if self.inject else payload).encode()
