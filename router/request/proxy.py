"""The one request lifecycle: pick -> acquire -> open upstream -> stream -> release.

`Proxy.prepare()` validates the request and returns a `ProxyCall`, an ASGI response that runs the
lifecycle under a watcher of the client's connection: when the client leaves, the lifecycle task
is cancelled wherever it is (waiting for the first byte, between chunks, mid-write), which closes
the upstream connection, so the backend stops generating. The lease is released in `finally`.
Failures before the first byte reached the client are retried on another backend; never after.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence, Set
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from balancers.base import Balancer, needs_engine
from balancers.inflight.base import InflightStore, Lease, Readings
from health.state import HealthBook
from router.core.backend import Backend
from router.core.errors import (
    UPSTREAM_FAILURES,
    FailureKind,
    NoCapacity,
    ProxyError,
    error_response,
    mid_stream_kind,
    sse_error_event,
    upstream_failure,
)
from router.core.settings import AdmissionConfig, Settings
from router.ops.metrics import Metrics
from router.ops.tracing import NO_TRACE, NO_TRACING, RequestTrace, Tracing
from router.registry.fleet import Registry
from router.request.admission import Admission, Ticket, make_ticket
from router.request.affinity import Affinity
from router.request.drain import Lifecycle
from router.request.estimate import CHAT_LIMITS, LIMIT_FIELDS, BadLimit, estimate_tokens
from router.request.failover import Failover
from router.request.headers import downstream_response_headers, upstream_request_headers
from router.request.hops import HOP_HEADER, HopMarker
from router.request.quota import Hold, KeyLimits, QuotaBook, Quotas
from router.request.record import RequestRecord
from router.request.usage import ResponseUsage
from router.request.usage_book import UsageBook
from router.request.usage_stream import (
    STREAMED_PATHS,
    USAGE_OBJECT,
    UsageStrip,
    inject,
    needs_injection,
    with_usage,
)
from router.request.validate import request_id_of, validate
from router.upstream.pools import Pools


class _Retry(Exception):
    """An attempt failed before anything reached the client; another backend may serve it."""

    def __init__(
        self,
        error: ProxyError,
        kind: FailureKind,
        response: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None,
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind
        self.response = response  # the upstream's own error answer, forwarded if none is left


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
        hops: HopMarker | None = None,
    ) -> None:
        self.metrics = metrics or Metrics()
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

    async def prepare(
        self,
        request: Request,
        path: str,
        allowed_models: Set[str] | None = None,
        key_name: str | None = None,
        priority: str = "standard",
        weight: float = 1.0,
        limits: KeyLimits | None = None,
        limit_fields: Sequence[str] | None = None,
    ) -> Response:
        """`allowed_models`: the public names the client's key may use (None: any);
        `priority`, `weight`: the key's admission band and share; `limit_fields`: the body's
        completion-limit fields the endpoint's engine honours (None: as `path` says)."""
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
        checked = await validate(
            request,
            request_id,
            self.settings.max_body_bytes,
            allowed_models,
            self.registry.snapshot.by_model,
        )
        if isinstance(checked, Response):
            return checked
        if limit_fields is None:
            limit_fields = LIMIT_FIELDS.get(path, CHAT_LIMITS)
        try:
            estimate = estimate_tokens(
                checked.payload,
                len(checked.body),
                limit_fields,
                self._default_max_tokens,
                self._max_model_len,
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
        record = RequestRecord(request_id, checked.model, path, checked.stream, time.perf_counter())
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
        if limits is not None:
            held = await self.quotas.admit(limits, estimate, request_id)
            if isinstance(held, Response):
                return held
            reservation = held
        return ProxyCall(
            self,
            request,
            path,
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
        self._inject = (
            proxy.inject_usage and stream and path in STREAMED_PATHS and needs_injection(payload)
        )
        self._injected: bytes | None = None  # the body with include_usage, made once
        self._started = False
        self._trace: RequestTrace = NO_TRACE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lifecycle = self._proxy.lifecycle
        self._trace = self._proxy.tracing.begin(self._client_headers, self._record)
        lifecycle.enter()
        run = asyncio.ensure_future(self._run(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((run, watch), return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                # The client left: stop the upstream now, wherever the lifecycle is waiting.
                self._record.disconnected = True
                run.cancel()
            await asyncio.wait((run,))
            if not run.cancelled():
                run.result()
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
        if u is None:
            return 0.0, 0, 0, False
        prompt, completion = u.input_tokens, u.reported_tokens
        return (
            len(self._body) / 4 if prompt is None else prompt,
            u.events if completion is None else completion,  # no events: not a stream
            u.cached_tokens or 0,
            prompt is None or (completion is None and self._stream),
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
        if rec.usage is None or not 200 <= rec.status < 300:
            return
        key = rec.key_name or "unnamed"
        rec.tokens_estimated = estimated
        self._proxy.usage.record(key, self._model, prompt, completion, cached, estimated)
        self._proxy.metrics.tokens(key, self._model, prompt, completion, cached)

    def _body_for(self, backend: Backend) -> bytes:
        target = backend.models.get(self._model, self._model)
        if target == self._model:
            if not self._inject:
                return self._body
            if self._injected is None:
                self._injected = inject(self._body, self._parsed())
            return self._injected
        payload = {**self._parsed(), "model": target}
        return json.dumps(with_usage(payload) if self._inject else payload).encode()

    async def _run(self, send: Send) -> None:
        proxy = self._proxy
        rec = self._record
        exclude: set[str] = set()
        balancer = proxy.registry.balancer_for(self._model)
        last: _Retry | None = None
        trace = self._trace
        admission = proxy.admission
        affinity = proxy.affinity.prepare(balancer, self._client_headers, self._parsed())
        if affinity is not None and proxy.affinity.shared is not None:
            affinity = await proxy.affinity.look_up(affinity, self._backends)  # one round trip
        if affinity is not None and proxy.affinity.wants_tokens(self._model, self._backends):
            affinity = await proxy.affinity.with_tokens(
                affinity, self._model, self._parsed(), self._backends
            )
        picker: Balancer = balancer  # this attempt's: `balancer` bound to the request's affinity
        readings: Readings | None = None

        def bound(eligible: Sequence[Backend]) -> Balancer:
            nonlocal picker
            picker = proxy.affinity.bind(balancer, affinity, eligible) if affinity else balancer
            return picker

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
            readings = all_readings if needs_engine(balancer) else None
            return await proxy.store.acquire(eligible, bound(eligible), exclude, readings)

        async def attempt(number: int, answered: Callable[[], None]) -> None:
            nonlocal last, readings
            trace.queued()
            lease: Lease | None
            if admission is not None and self._ticket is not None and number == 1:
                lease = await admission.acquire(self._ticket, try_admit, self._parked)
            else:
                eligible = proxy.health.eligible(self._backends, self._model)
                readings = proxy.readings() if proxy.readings and needs_engine(balancer) else None
                lease = await proxy.store.acquire(eligible, bound(eligible), exclude, readings)
                if lease is None:
                    raise _NoneLeft
            rec.reason = getattr(picker, "reason", "load")
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
            rec.attempts = number
            try:
                await self._attempt(send, lease, answered)
            except _Retry as retry:
                self._working = False  # that backend failed or refused before it answered
                last = retry
                trace.attempt_failed(retry.kind, retry.response[0] if retry.response else None)
                proxy.metrics.attempt_failed(lease.backend, retry.kind)
                exclude.add(lease.backend)  # the next attempt goes elsewhere
                raise
            finally:
                trace.attempt_end(rec.error)

        try:
            try:
                await proxy.failover.run(attempt)
                return
            except (_Retry, _NoneLeft):  # attempts, deadline, budget or backends ran out
                pass
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
            await exc.response(rec.request_id)({"type": "http"}, _no_receive, send)

    async def _attempt(self, send: Send, lease: Lease, answered: Callable[[], None]) -> None:
        proxy = self._proxy
        rec = self._record
        # The request routes within the snapshot it started with.
        backend = next(b for b in self._backends if b.name == lease.backend)
        rec.backend = backend.name
        response: httpx.Response | None = None
        try:
            own = list(backend.auth_headers)
            if self._hop:
                own.append((HOP_HEADER, self._hop))  # replaces the client's own, if it sent one
            headers = upstream_request_headers(self._client_headers, rec.request_id, own)
            if self._inject:
                # The usage event can only be taken out of bytes that are not compressed.
                headers = [(k, v) for k, v in headers if k.lower() != b"accept-encoding"]
                headers.append((b"accept-encoding", b"identity"))
            transport, request = proxy.pools.request(
                backend,
                self._path,
                self._trace.upstream_headers(headers),
                self._body_for(backend),
            )
            self._working = True
            try:
                response = await transport.handle_async_request(request)
            except UPSTREAM_FAILURES as exc:
                failure = upstream_failure(exc, backend.name)
                proxy.health.on_failure(backend.name, failure.kind)
                raise _Retry(failure.error, failure.kind) from exc

            status = response.status_code
            if status >= 500 or status == 429:
                await self._retryable_status(backend, response)
            streaming = self._stream and status < 400
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
            if response is not None:
                await response.aclose()
            proxy.store.release(lease)
            if proxy.admission is not None:
                proxy.admission.released()

    async def _retryable_status(self, backend: Backend, response: httpx.Response) -> None:
        """Read the (small) error answer, note it, and hand it to the retry loop."""
        proxy = self._proxy
        limit = proxy.settings.max_error_body_bytes
        body = b""
        try:
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > limit:
                    body = body[:limit]
                    break
        except UPSTREAM_FAILURES:
            pass  # what arrived of the error answer is enough
        status = response.status_code
        retry_after = _retry_after(response.headers.get("retry-after"))
        if retry_after is not None and status in (429, 503):
            proxy.health.cool_down(backend.name, retry_after)
        if status >= 500:
            proxy.health.on_failure(backend.name, FailureKind.STATUS, status)
        headers = downstream_response_headers(response.headers.raw, self._record.request_id, False)
        if len(body) >= limit:
            headers = [(k, v) for k, v in headers if k != b"content-length"]
        err = ProxyError(f"Backend `{backend.name}` answered {status}.")
        raise _Retry(err, FailureKind.STATUS, (status, headers, body))

    async def _pump(
        self, send: Send, response: httpx.Response, backend: Backend, streaming: bool
    ) -> None:
        rec = self._record
        tail = b"\n\n"
        usage = rec.usage = ResponseUsage(self._path)
        readable = response.headers.get("content-encoding", "identity") == "identity"
        watch = usage.feed if streaming and readable else usage.keep
        # The usage event sluicegate asked for is read (by `watch`), then taken out.
        strip = None
        if self._inject and streaming and readable:
            strip = UsageStrip(backend.kind == "openai")
        # `bytes` counts what the client was sent, also when it left mid-stream.
        try:
            async for chunk in response.stream:  # type: ignore[union-attr]
                if rec.ttfb_ms is None:
                    rec.ttfb_ms = round((time.perf_counter() - rec.started) * 1000, 2)
                tail = chunk[-2:]
                watch(chunk)
                # Inline (a method call per chunk costs more; `rfind` less than `in`): only a chunk
                # holding the usage object, ending inside an event or following a held part
                # needs the strip.
                if strip is not None and (
                    strip.slow or tail != b"\n\n" or chunk.rfind(USAGE_OBJECT) >= 0
                ):
                    chunk = strip.feed(chunk)
                    if not chunk:
                        continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                rec.bytes_out += len(chunk)
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
            event = sse_error_event(message, "upstream_error", f"upstream_{kind}")
            held = strip.flush() if strip is not None else b""
            if held or tail != b"\n\n":
                event = held + b"\n\n" + event  # end the half event so the error parses alone
            await send({"type": "http.response.body", "body": event, "more_body": False})
            rec.bytes_out += len(event)
            return
        usage.close(readable and response.status_code < 400)
        held = strip.flush() if strip is not None else b""
        rec.bytes_out += len(held)
        await send({"type": "http.response.body", "body": held, "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


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
