"""The one request lifecycle: pick -> acquire -> open upstream -> stream -> release.

`Proxy.prepare()` validates the request and returns a `ProxyCall`, an ASGI response that runs the
lifecycle under a watcher of the client's connection: when the client leaves, the lifecycle task
is cancelled wherever it is (waiting for the first byte, between chunks, mid-write), which closes
the upstream connection, so the backend stops generating. The lease is released in `finally`.
Failures before the first byte reached the client are retried on another backend. After it, a
stream is migrated when migration is on (router/request/migration.py): the pump keeps what it
relayed (router/request/relayed.py), the attempt loop sends the continuation
(router/request/continuation.py) to another backend, and its events join the client's stream
(router/request/stitch.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import Awaitable, Callable, Sequence, Set
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from balancers import lora as adapters
from balancers.base import Balancer, needs_engine
from balancers.disaggregation import decide
from balancers.inflight.base import InflightStore, Lease, Readings
from health.state import HealthBook
from router.core.backend import Backend
from router.core.endpoints import BY_ROUTE, Endpoint
from router.core.errors import (
    UPSTREAM_FAILURES,
    FailureKind,
    InvalidUpstreamResponse,
    NoCapacity,
    ProxyError,
    error_response,
    mid_stream_kind,
    sse_error_event,
    upstream_failure,
)
from router.core.fastjson import with_member
from router.core.settings import AdmissionConfig, Settings
from router.engine.lora_loads import LoadFailed, LoraLoads
from router.ops.metrics import Metrics
from router.ops.tracing import NO_TRACE, NO_TRACING, RequestTrace, Tracing
from router.registry.fleet import Registry
from router.request.adapter_flights import AdapterFlights
from router.request.admission import Admission, Ticket, make_ticket
from router.request.affinity import Affinity
from router.request.continuation import CannotContinue, build
from router.request.drain import Lifecycle
from router.request.estimate import BadLimit, estimate_tokens
from router.request.failover import Failover
from router.request.headers import downstream_response_headers, upstream_request_headers
from router.request.hops import HOP_HEADER, HopMarker
from router.request.migration import SHAPES, Migration, Plan
from router.request.multipart import replace_span
from router.request.pd import (
    MAX_PREFILL_ANSWER,
    BadPrefillAnswer,
    Disaggregation,
    RolePools,
    bootstrap_fields,
    prefill_body,
    transfer_params,
    with_members,
)
from router.request.quota import Hold, KeyLimits, QuotaBook, Quotas
from router.request.record import RequestRecord
from router.request.relayed import CHOICES_END, Relayed
from router.request.response_ids import Holder, ResponseIds
from router.request.stitch import Stitch
from router.request.usage import ResponseUsage
from router.request.usage_book import UsageBook
from router.request.usage_stream import (
    FINISHED,
    USAGE_OBJECT,
    UsageStrip,
    inject,
    needs_injection,
    with_usage,
)
from router.request.validate import ValidRequest, request_id_of, validate
from router.upstream.pools import Pools
from router.upstream.transport import Answer

# Failures after the request went out: the backend was working on it when it broke.
_SENT = (httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError)
_COUNT = re.compile(rb'"count"\s*:\s*(\d{1,9})')  # /tokenize's answer opens with it
_COUNT_WINDOW = 4096
# A new response's id: the first `"id"` of the body or of the `response.created` event.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
_ID_WINDOW = 65536  # the id comes in the first event: bytes looked at for it, at most
CHAT = BY_ROUTE[("POST", "/v1/chat/completions")]


class _Retry(Exception):
    """An attempt failed before anything reached the client; another backend may serve it."""

    def __init__(
        self,
        error: ProxyError,
        kind: FailureKind,
        response: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None,
        sent: bool = False,
        prefill: str | None = None,
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind
        self.response = response  # the upstream's own error answer, forwarded if none is left
        self.sent = sent  # the backend had the request (it broke while working on it)
        # The prefill engine whose leg (or handoff) failed: the next attempt redoes phase 1 on
        # another one, and the decode engine stays a candidate.
        self.prefill = prefill


class _Broken(Exception):
    """A migratable stream broke after it began: the attempt loop may continue it elsewhere."""

    def __init__(self, kind: FailureKind, message: str, relay: Relayed, why: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.relay = relay
        self.why = why  # connection, error_event, finish_error, moved


class _NoneLeft(Exception):
    """No backend is left to try (all excluded, full or unhealthy)."""


class Proxy:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        pools: Pools,
        store: InflightStore,
        health: HealthBook,
        lifecycle: Lifecycle,
        metrics: Metrics | None = None,
        tracing: Tracing = NO_TRACING,
        readings: Callable[[], Readings] | None = None,
        admission: Admission | None = None,
        affinity: Affinity | None = None,
        quotas: QuotaBook | None = None,
        usage: UsageBook | None = None,
        response_ids: ResponseIds | None = None,
        hops: HopMarker | None = None,
        lora: LoraLoads | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
        # LoRA adapters loaded on demand, and the requests using them (None: never loads).
        self.lora = lora
        self.flights = AdapterFlights()  # adapters in flight per engine, for the balancer
        # Response id -> the backend holding it (Responses API follow-ups).
        self.response_ids = (
            response_ids
            if response_ids is not None
            else ResponseIds(settings.response_ids.ttl, settings.response_ids.max_local)
        )
        # This deployment's mark on upstream requests; a request bearing it already is a loop.
        self.hops = hops or HopMarker(settings.deployment_id)
        # Hourly token usage per key and model (/admin/usage); written at each request's end.
        self.usage = usage or UsageBook()
        # Ask streams' backends for usage the client did not ask for (and hide it from them).
        self.inject_usage = settings.usage_accounting == "active"
        # The prefix index and prompt hashing, for balancers that route on cached prefixes.
        self.affinity = affinity or Affinity(settings.affinity)
        self.tracing = tracing
        # The engine scraper's latest readings, for balancers that score engine load.
        self.readings = readings
        self.settings = settings
        self.registry = registry
        self.pools = pools
        self.store = store
        self.health = health
        self.lifecycle = lifecycle
        self.admission = admission  # None: a full fleet answers 503 at once
        # Per-key rpm / tpm / max_parallel: shared through Redis, or in this process.
        self.quotas = quotas or Quotas(on_refused=self.metrics.ratelimited)
        # The completion estimate of a body without max_tokens, and the longest sequence:
        # admission's, also for quotas.
        estimates = settings.admission or AdmissionConfig()
        self._default_max_tokens = estimates.default_max_tokens
        self._max_model_len = estimates.max_model_len
        self.failover = Failover(settings.retries, lambda: lifecycle.active, _Retry)
        self.migration = Migration(settings.migration, self.metrics.migrated)
        self.pd = Disaggregation(settings)  # prefill/decode pools per model (router/request/pd.py)

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
    ) -> Response:
        """`endpoint`: its row (`router/core/endpoints.py`); `allowed_models`: the public names
        the client's key may use (None: any); `priority`, `weight`: the key's admission band
        and share; `response_id`: the id in the path of an endpoint that follows a stored
        response. The router's own errors come OpenAI-shaped (the web layer turns them into
        Anthropic's for the Messages API; a `ProxyCall` does that itself)."""
        request_id = request_id_of(request.headers.get("x-request-id"))
        if self.lifecycle.draining:
            return error_response(
                503,
                "The router is shutting down; retry.",
                "service_unavailable",
                "shutting_down",
                {"x-request-id": request_id, "retry-after": "1"},
            )
        hop = self.hops.outgoing(request.headers.raw)
        if isinstance(hop, Response):
            hop.headers["x-request-id"] = request_id
            self.metrics.loop_refused()
            return hop
        checked: ValidRequest | Response
        if endpoint.state == "follows":
            checked = await self._follow(request, request_id, response_id or "", allowed_models)
        else:
            checked = await validate(
                request,
                request_id,
                self.settings.max_body_bytes,
                allowed_models,
                self.registry.snapshot.by_model,
                endpoint,
                self.settings.max_upload_bytes,
            )
            if endpoint.state == "creates" and not isinstance(checked, Response):
                checked = await self._continue(checked, request_id)
        if isinstance(checked, Response):
            return checked
        try:
            estimate = estimate_tokens(
                checked.payload,
                len(checked.body),
                endpoint.limit_fields,
                self._default_max_tokens,
                self._max_model_len,
                endpoint.prompt_from_body,
            )
        except BadLimit as bad:
            return error_response(
                400,
                str(bad),
                "invalid_request_error",
                bad.code,
                {"x-request-id": request_id},
                bad.param,
            )
        record = RequestRecord(
            request_id, checked.model, endpoint.path, checked.stream, time.perf_counter()
        )
        record.key_name = key_name
        ticket: Ticket | None = None
        if self.admission is not None:
            made = make_ticket(
                self.admission.cfg,
                request.headers,
                request_id,
                checked.model,
                estimate,
                len(checked.body),
                record.started,
                priority,
                weight,
                key_name or "",
            )
            if isinstance(made, Response):
                return made
            ticket = made
        reservation = None
        if limits is not None and endpoint.quota:
            held = await self.quotas.admit(limits, estimate, request_id)
            if isinstance(held, Response):
                return held
            reservation = held
        return ProxyCall(
            self,
            request,
            endpoint.path,
            checked.body,
            checked.payload,
            checked.model,
            checked.backends,
            checked.stream,
            record,
            ticket,
            reservation,
            estimate,
            hop,
            endpoint,
            checked.model_span,
        )

    async def _continue(self, checked: ValidRequest, request_id: str) -> ValidRequest | Response:
        """A Responses request with `previous_response_id` goes to the backend holding it."""
        previous = checked.payload.get("previous_response_id")
        if not isinstance(previous, str) or not previous:
            return checked
        holder = await self.response_ids.find(previous)
        if holder is None:
            if len(checked.backends) == 1:
                return checked  # made before this router knew it: only one engine can have it
            return _response_gone(previous, request_id, "previous_response_id", None)
        backend = next((b for b in checked.backends if b.name == holder.backend), None)
        if backend is None:
            return _response_gone(previous, request_id, "previous_response_id", holder)
        return dataclasses.replace(checked, backends=(backend,))

    async def _follow(
        self,
        request: Request,
        request_id: str,
        response_id: str,
        allowed_models: Set[str] | None,
    ) -> ValidRequest | Response:
        """`GET /v1/responses/{id}` or `.../cancel`: the backend holding the response."""
        holder = await self.response_ids.find(response_id)
        if holder is None or (allowed_models is not None and holder.model not in allowed_models):
            return _response_gone(response_id, request_id, "response_id", None)
        backends = self.registry.snapshot.by_model.get(holder.model, ())
        backend = next((b for b in backends if b.name == holder.backend), None)
        if backend is None:
            return _response_gone(response_id, request_id, "response_id", holder)
        stream = request.method == "GET" and request.query_params.get("stream") == "true"
        return ValidRequest(b"", {}, holder.model, (backend,), stream)


def _response_gone(
    response_id: str, request_id: str, param: str, holder: Holder | None
) -> Response:
    """OpenAI's 404 for a stored response this router cannot reach: never another engine's."""
    shown = response_id[:256]
    why = (
        "the engine that stored it is no longer serving"
        if holder is not None
        else "the router does not know which engine stored it (unknown or expired)"
    )
    error = {
        "message": f"Response with id '{shown}' not found: {why}.",
        "type": "invalid_request_error",
        "param": param,
        "code": "response_not_found",
    }
    return Response(
        json.dumps({"error": error}).encode(),
        status_code=404,
        media_type="application/json",
        headers={"x-request-id": request_id},
    )


class ProxyCall(Response):
    """An ASGI response that runs the upstream lifecycle under a client-disconnect watcher."""

    def __init__(
        self,
        proxy: Proxy,
        request: Request,
        path: str,
        body: bytes,
        payload: dict[str, Any],
        model: str,
        backends: Sequence[Backend],
        stream: bool,
        record: RequestRecord,
        ticket: Ticket | None = None,
        reservation: Hold | None = None,
        estimate: int = 0,
        hop: bytes = b"",
        endpoint: Endpoint = CHAT,
        model_span: tuple[int, int] | None = None,
    ) -> None:
        self.background = None
        self._hop = hop  # x-sluicegate-hop for every attempt's upstream request
        self.status_code = 200
        self._proxy = proxy
        self._path = path
        self._body = body
        self._payload: dict[str, Any] | None = payload  # None while queued: parsed again after
        self._estimate = estimate
        self._working = False  # a backend has the request and no answer came back yet
        self._model = model
        self._backends = backends
        self._stream = stream
        self._record = record
        self._ticket = ticket
        self._reservation = reservation
        self._client_headers = request.headers.raw
        self._endpoint = endpoint
        self._model_span = model_span
        self._method = endpoint.method
        if endpoint.state == "follows":  # the id is in the path; GET's query goes along
            query = request.scope.get("query_string", b"")
            self._path = request.scope["path"] + ("?" + query.decode("latin-1") if query else "")
        self._inject = (
            proxy.inject_usage and stream and endpoint.inject_usage and needs_injection(payload)
        )
        self._anthropic = endpoint.errors == "anthropic"
        # Remember a new stored response's id with its backend (`store: false`: none is kept).
        self._remembers = endpoint.state == "creates" and payload.get("store") is not False
        self._injected: bytes | None = None  # the body with include_usage, made once
        self._started = False
        self._trace: RequestTrace = NO_TRACE
        self._load_adapter = False  # this attempt's engine must load the adapter first
        self._adapter: str | None = None  # the LoRA adapter the request names, if routed so
        # Migration: the plan (None: off, or a reason it may not), and the state of a stream
        # continued elsewhere: text relayed so far, tokens before the current attempt's, the
        # continuation's body and its stitch.
        plan = (
            proxy.migration.plan(model, endpoint.usage, payload)
            if endpoint.usage in SHAPES
            else None
        )
        self._plan: Plan | None = plan if isinstance(plan, Plan) else None
        self._why_not: str | None = plan if isinstance(plan, str) else None
        self._migrations = 0
        self._text = ""
        self._carried = 0
        self._head: dict[str, object] | None = None
        self._continuation: dict[str, Any] | None = None
        self._stitch: Stitch | None = None
        # The last broken stream's text and content events, until the continuation's backend
        # counts its tokens (an event may carry several).
        self._segment: tuple[str, int] | None = None
        # Prefill/decode: a split model's requests are served by its decode pool; chat and
        # completions may also go through a prefill engine first (None: not a split model).
        pools = proxy.pd.pools(model, backends)
        self._pools: RolePools | None = None
        if pools is not None:
            self._backends = pools.decode
            if endpoint.usage in SHAPES:
                self._pools = pools

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lifecycle = self._proxy.lifecycle
        self._trace = self._proxy.tracing.begin(self._client_headers, self._record)
        lifecycle.enter()
        run = asyncio.ensure_future(self._run(send))
        # The watcher cancels `run` itself when the client leaves: no `asyncio.wait` (a future
        # and callbacks on both tasks, twice) per request.
        watch = asyncio.ensure_future(_watch_disconnect(receive, run, self._record))
        try:
            try:
                await run  # cancelled with us (server shutdown); we wait for its cleanup
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if not self._record.disconnected or (me is not None and me.cancelling()):
                    raise
                # The client left: the lifecycle was stopped by the watcher, not us.
        finally:
            if not watch.done():
                watch.cancel()
            if not run.done():  # we ourselves were cancelled (server shutdown)
                run.cancel()
                await asyncio.wait((run,))
            lifecycle.leave()
            # Only a request that queued has a fair-queue tag to correct.
            queued = self._ticket is not None and self._ticket.queue is not None
            prompt, completion, cached, estimated = self._tokens()
            if self._reservation is not None or queued:
                used = float(prompt + completion)
                if self._abandoned():
                    used = float(self._estimate)
                if self._reservation is not None:
                    self._reservation.close(used)
                if queued and self._proxy.admission is not None:
                    assert self._ticket is not None
                    self._proxy.admission.settle(self._ticket, used)
            self._account(round(prompt), completion, cached, estimated)
            self._record.emit()
            self._proxy.metrics.observe(self._record)
            self._trace.finish(self._record, self._record.usage)

    def _tokens(self) -> tuple[float, int, int, bool]:
        """Prompt, completion and cached tokens of the response, and whether any was estimated
        (the backend sent no usage: completion events counted, the prompt as body bytes / 4);
        all 0 when no backend answered. Read once, for quotas, admission and the usage book."""
        u = self._record.usage
        if u is None or not self._endpoint.counts_tokens:
            return 0.0, 0, 0, False
        prompt, completion = u.input_tokens, u.reported_tokens
        guess = self._endpoint.prompt_from_body
        carried = self._carried  # a continuation's prompt held the tokens relayed before it
        return (
            (len(self._body) / 4 if guess else 0.0) if prompt is None else max(0, prompt - carried),
            (u.events if completion is None else completion) + carried,  # no events: no stream
            u.cached_tokens or 0,
            (prompt is None and guess) or (completion is None and self._stream),
        )

    def _abandoned(self) -> bool:
        """The client left while a backend worked on the request and before its usage was read:
        the engine may have generated up to the whole budget, and no count of it will come. The
        request is charged its whole estimate (the prompt and every sequence's budget), not 0:
        the one figure known never to be below what a bounded request can have cost."""
        rec = self._record
        if not (rec.disconnected and self._working):
            return False
        u = rec.usage
        return u is None or (not self._stream and u.reported_tokens is None)

    def _parked(self) -> None:
        """The request waits in the admission queue: its raw body is all it keeps meanwhile."""
        self._payload = None

    def _parsed(self) -> dict[str, Any]:
        payload = self._payload
        if payload is None:
            payload = self._payload = json.loads(self._body)
        return payload

    def _account(self, prompt: int, completion: int, cached: int, estimated: bool) -> None:
        """Tokens of an answered request into the usage book and metrics."""
        rec = self._record
        if rec.usage is None or not 200 <= rec.status < 300 or not self._endpoint.counts_tokens:
            return
        key = rec.key_name or "unnamed"
        rec.tokens_estimated = estimated
        self._proxy.usage.record(key, self._model, prompt, completion, cached, estimated)
        self._proxy.metrics.tokens(key, self._model, prompt, completion, cached)

    def _body_for(self, backend: Backend) -> bytes:
        target = backend.models.get(self._model, self._model)
        if self._continuation is not None:
            payload = {**self._continuation, "model": target}
            return json.dumps(with_usage(payload) if self._inject else payload).encode()
        if self._model_span is not None or not self._body:  # a multipart form, or no body
            if target == self._model or self._model_span is None:
                return self._body
            return replace_span(self._body, self._model_span, target.encode())
        if target == self._model:
            if not self._inject:
                return self._body
            if self._injected is None:
                self._injected = inject(self._body, self._parsed())
            return self._injected
        retargeted = with_member(self._body, "model", target)
        if retargeted is not None and not self._inject:
            return retargeted
        payload = {**self._parsed(), "model": target}
        if retargeted is not None:
            return inject(retargeted, payload)
        return json.dumps(with_usage(payload) if self._inject else payload).encode()

    async def _run(self, send: Send) -> None:
        proxy = self._proxy
        rec = self._record
        exclude: set[str] = set()
        balancer = proxy.registry.balancer_for(self._model)
        last: _Retry | None = None
        trace = self._trace
        admission = proxy.admission
        # A LoRA adapter routed by its base model: the balancer weighs who serves it.
        adapter = self._model if self._model in proxy.registry.snapshot.adapters else None
        self._adapter = adapter
        want: adapters.AdapterWant | None = None
        affinity = proxy.affinity.prepare(
            balancer,
            self._client_headers,
            self._parsed(),
            self._endpoint.usage == "responses",
            adapter,
        )
        if affinity is not None and proxy.affinity.shared is not None:
            affinity = await proxy.affinity.look_up(affinity, self._backends)  # one round trip
        if affinity is not None and proxy.affinity.wants_tokens(self._model, self._backends):
            affinity = await proxy.affinity.with_tokens(
                affinity, self._model, self._parsed(), self._backends
            )
        picker: Balancer = balancer  # this attempt's: `balancer` bound to the request's affinity
        readings: Readings | None = None

        def bound(eligible: Sequence[Backend]) -> Balancer:
            nonlocal picker, want
            if adapter is not None:
                want = (
                    proxy.lora.want(adapter)
                    if proxy.lora is not None
                    else adapters.AdapterWant(adapter)
                )
                want = dataclasses.replace(want, flights=proxy.flights.on())
            picker = (
                proxy.affinity.bind(balancer, affinity, eligible, want) if affinity else balancer
            )
            if want is not None:
                picker = adapters.bind(picker, want)
            return picker

        engine_aware = needs_engine(balancer) or adapter is not None
        pools = self._pools
        p_exclude: set[str] = set()  # prefill engines that failed this request

        async def prefill_lease(number: int) -> Lease | None:
            """The prefill engine for this attempt when the prompt should be split (after the
            decode engine was chosen), else None: served whole on the decode engine. The last
            attempt after prefill failures goes whole: the decode engine can still answer."""
            assert pools is not None
            tokens = affinity.tokens if affinity else None
            prompt = len(tokens) if tokens is not None else len(self._body) // 4
            if tokens is not None:
                cached = getattr(picker, "cached", 0)
            else:
                cached = getattr(picker, "held", 0) * proxy.settings.affinity.block_chars // 4
            # No panic mode here: with no healthy prefill engine the decode engine serves it.
            candidates = [b for b in proxy.health.healthy(pools.prefill) if b.name not in p_exclude]
            if p_exclude and number >= proxy.settings.retries.attempts:
                candidates = []
            split = decide(
                prompt,
                cached,
                pools.rule.min_uncached_tokens,
                bool(candidates),
                "kv_transfer_params" in self._parsed(),
            )
            rec.pd = split.reason
            if not split.split:
                return None
            p_readings = proxy.readings() if proxy.readings and engine_aware else None
            chosen = await proxy.store.acquire(candidates, bound(candidates), p_exclude, p_readings)
            if chosen is None:
                rec.pd = "no_prefill"  # all at their max_inflight
                return None
            if affinity:  # it computed the prompt: its own prefix cache holds it now
                proxy.affinity.dispatched(affinity.hashes, chosen.backend, p_readings)
            return chosen

        async def try_admit() -> Lease | None:
            """One pick-and-count among backends with room by max_inflight and engine readings;
            None sends the request to (or back to) the queue."""
            nonlocal readings
            assert admission is not None
            eligible = proxy.health.eligible(self._backends, self._model)
            if not eligible:
                raise _NoneLeft  # nothing could take it however long it waited
            all_readings = proxy.readings() if proxy.readings else None
            if all_readings:
                eligible = admission.open_backends(eligible, all_readings)
                if not eligible:
                    return None
            readings = all_readings if engine_aware else None
            return await proxy.store.acquire(eligible, bound(eligible), exclude, readings)

        async def attempt(number: int, answered: Callable[[], None]) -> None:
            nonlocal last, readings
            trace.queued()
            lease: Lease | None
            if (
                admission is not None
                and self._ticket is not None
                and number == 1
                and not rec.attempts
            ):
                lease = await admission.acquire(self._ticket, try_admit, self._parked)
            else:
                eligible = proxy.health.eligible(self._backends, self._model)
                readings = proxy.readings() if proxy.readings and engine_aware else None
                lease = await proxy.store.acquire(eligible, bound(eligible), exclude, readings)
                if lease is None:
                    raise _NoneLeft
            rec.reason = getattr(picker, "reason", "load")
            # Chosen where it is not served (load on demand): it is loaded there first.
            self._load_adapter = (
                want is not None
                and want.on_demand
                and not adapters.serves(
                    readings.get(lease.backend) if readings else None, want, lease.backend
                )
            )
            proxy.metrics.routed(self._model, balancer.name, lease.backend, rec.reason)
            if affinity:
                held = getattr(picker, "held", 0)
                rec.prefix_chars = held * proxy.settings.affinity.block_chars
                proxy.affinity.dispatched(affinity.hashes, lease.backend, readings)
                if affinity.tokens is not None:
                    cached = getattr(picker, "cached", 0)
                    proxy.affinity.kv_dispatched(affinity, lease.backend, cached)
                entries = proxy.affinity.index.entries
                proxy.metrics.affinity(len(affinity.hashes), held, entries)
            trace.picked(lease.backend, rec.reason)
            trace.attempt(lease.backend, number)
            rec.attempts += 1  # a migration's attempts count on from the first stream's
            prefill: Lease | None = None
            try:
                if pools is not None and not self._started and self._continuation is None:
                    rec.prefill_backend = None  # this attempt's own, set when it has one
                    try:
                        prefill = await prefill_lease(number)
                    except BaseException:
                        proxy.store.release(lease)
                        raise
                await self._attempt(send, lease, answered, prefill)
            except _Broken:
                self._working = False
                exclude.add(lease.backend)  # a continuation goes elsewhere
                raise
            except _Retry as retry:
                self._working = False  # that backend failed or refused before it answered
                last = retry
                trace.attempt_failed(retry.kind, retry.response[0] if retry.response else None)
                if retry.prefill is not None:  # phase 1 again elsewhere; the decode engine stays
                    proxy.metrics.attempt_failed(retry.prefill, retry.kind)
                    p_exclude.add(retry.prefill)
                else:
                    proxy.metrics.attempt_failed(lease.backend, retry.kind)
                    exclude.add(lease.backend)  # the next attempt goes elsewhere
                raise
            finally:
                trace.attempt_end(rec.error)

        async def again(release: Callable[[], None]) -> None:
            """The failover loop once more, for a migration: its retry slot is released as soon
            as an answer starts."""

            async def continued(number: int, answered: Callable[[], None]) -> None:
                def both() -> None:
                    answered()
                    release()

                await attempt(number, both)

            await proxy.failover.run(continued)

        try:
            try:
                try:
                    await proxy.failover.run(attempt)
                    return
                except _Broken as broken:
                    await self._migrate(send, broken, again, exclude)
                    return
            except (_Retry, _NoneLeft):  # attempts, deadline, budget or backends ran out
                # A whole (non-streamed) answer lost while its engine worked on it: nothing
                # reached the client, so the original request migrates as it is.
                while last is not None and self._whole_again(last):
                    release = proxy.failover.budget.slot(True)
                    try:
                        await again(release)
                        self._outcome("ok", "whole answer lost")
                        return
                    except (_Retry, _NoneLeft):
                        self._outcome("failed", "whole answer lost")
                    finally:
                        release()
            if last is None:
                raise NoCapacity(
                    f"Every backend serving `{self._model}` is busy or unavailable; retry later.",
                    retry_after=proxy.health.retry_after(self._backends) or 1,
                )
            if last.response is not None:
                status, headers, body = last.response
                rec.status = status
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                rec.bytes_out = len(body)
                return
            raise last.error
        except ProxyError as exc:
            rec.status = exc.status
            rec.error = exc.code
            answer = exc.response(rec.request_id, self._anthropic)
            await answer({"type": "http"}, _no_receive, send)

    def _whole_again(self, last: _Retry) -> bool:
        """May a non-streamed request that broke on its engine be sent on once more?"""
        if self._started or self._plan is None or not last.sent or self._stream:
            return False
        if self._migrations >= self._plan.max_migrations:
            return False
        if not self._proxy.failover.budget.allows(self._proxy.lifecycle.active):
            self._outcome("budget", "whole answer lost")
            return False
        self._migrations += 1
        return True

    def _outcome(self, result: str, why: str, backend: str | None = None) -> None:
        rec = self._record
        proxy = self._proxy
        proxy.migration.outcome(
            self._model,
            result,
            rec.request_id,
            backend=backend or rec.backend,
            migration=self._migrations,
            why=why,
            tokens_relayed=self._carried,
        )
        self._trace.migrated(backend or rec.backend or "", self._migrations, result, why)
        rec.migrations = self._migrations

    async def _migrate(
        self,
        send: Send,
        broken: _Broken,
        again: Callable[[Callable[[], None]], Awaitable[None]],
        exclude: set[str],
    ) -> None:
        """Continue a broken stream on other backends, at most `max_migrations` times; when it
        may not (or cannot) go on, end it with an error event saying why."""
        proxy = self._proxy
        plan = self._plan
        assert plan is not None
        while True:
            source = self._record.backend or ""
            refusal = self._continue_after(broken, plan)
            if refusal is not None:
                result, why = refusal
                self._outcome(result, why, source)
                await self._end_broken(send, broken, f"Not migrated: {why}.")
                return
            if plan.skip_openai:
                exclude.update(b.name for b in self._backends if b.kind == "openai")
            # Counted here, as a failed attempt; one not continued is counted with the request.
            proxy.metrics.attempt_failed(source, broken.kind)
            self._record.error = None
            release = proxy.failover.budget.slot(True)
            try:
                await again(release)
            except _Broken as next_break:
                self._outcome("ok", broken.why, source)
                broken = next_break
                continue
            except (_Retry, _NoneLeft):
                self._outcome("failed", broken.why, source)
                await self._end_broken(send, broken, "No backend could continue it.")
                self._record.error = "migration_failed"  # its failure is counted already
                return
            finally:
                release()
            self._outcome("ok", broken.why, source)
            return

    def _continue_after(self, broken: _Broken, plan: Plan) -> tuple[str, str] | None:
        """Set up the continuation of `broken`; (result, why) when there is none."""
        relay = broken.relay
        if relay.spoiled:
            return "refused", "an event too long to hold was cut"
        summary = relay.summary()
        if summary.tool_calls:
            return "refused", "a tool call was streaming"
        if summary.finished:
            return "refused", "the answer had finished"
        if self._migrations >= plan.max_migrations:
            return "limit", f"it broke after {plan.max_migrations} migrations"
        proxy = self._proxy
        if not proxy.failover.budget.allows(proxy.lifecycle.active):
            proxy.failover.budget.refused += 1
            return "budget", "the retry budget is spent"
        usage = self._record.usage
        produced = usage.events if usage is not None else 0
        text = self._text + summary.text
        try:
            continuation = build(self._parsed(), plan.shape, text, self._carried + produced)
        except CannotContinue as exc:
            return "refused", str(exc)
        self._migrations += 1
        self._text = text
        self._continuation = continuation
        self._segment = (summary.text, produced)  # counted by the backend that continues
        if self._head is None:
            self._head = summary.head
        return None

    async def _count_segment(self, backend: Backend) -> None:
        """The tokens of the text relayed by the stream that broke, as the continuation's
        engine counts them (its `/tokenize`; the content events when it cannot say), then the
        continuation's limits and stitch from that count."""
        assert self._segment is not None and self._plan is not None
        text, produced = self._segment
        count = produced
        if text and backend.kind != "openai":
            found = await self._tokens_of(backend, text)
            count = found if found is not None else produced
        self._segment = None
        self._carried += count
        try:
            self._continuation = build(self._parsed(), self._plan.shape, self._text, self._carried)
        except CannotContinue:
            pass  # the engine's own count says the limit is near: the event count's body stays
        if self._head is not None:
            self._stitch = Stitch(self._head, self._carried)

    async def _tokens_of(self, backend: Backend, text: str) -> int | None:
        """`POST /tokenize` of `text` alone on `backend` (vLLM's, SGLang's): its count."""
        target = backend.models.get(self._model, self._model)
        body = json.dumps({"model": target, "prompt": text, "add_special_tokens": False})
        headers = [(b"content-type", b"application/json"), *backend.auth_headers]
        if self._hop:
            headers.append((HOP_HEADER, self._hop))
        transport, request = self._proxy.pools.request(backend, "/tokenize", headers, body.encode())
        response: Answer | None = None
        head = b""
        try:
            async with asyncio.timeout(5):
                response = await transport.send(request)
                if response.status_code != 200:
                    return None
                async for chunk in response.aiter_raw():
                    head += chunk
                    found = _COUNT.search(head)
                    if found is not None:
                        return int(found.group(1))
                    if len(head) > _COUNT_WINDOW:
                        return None
        except UPSTREAM_FAILURES:  # TimeoutError among them
            return None
        finally:
            if response is not None:
                await response.aclose()
        return None

    async def _end_broken(self, send: Send, broken: _Broken, why: str) -> None:
        """End a broken stream as a stream that may not migrate ends: with an error event."""
        rec = self._record
        rec.error = broken.kind
        event = sse_error_event(
            f"{broken.message} {why}", "upstream_error", f"upstream_{broken.kind}", self._anthropic
        )
        await send({"type": "http.response.body", "body": event, "more_body": False})
        rec.bytes_out += len(event)

    async def _attempt(
        self,
        send: Send,
        lease: Lease,
        answered: Callable[[], None],
        prefill: Lease | None = None,
    ) -> None:
        """One attempt on `lease`'s backend; with `prefill`, the split request's decode leg,
        after its prefill leg on that lease's backend (released as soon as it is done)."""
        proxy = self._proxy
        rec = self._record
        # The request routes within the snapshot it started with.
        backend = next(b for b in self._backends if b.name == lease.backend)
        rec.backend = backend.name
        response: Answer | None = None
        lora = proxy.lora if self._adapter is not None else None
        used = False
        flying = self._adapter is not None
        if flying:
            proxy.flights.start(backend.name, self._model)
        handoff: bytes | None = None  # phase 2's members: P's kv_transfer_params, or SGLang's
        side: asyncio.Task[None] | None = None  # SGLang: the prefill engine's call, run aside
        split: str | None = None  # the prefill engine this attempt's decode leg follows
        try:
            if prefill is not None:
                p_backend = self._prefill_backend(prefill.backend)
                assert self._pools is not None
                if self._pools.rule.connector == "sglang":
                    handoff = bootstrap_fields(p_backend)
                    side = asyncio.ensure_future(self._bootstrap_prefill(p_backend, handoff))
                    # Released when P's call ends, however (a task cancelled before it ran
                    # never runs its own `finally`).
                    side.add_done_callback(_releasing(proxy.store.release, prefill))
                    prefill = None
                    split = p_backend.name
                else:
                    try:
                        params = await self._prefill(p_backend)
                    finally:
                        proxy.store.release(prefill)
                        prefill = None
                    if params is not None:
                        handoff = b'"kv_transfer_params":' + params
                        split = p_backend.name
                    else:
                        rec.pd = "prefill_refused"
                rec.prefill_backend = split
            if lora is not None:
                if self._load_adapter or lora.pending(backend.name, self._model):
                    try:
                        await lora.ensure(backend, self._model)
                    except LoadFailed as exc:
                        err = ProxyError(
                            f"Loading LoRA adapter `{self._model}` on `{backend.name}` "
                            f"failed: {exc}."
                        )
                        raise _Retry(err, FailureKind.LORA_LOAD) from None
                lora.using(backend.name, self._model)
                used = True
            own = list(backend.auth_headers)
            if self._hop:
                own.append((HOP_HEADER, self._hop))  # replaces the client's own, if it sent one
            headers = upstream_request_headers(self._client_headers, rec.request_id, own)
            if self._segment is not None:
                await self._count_segment(backend)
            if self._inject or self._remembers:
                # The usage event can only be taken out of bytes that are not compressed (nor
                # a response id read).
                headers = [(k, v) for k, v in headers if k.lower() != b"accept-encoding"]
                headers.append((b"accept-encoding", b"identity"))
            body = self._body_for(backend)
            if handoff is not None:
                body = with_members(body, handoff)
            transport, request = proxy.pools.request(
                backend,
                self._path,
                self._trace.upstream_headers(headers),
                body,
                self._method,
                self._endpoint.state != "follows",  # a path with an id is not cached
            )
            self._working = True
            try:
                response = await transport.send(request)
            except UPSTREAM_FAILURES as exc:
                failure = upstream_failure(exc, backend.name)
                proxy.health.on_failure(backend.name, failure.kind)
                sent = isinstance(exc, _SENT) and not isinstance(exc, InvalidUpstreamResponse)
                raise _Retry(failure.error, failure.kind, sent=sent) from exc

            status = response.status_code
            # A continuation's answer joins a stream that began with 200: it must be one too.
            if status >= 500 or status == 429 or (self._started and status >= 300):
                try:
                    await self._retryable_status(backend, response, split)
                except _Retry as retry:
                    # The decode engine answered, but refused the handoff (vLLM's 500 when the
                    # transfer fails): phase 1 again, on another prefill engine, fresh params.
                    # A 429 is the decode engine's own: another one takes it.
                    if status >= 500:
                        retry.prefill = split
                    raise
            streaming = self._stream and status < 400
            if self._started:  # a migration: the client has its response head already
                answered()
                proxy.health.on_success(backend.name)
                await self._pump(send, response, backend, streaming)
                return
            headers = downstream_response_headers(response.headers.raw, rec.request_id, streaming)
            if proxy.settings.expose_backend_header:
                headers.append((b"x-sluicegate-backend", backend.name.encode()))
            if self._reservation is not None:
                headers.extend(self._reservation.headers)
            rec.status = status
            self._trace.answered(status)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            self._started = True
            answered()
            if status < 400:
                proxy.health.on_success(backend.name)
            await self._pump(send, response, backend, streaming)
        finally:
            if prefill is not None:
                proxy.store.release(prefill)
            if side is not None:
                side.cancel()  # done when D answered; else the client left or D failed
            if flying:
                proxy.flights.end(backend.name, self._model)
            if used and lora is not None:
                lora.done(backend.name, self._model)
            if response is not None:
                await response.aclose()
            proxy.store.release(lease)
            if proxy.admission is not None:
                proxy.admission.released()
            if side is not None:
                await asyncio.wait((side,))  # its lease goes back in its done callback

    def _prefill_backend(self, name: str) -> Backend:
        assert self._pools is not None
        return next(b for b in self._pools.prefill if b.name == name)

    def _prefill_headers(self, backend: Backend) -> list[tuple[bytes, bytes]]:
        """The decode leg's headers for the prefill engine: the same request id, its own key."""
        # Its answer is read here, so not compressed (an own header replaces the client's).
        own = [*backend.auth_headers, (b"accept-encoding", b"identity")]
        if self._hop:
            own.append((HOP_HEADER, self._hop))
        return upstream_request_headers(self._client_headers, self._record.request_id, own)

    async def _prefill(self, backend: Backend) -> bytes | None:
        """NIXL phase 1 on `backend`: its `kv_transfer_params` (serialised, unchanged); None
        when it refused the request itself (4xx: the decode engine answers it whole, and so
        the client gets the engine's own error). A failure raises `_Retry` naming it.

        A client that leaves now cancels this call, which closes its connection: vLLM then
        aborts the request, and a request aborted before it finished frees its blocks at once
        (NixlConnectorScheduler.request_finished: not FINISHED_LENGTH_CAPPED, no delayed free).
        Once phase 1 has answered, the blocks are held for a decode engine until
        VLLM_NIXL_ABORT_REQUEST_TIMEOUT; vLLM has no call to release them early (only a decode
        engine that aborts a request carrying the params tells P to free them), so a request
        ended between the phases leaves them to that lease."""
        proxy = self._proxy
        trace = self._trace
        name = backend.name
        target = backend.models.get(self._model, self._model)
        body = prefill_body(self._parsed(), target)
        trace.prefill(name)
        transport, request = proxy.pools.request(
            backend, self._path, trace.upstream_headers(self._prefill_headers(backend)), body
        )
        started = time.perf_counter()
        self._working = True
        response: Answer | None = None
        try:
            try:
                response = await transport.send(request)
                parts: list[bytes] = []
                size = 0
                async for chunk in response.stream:
                    parts.append(chunk)
                    size += len(chunk)
                    if size > MAX_PREFILL_ANSWER:
                        break
            except UPSTREAM_FAILURES as exc:
                failure = upstream_failure(exc, name)
                proxy.health.on_failure(name, failure.kind)
                trace.prefill_end(failure.kind)
                raise _Retry(failure.error, failure.kind, prefill=name) from exc
            status = response.status_code
            if status != 200:
                trace.prefill_end(FailureKind.STATUS, status)
                if 400 <= status < 500 and status != 429:
                    return None
                if status >= 500:
                    proxy.health.on_failure(name, FailureKind.STATUS, status)
                err = ProxyError(f"Prefill backend `{name}` answered {status}.")
                raise _Retry(err, FailureKind.STATUS, prefill=name)
            try:
                if size > MAX_PREFILL_ANSWER:
                    raise BadPrefillAnswer("its answer is too long")
                params = transfer_params(b"".join(parts))
            except BadPrefillAnswer as bad:
                trace.prefill_end(FailureKind.CONNECT, status)
                proxy.health.on_failure(name, FailureKind.CONNECT)
                err = ProxyError(f"Prefill backend `{name}`: {bad}.")
                raise _Retry(err, FailureKind.CONNECT, prefill=name) from None
            proxy.health.on_success(name)
            proxy.metrics.prefilled(name, time.perf_counter() - started)
            trace.prefill_end(None, status)
            return params
        finally:
            trace.prefill_end("cancelled")  # a no-op unless the client left meanwhile
            if response is not None:
                await response.aclose()

    async def _bootstrap_prefill(self, backend: Backend, fields: bytes) -> None:
        """SGLang: the prefill engine's copy of the request (same room), sent while the decode
        engine's runs; its answer is read and dropped. Cancelled when the decode leg ends."""
        proxy = self._proxy
        trace = self._trace
        target = backend.models.get(self._model, self._model)
        payload = {**self._parsed(), "model": target}
        body = with_members(json.dumps(payload, ensure_ascii=False).encode(), fields)
        trace.prefill(backend.name)
        transport, request = proxy.pools.request(
            backend, self._path, trace.upstream_headers(self._prefill_headers(backend)), body
        )
        started = time.perf_counter()
        response: Answer | None = None
        try:
            response = await transport.send(request)
            async for _ in response.aiter_raw():
                pass
            if response.status_code >= 500:
                proxy.health.on_failure(backend.name, FailureKind.STATUS, response.status_code)
            proxy.metrics.prefilled(backend.name, time.perf_counter() - started)
            trace.prefill_end(None, response.status_code)
        except UPSTREAM_FAILURES as exc:
            failure = upstream_failure(exc, backend.name)
            proxy.health.on_failure(backend.name, failure.kind)
            trace.prefill_end(failure.kind)
        finally:
            trace.prefill_end("cancelled")  # a no-op unless the decode leg ended first
            if response is not None:
                await response.aclose()

    async def _retryable_status(
        self, backend: Backend, response: Answer, blame: str | None = None
    ) -> None:
        """Read the (small) error answer, note it, and hand it to the retry loop. `blame`: the
        prefill engine whose handoff the decode engine refused: its failure, not the decode
        engine's (vLLM's decode answers 500 when it cannot pull, and stays healthy)."""
        proxy = self._proxy
        limit = proxy.settings.max_error_body_bytes
        body = b""
        cut = False  # the backend's Content-Length no longer describes `body`
        try:
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > limit:
                    body = body[:limit]
                    cut = True
                    break
        except UPSTREAM_FAILURES:
            cut = True  # what arrived of the error answer is enough
        status = response.status_code
        retry_after = _retry_after(response.headers.get("retry-after"))
        if retry_after is not None and status in (429, 503):
            proxy.health.cool_down(backend.name, retry_after)
        if status >= 500:
            proxy.health.on_failure(
                blame if blame is not None and status >= 500 else backend.name,
                FailureKind.STATUS,
                status,
            )
        headers = downstream_response_headers(response.headers.raw, self._record.request_id, False)
        if cut or len(body) >= limit:
            headers = [(k, v) for k, v in headers if k != b"content-length"]
        err = ProxyError(f"Backend `{backend.name}` answered {status}.")
        raise _Retry(err, FailureKind.STATUS, (status, headers, body))

    async def _pump(self, send: Send, response: Answer, backend: Backend, streaming: bool) -> None:
        rec = self._record
        tail = b"\n\n"
        usage = rec.usage = ResponseUsage(self._endpoint.usage)
        # A new stored response: its id is remembered before the client can see it.
        seen: bytes | None = b"" if self._remembers and response.status_code < 400 else None
        readable = response.headers.get("content-encoding", "identity") == "identity"
        watch = usage.feed if streaming and readable else usage.keep
        # The usage event sluicegate asked for is read (by `watch`), then taken out.
        strip = None
        if self._inject and streaming and readable:
            strip = UsageStrip(backend.kind == "openai")
        ended = False  # [DONE] seen: the usage is read
        # What a migratable stream relayed (None: migration off for this call), and the stitch
        # of a continuation (None: the first stream, relayed byte-exact).
        relay = self._relay_for(backend) if streaming and readable else None
        if relay is not None:
            usage.sink = relay.take  # the usage reader's batches are what the relay keeps
        stitch = self._stitch
        searched = relay is not None or strip is not None  # they read a chunk's finish reason
        # `bytes` counts what the client was sent, also when it left mid-stream.
        try:
            async for chunk in response.stream:
                if rec.ttfb_ms is None:
                    rec.ttfb_ms = round((time.perf_counter() - rec.started) * 1000, 2)
                # Four bytes: the end of a choices event (CHOICES_END), of [DONE], or of neither,
                # told apart by comparing them, not by a method call per chunk.
                tail = chunk[-4:]
                # One search per chunk, shared by the relay and the strip: a choice's last event
                # (a finish reason that is not null, `"error"` among them).
                finish = searched and chunk.rfind(FINISHED) >= 0
                # Only a chunk ending inside an event, or in an event that is not a choices event
                # (an engine's `{"error": ...}`, which it sends last, or [DONE] after it), holding
                # a finish reason, or following a held part (or a move) concerns the relay.
                if relay is not None and (finish or relay.slow or tail != CHOICES_END):
                    chunk = relay.feed(chunk)
                    if not chunk:
                        if relay.broken is not None:
                            break
                        continue
                    tail = chunk[-4:]
                    finish = chunk.rfind(FINISHED) >= 0  # it may be what the relay held
                    if finish and not relay.slow:
                        # The one choice finished (a migratable call has one), not in error:
                        # nothing is left to continue, and the usage event and [DONE] after it
                        # need no parsing.
                        self._proxy.migration.untrack(backend.name, relay)
                        usage.sink = None
                        relay = None
                watch(chunk)
                if tail == _DONE_TAIL and not ended and chunk.endswith(_DONE):
                    # The openai SDK closes once it reads [DONE], maybe before the engine's end
                    # of body arrives here (a disconnect then cancels this): the usage, which
                    # came before [DONE], is read now.
                    usage.close(readable)
                    ended = True
                if seen is not None:
                    seen = await self._remember_id(seen + chunk, backend)
                # Inline (a method call per chunk costs more; `rfind` less than `in`): only a chunk
                # holding the usage object or a finish reason, ending inside an event or following
                # a held part needs the strip.
                if strip is not None and (
                    strip.slow
                    or finish
                    or (tail != CHOICES_END and not tail.endswith(b"\n\n"))
                    or chunk.rfind(USAGE_OBJECT) >= 0
                ):
                    chunk = strip.feed(chunk)
                    if not chunk:
                        continue
                if stitch is not None:
                    chunk = stitch.feed(chunk)
                    if not chunk:
                        continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                rec.bytes_out += len(chunk)
                if relay is not None and relay.broken is not None:
                    break
        except UPSTREAM_FAILURES as exc:
            kind = mid_stream_kind(exc)
            rec.error = kind
            self._proxy.health.on_failure(backend.name, kind)
            if not streaming or response.headers.get("content-encoding", "identity") != "identity":
                # A plain body can't carry an error event: abort so the client sees it incomplete.
                raise
            message = (
                f"Backend `{backend.name}` timed out mid-stream."
                if kind is FailureKind.TIMEOUT
                else f"Backend `{backend.name}` failed mid-stream."
            )
            if relay is not None and not relay.spoiled:
                usage.flush()  # the relay's last batch
                raise _Broken(kind, message, relay, "connection") from exc
            if self._why_not is not None:
                message += f" Not migrated: {self._why_not}."
            event = sse_error_event(message, "upstream_error", f"upstream_{kind}", self._anthropic)
            held = strip.flush() if strip is not None else b""
            if held or not tail.endswith(b"\n\n"):
                event = held + b"\n\n" + event  # end the half event so the error parses alone
            await send({"type": "http.response.body", "body": event, "more_body": False})
            rec.bytes_out += len(event)
            return
        finally:
            if relay is not None:
                self._proxy.migration.untrack(backend.name, relay)
        if relay is not None and relay.broken is not None:
            why = relay.broken
            if why != "moved":  # the engine's own error: a failure of that backend
                rec.error = FailureKind.MID_STREAM
                self._proxy.health.on_failure(backend.name, FailureKind.MID_STREAM)
            message = (
                f"Backend `{backend.name}` is being removed."
                if why == "moved"
                else f"Backend `{backend.name}` failed mid-stream ({why.replace('_', ' ')})."
            )
            usage.flush()  # the relay's last batch
            raise _Broken(FailureKind.MID_STREAM, message, relay, why)
        if not ended:
            usage.close(readable and response.status_code < 400)
        held = strip.flush() if strip is not None else b""
        rec.bytes_out += len(held)
        await send({"type": "http.response.body", "body": held, "more_body": False})

    def _relay_for(self, backend: Backend) -> Relayed | None:
        """A record of what this attempt relays, when it may migrate."""
        plan = self._plan
        if plan is None:
            return None
        if plan.skip_openai and backend.kind == "openai":
            self._why_not = "its backend is a `kind: openai` provider"
            return None
        relay = Relayed(plan.shape)
        self._proxy.migration.track(backend.name, relay)
        return relay

    async def _remember_id(self, seen: bytes, backend: Backend) -> bytes | None:
        """Look for the new response's id in the bytes so far; None once done with it."""
        found = _RESPONSE_ID.search(seen)
        if found is None:
            return seen if len(seen) < _ID_WINDOW else None
        response_id = found.group(1).decode("utf-8", "replace")
        await self._proxy.response_ids.remember(response_id, Holder(backend.name, self._model))
        return None


_DONE = b"data: [DONE]\n\n"
_DONE_TAIL = _DONE[-4:]


async def _watch_disconnect(
    receive: Receive, run: asyncio.Future[None], rec: RequestRecord
) -> None:
    """When the client leaves: stop the upstream now, wherever the lifecycle is waiting."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not run.done():
                rec.disconnected = True
                run.cancel()
            return


def _releasing(
    release: Callable[[Lease], None], lease: Lease
) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        release(lease)
        if not task.cancelled():
            task.exception()  # retrieved (the expected failures are caught in the task)

    return done


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # HTTP-date form: rare from model servers; not worth a parser
    return seconds if 0 <= seconds <= 3600 else None
