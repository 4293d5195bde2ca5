"""OpenTelemetry traces of proxied requests: one server span per request, one client span per
upstream attempt, exported over OTLP/HTTP by a batch processor off the request path.

Off unless an endpoint is configured (`tracing.otlp_endpoint`, or `OTEL_EXPORTER_OTLP_ENDPOINT` /
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); then `make_tracing()` returns `OtelTracing`, else
`NO_TRACING`, whose `begin()` hands out one shared do-nothing `RequestTrace`, so the hot path pays
a few empty method calls. A client's `traceparent` is continued; each attempt's upstream request
carries the attempt span's `traceparent` so the engine's own spans join the trace. A request not
sampled (`sample_ratio`, or the client's own flag) records nothing; its upstream request still
carries the trace id, flagged unsampled.

A collector that is down or hangs never reaches a request: ending a span appends it to a bounded
queue (`OTEL_BSP_MAX_QUEUE_SIZE`, default 2048; spans beyond it are dropped) that a background
thread exports, each export giving up after `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` (default 5 s);
shutdown waits for it at most `SHUTDOWN_GRACE` seconds. Span attributes are the
public model names, backend names, counts, statuses and the client key's *name*: never a URL
(it may carry credentials), a header value or a key.

Hostile trace headers cost a counter, not a log line per request: a `traceparent` over
MAX_TRACEPARENT or a `tracestate` over MAX_TRACESTATE characters (the SDK's own limits) is dropped
before the SDK sees it (`on_dropped(header)`, sluicegate_tracing_headers_dropped_total), with one
warning per process; the SDK's own per-request warnings about client trace headers are muted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from router.core.settings import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace import Span, Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Headers = list[tuple[bytes, bytes]]

DEFAULT_SERVICE = "sluicegate"
SHUTDOWN_GRACE = 1.0  # seconds a stopping router waits for the last spans to leave
MAX_TRACEPARENT = 512  # characters; the OTel SDK's limits, which it logs per request past them
MAX_TRACESTATE = 8192
# The SDK's loggers that warn, per request, about what clients put in trace headers.
_CLIENT_INPUT_LOGGERS = ("opentelemetry.trace.propagation.tracecontext", "opentelemetry.trace.span")
log = logging.getLogger("sluicegate.tracing")
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}


class RequestLike(Protocol):
    """What a finished request tells its trace (the proxy's RequestRecord)."""

    request_id: str
    model: str
    path: str
    stream: bool
    started: float
    backend: str | None
    status: int
    attempts: int
    ttfb_ms: float | None
    disconnected: bool
    error: str | None
    key_name: str | None


class UsageLike(Protocol):
    """What the response said about tokens (the proxy's ResponseUsage)."""

    @property
    def first_token_at(self) -> float | None: ...
    @property
    def output_tokens(self) -> int | None: ...
    @property
    def input_tokens(self) -> int | None: ...
    @property
    def response_model(self) -> str | None: ...


class RequestTrace:
    """The do-nothing trace of one request; `OtelRequestTrace` records. The proxy calls these in
    order: queued, picked, attempt (+ upstream_headers), answered or attempt_failed, attempt_end
    (per attempt), then finish once."""

    __slots__ = ()

    def queued(self) -> None:
        return None

    def picked(self, backend: str, reason: str | None = None) -> None:
        return None

    def attempt(self, backend: str, number: int) -> None:
        return None

    def upstream_headers(self, headers: Headers) -> Headers:
        return headers

    def answered(self, status: int) -> None:
        return None

    def attempt_failed(self, kind: str, status: int | None = None) -> None:
        return None

    def attempt_end(self, failure: str | None = None) -> None:
        return None

    def migrated(self, backend: str, number: int, result: str, reason: str) -> None:
        return None

    def fell_back(self, model: str, to: str, reason: str) -> None:
        """The request goes on as a request for fallback model `to` (docs/fallbacks.md)."""
        return None

    def prefill(self, backend: str) -> None:
        """A split request's prefill leg starts (its span ends at `prefill_end`)."""
        return None

    def prefill_end(self, failure: str | None = None, status: int | None = None) -> None:
        return None

    def finish(self, rec: RequestLike, usage: UsageLike | None) -> None:
        return None


NO_TRACE = RequestTrace()


class Tracing:
    """Tracing switched off."""

    enabled = False

    def begin(self, client_headers: Headers, rec: RequestLike) -> RequestTrace:
        return NO_TRACE

    async def aclose(self) -> None:
        return None


NO_TRACING = Tracing()


@dataclass(frozen=True, slots=True)
class TracingPlan:
    """The resolved settings: config keys first, then the standard OTEL_* variables."""

    endpoint: str  # the full OTLP/HTTP traces URL
    service_name: str
    sample_ratio: float


def resolve(cfg: TracingConfig, environ: Mapping[str, str] = os.environ) -> TracingPlan | None:
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    endpoint = cfg.otlp_endpoint
    if endpoint is None:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None
        if endpoint is None and environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            endpoint = environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
    if not endpoint:
        return None
    if not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    ratio = cfg.sample_ratio
    if ratio is None:
        try:
            ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG") or 1.0)
        except ValueError:
            ratio = 1.0
        ratio = min(1.0, max(0.0, ratio))
    service = cfg.service_name or environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE
    return TracingPlan(endpoint, service, ratio)


def make_tracing(cfg: TracingConfig, on_dropped: Callable[[str], None] | None = None) -> Tracing:
    """`on_dropped(header)`: a client's oversized trace header was dropped."""
    plan = resolve(cfg)
    return NO_TRACING if plan is None else OtelTracing(plan, on_dropped)


class OtelTracing(Tracing):
    """A TracerProvider of this app's own (no global provider), a parent-based ratio sampler and
    an OTLP/HTTP exporter behind a BatchSpanProcessor (its OTEL_BSP_* variables apply)."""

    enabled = True

    def __init__(self, plan: TracingPlan, on_dropped: Callable[[str], None] | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.plan = plan
        self._on_dropped = on_dropped
        self._warned = False  # one warning per process for oversized trace headers
        for name in _CLIENT_INPUT_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        self._provider: TracerProvider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(plan.sample_ratio)),
            resource=Resource.create({"service.name": plan.service_name}),
            shutdown_on_exit=False,  # its atexit flush could wait 30 s on a hung collector
        )
        # Each export gives up after a few seconds; the queue is bounded meanwhile.
        timeout = float(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or 5)
        self._processor: BatchSpanProcessor = BatchSpanProcessor(
            OTLPSpanExporter(endpoint=plan.endpoint, timeout=timeout)
        )
        self._provider.add_span_processor(self._processor)
        self.tracer: Tracer = self._provider.get_tracer("sluicegate")
        self.propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()
        # perf_counter -> epoch ns, for timestamps the proxy records on its own clock.
        self.epoch_offset_ns = time.time_ns() - time.perf_counter_ns()

    def begin(self, client_headers: Headers, rec: RequestLike) -> RequestTrace:
        return OtelRequestTrace(self, client_headers, rec)

    def carrier(self, client_headers: Headers) -> dict[str, str]:
        """The client's trace headers the SDK may read: oversized ones dropped and counted."""
        carrier: dict[str, str] = {}
        for k, v in client_headers:
            name = k.lower()
            if name == b"traceparent":
                carrier["traceparent"] = v.decode("latin-1")
            elif name == b"tracestate":  # several fields make one list (RFC 9110 5.3)
                given = carrier.get("tracestate")
                value = v.decode("latin-1")
                carrier["tracestate"] = value if given is None else f"{given},{value}"
        for header, limit in (("traceparent", MAX_TRACEPARENT), ("tracestate", MAX_TRACESTATE)):
            if len(carrier.get(header, "")) > limit:
                del carrier[header]
                self._dropped(header, limit)
        return carrier

    def _dropped(self, header: str, limit: int) -> None:
        if self._on_dropped is not None:
            self._on_dropped(header)
        if not self._warned:
            self._warned = True
            log.warning(
                "dropping oversized trace headers from clients (counted in "
                "sluicegate_tracing_headers_dropped_total; warned once)",
                extra={"fields": {"header": header, "max_chars": limit}},
            )

    def wall_ns(self, perf: float) -> int:
        return self.epoch_offset_ns + int(perf * 1e9)

    async def aclose(self) -> None:
        # Off the event loop and bounded: a hung collector must not hold a stopping router, and
        # a daemon thread (not the default executor, joined at exit) may outlive the wait.
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def stop() -> None:
            try:
                # Exports what is queued; may take the exporter's timeout: we wait less.
                self._processor.shutdown()  # type: ignore[no-untyped-call]
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    loop.call_soon_threadsafe(finished)

        threading.Thread(target=stop, name="sluicegate-otel-stop", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done, SHUTDOWN_GRACE)


class OtelRequestTrace(RequestTrace):
    __slots__ = ("_attempt", "_failed", "_owner", "_prefill", "_recording", "_span")

    def __init__(self, owner: OtelTracing, client_headers: Headers, rec: RequestLike) -> None:
        from opentelemetry.trace import SpanKind

        self._owner = owner
        carrier = owner.carrier(client_headers)
        parent = owner.propagator.extract(carrier) if carrier else None
        operation = _OPERATIONS.get(rec.path, "chat")
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": rec.model,
            "http.request.method": "POST",
            "url.path": rec.path,
            "sluicegate.request_id": rec.request_id,
            "sluicegate.stream": rec.stream,
        }
        if rec.key_name:
            attributes["sluicegate.key_name"] = rec.key_name
        self._span: Span = owner.tracer.start_span(
            f"{operation} {rec.model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=owner.wall_ns(rec.started),
        )
        # Not sampled: no attempt spans or events; upstream gets the trace id, flagged unsampled.
        self._recording = self._span.is_recording()
        self._attempt: Span | None = None
        self._prefill: Span | None = None  # a split request's prefill leg, while it runs
        self._failed: tuple[Span, int] | None = None  # a failed attempt, until we know if retried

    def queued(self) -> None:
        if self._recording:
            self._span.add_event("queued")

    def migrated(self, backend: str, number: int, result: str, reason: str) -> None:
        if self._recording:
            attributes: dict[str, str | int] = {
                "sluicegate.backend": backend,  # the one whose stream broke
                "sluicegate.migration": number,
                "sluicegate.migration.result": result,
                "sluicegate.migration.reason": reason,
            }
            self._span.add_event("migration", attributes)

    def fell_back(self, model: str, to: str, reason: str) -> None:
        if self._recording:
            attributes = {
                "sluicegate.fallback.from": model,
                "sluicegate.fallback.to": to,
                "sluicegate.fallback.reason": reason,
            }
            self._span.add_event("fallback", attributes)

    def picked(self, backend: str, reason: str | None = None) -> None:
        if not self._recording:
            return
        attributes = {"sluicegate.backend": backend}
        if reason:
            attributes["sluicegate.reason"] = reason
        self._span.add_event("picked", attributes)

    def attempt(self, backend: str, number: int) -> None:
        if not self._recording:
            return
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._close_failed(retried=True)
        self._attempt = self._owner.tracer.start_span(
            f"attempt {backend}",
            context=set_span_in_context(self._span),
            kind=SpanKind.CLIENT,
            attributes={"sluicegate.backend": backend, "sluicegate.attempt": number},
        )

    def prefill(self, backend: str) -> None:
        if not self._recording:
            return
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._prefill = self._owner.tracer.start_span(
            f"prefill {backend}",
            context=set_span_in_context(self._attempt or self._span),
            kind=SpanKind.CLIENT,
            attributes={"sluicegate.backend": backend, "sluicegate.leg": "prefill"},
        )

    def prefill_end(self, failure: str | None = None, status: int | None = None) -> None:
        span = self._prefill
        if span is None:
            return
        self._prefill = None
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if failure:
            from opentelemetry.trace import StatusCode

            span.set_attribute("error.type", str(failure))
            span.set_status(StatusCode.ERROR)
        span.end()

    def upstream_headers(self, headers: Headers) -> Headers:
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        span = self._prefill or self._attempt or self._span
        self._owner.propagator.inject(carrier, context=set_span_in_context(span))
        out = [(k, v) for k, v in headers if k.lower() not in _TRACE_HEADERS]
        out.extend((k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items())
        return out

    def answered(self, status: int) -> None:
        if self._attempt is not None:
            self._attempt.set_attribute("http.response.status_code", status)

    def attempt_failed(self, kind: str, status: int | None = None) -> None:
        span = self._attempt
        if span is None:
            return
        from opentelemetry.trace import StatusCode

        kind = str(kind)  # a StrEnum: export its plain value
        span.set_attribute("sluicegate.failure_kind", kind)
        span.set_attribute("error.type", kind)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        span.set_status(StatusCode.ERROR)
        # Ended once the next attempt starts (retried) or the request ends (not retried).
        self._failed = (span, time.time_ns())
        self._attempt = None

    def attempt_end(self, failure: str | None = None) -> None:
        span = self._attempt
        if span is not None:
            if failure:  # after the answer started (mid-stream): never retried
                from opentelemetry.trace import StatusCode

                span.set_attribute("sluicegate.failure_kind", str(failure))
                span.set_attribute("error.type", str(failure))
                span.set_status(StatusCode.ERROR)
            span.set_attribute("sluicegate.retried", False)
            span.end()
            self._attempt = None

    def _close_failed(self, retried: bool) -> None:
        if self._failed is not None:
            span, ended = self._failed
            span.set_attribute("sluicegate.retried", retried)
            span.end(end_time=ended)
            self._failed = None

    def finish(self, rec: RequestLike, usage: UsageLike | None) -> None:
        from opentelemetry.trace import StatusCode

        owner = self._owner
        span = self._span
        if not self._recording:
            span.end()
            return
        self._close_failed(retried=False)
        if self._attempt is not None:  # cancelled before the attempt's own `finally` ran
            self.attempt_end()
        if rec.ttfb_ms is not None:
            span.add_event("first byte", timestamp=owner.wall_ns(rec.started + rec.ttfb_ms / 1000))
        attributes: dict[str, Any] = {"sluicegate.attempts": rec.attempts}
        if usage is not None:
            if usage.first_token_at is not None:
                span.add_event("first token", timestamp=owner.wall_ns(usage.first_token_at))
            if usage.response_model:
                attributes["gen_ai.response.model"] = usage.response_model
            if usage.input_tokens is not None:
                attributes["gen_ai.usage.input_tokens"] = usage.input_tokens
            if usage.output_tokens is not None:
                attributes["gen_ai.usage.output_tokens"] = usage.output_tokens
        if rec.backend:
            attributes["sluicegate.backend"] = rec.backend
        if rec.status:
            attributes["http.response.status_code"] = rec.status
        if rec.disconnected:
            span.add_event("client disconnected")
        if rec.error:
            attributes["error.type"] = str(rec.error)
        span.set_attributes(attributes)
        if rec.error or rec.status >= 500:
            span.set_status(StatusCode.ERROR)
        span.end()
