"""One ext_proc stream: one HTTP request through the gateway, picked here, sent by the gateway.

The request goes the proxy's way up to the pick: getting in (`get_in`: drain, hop, validation,
estimate, admission ticket, quota), then one attempt's pick and lease (`Attempts.lease_only`, the
same balancer, `PickContext` and `AttemptLease`). The answer to the request's headers names the
backend; the body goes back to the gateway as streamed chunks; the response's headers, body and
trailers pass through here on their way to the client, which is where the time to first token,
the usage and the end are seen. `close` gives back what the stream took, in reverse order,
however it ended (the response's end, the gateway cancelling the stream, an error): the lease,
the drain count, then getting in's holds closed with the tokens used (`settle`).

While the body comes, its bytes are held in the process's body budget (`max_held_body_bytes`,
the proxy's `bodies`) chunk by chunk, as the proxy holds a body it reads: a chunk that would not
fit is answered 503 `bodies_over_budget` with Retry-After, one over the largest body any
endpoint takes 413. At the pick they pass to getting in's validation, which holds the same body
until `settle`; a stream that ends before the pick gives them back in `close`.

Message order (Envoy's FULL_DUPLEX_STREAMED body modes): request headers, body chunks (the last
with end_of_stream, or followed by trailers), then response headers, body chunks, trailers;
headers with end_of_stream mean no body. Nothing is answered until the request's body is whole:
the pick needs it.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.requests import Request

from balancers.context import NO_CONTEXT
from router.core.backend import Backend
from router.core.endpoints import BY_ROUTE, Endpoint
from router.core.errors import (
    FailureKind,
    ProxyError,
    Refused,
    SluicegateError,
    Unavailable,
    answer,
)
from router.picker import messages
from router.picker.proto.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)
from router.request.admit.admission import PRIORITY_HEADER, QueueFull
from router.request.admit.hops import HOP_HEADER
from router.request.admit.validate import over_budget, request_id_of, too_big
from router.request.lifecycle.attempt import Attempts, attempts_for
from router.request.lifecycle.call import Call
from router.request.lifecycle.endings import NoneLeft
from router.request.lifecycle.getting_in import get_in
from router.request.lifecycle.proxy import settle
from router.request.usage.parse import ResponseUsage

if TYPE_CHECKING:
    from router.app import AppParts

# The objective and fairness headers of the Gateway API Inference Extension, and llm-d's.
OBJECTIVE = ("x-gateway-inference-objective", "x-llm-d-inference-objective")
FAIRNESS = ("x-gateway-inference-fairness-id", "x-llm-d-inference-fairness-id")
FAIRNESS_BUCKETS = 1024
MODEL_REWRITE = "x-llm-d-model-name-rewrite"
_CLIENT_AUTH = ("authorization", "x-api-key")
Out = list[ProcessingResponse]
_NOTHING: Out = []


def endpoint_of(backend: Backend) -> str:
    """`host:port` of a backend, as the gateway's cluster reads it."""
    url = urlsplit(backend.url)
    port = url.port or (443 if url.scheme == "https" else 80)
    host = url.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _no_send(message: Any) -> None:
    raise AssertionError("the gateway sends the request; the picker writes nothing")


class PickerStream:
    __slots__ = (
        "_app",
        "_attempts",
        "_body",
        "_ended",
        "_entered",
        "_headers",
        "_headers_only",
        "_held",
        "_readable",
        "_status",
        "_subset",
        "_usage",
        "call",
    )

    def __init__(self, app: AppParts) -> None:
        self._app = app
        self._headers: list[tuple[str, bytes]] = []
        self._body = bytearray()
        self._held = 0  # bytes of `_body` held in the body budget until the pick
        self._subset: list[str] | None = None
        self.call: Call | None = None  # once it got in
        self._attempts: Attempts | None = None
        self._entered = False  # counted in the drain count
        self._ended = False  # the response came whole: nothing was cut
        self._status = 0
        self._usage: ResponseUsage | None = None
        self._readable = True
        self._headers_only = app.settings.picker.response_body == "none"

    @property
    def done(self) -> bool:
        """Nothing more to answer: the stream may end (with `picker.response_body: none` the
        gateway ends it, after the response's headers, and any body it still sends is passed
        on)."""
        return self._ended and not (self._headers_only and self._status)

    async def handle(self, msg: ProcessingRequest) -> Out:
        """The answers to one message from the gateway (none while the body is still coming)."""
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            self._headers = [
                (h.key.lower(), h.raw_value or h.value.encode())
                for h in msg.request_headers.headers.headers
            ]
            self._subset = _subset(msg)
            if msg.request_headers.end_of_stream:
                return await self._pick(False)
            return _NOTHING
        if kind == "request_body":
            if self.call is not None:
                return _NOTHING  # the body was answered whole already (its trailers follow)
            chunk = msg.request_body.body
            refused = self._hold(chunk)
            if refused is not None:
                self._ended = True
                return [_refusal(refused, _is_anthropic(self._headers))]
            self._body += chunk
            if msg.request_body.end_of_stream:
                return await self._pick(False)
            return _NOTHING
        if kind == "request_trailers":
            if self.call is None:
                answers = await self._pick(True)
                if self._ended:  # refused: the immediate response is the last answer
                    return answers
                return [*answers, messages.REQUEST_TRAILERS]
            return [messages.REQUEST_TRAILERS]
        if kind == "response_headers":
            await self._served(msg)
            return self._response_headers(msg)
        if kind == "response_body":
            body = msg.response_body
            if not self._ended:
                self._response_body(body.body)
            if body.end_of_stream:
                self._finish()
            return [messages.response_chunk(body.body, body.end_of_stream)]
        if kind == "response_trailers":
            self._finish()
            return [messages.RESPONSE_TRAILERS]
        return _NOTHING

    # -- the request ------------------------------------------------------------------------

    def _hold(self, chunk: bytes) -> Refused | None:
        """Hold `chunk` in the body budget; the refusal when it may not be held."""
        settings = self._app.settings
        # The largest body any endpoint takes (validation applies the endpoint's own).
        limit = max(settings.max_upload_bytes, settings.max_body_bytes)
        if len(self._body) + len(chunk) > limit:
            return too_big(limit, self._request_id())
        if not self._app.proxy.bodies.take(len(chunk)):
            return over_budget(self._request_id())
        self._held += len(chunk)
        return None

    def _let_go_body(self) -> None:
        """The buffered body's bytes back to the body budget (at the pick, getting in's
        validation takes them again at once, for the request's whole life)."""
        if self._held:
            self._app.proxy.bodies.give(self._held)
            self._held = 0

    def _request_id(self) -> str:
        return request_id_of(dict(self._headers).get("x-request-id", b"").decode("latin-1"))

    async def _pick(self, trailers: bool) -> Out:
        """Get in, pick and lease; the headers' answer naming the backend, then the body."""
        app = self._app
        self._let_go_body()
        try:
            request, endpoint = self._request()
            call = await self._get_in(request, endpoint)
        except Refused as refused:
            self._ended = True
            return [_refusal(refused, _is_anthropic(self._headers))]
        self.call = call
        call.inject = False  # the client's stream as it asked: no usage event added and hidden
        rec = call.record
        try:
            if self._subset is not None:
                allowed = set(self._subset)
                call.backends = [b for b in call.backends if endpoint_of(b) in allowed]
                if not call.backends:
                    raise Unavailable(
                        f"No endpoint of the subset hint serves `{call.model}`.",
                        code="no_endpoint_in_subset",
                    )
            call.trace = app.tracing.begin(call.client_headers, rec)
            app.lifecycle.enter()
            self._entered = True
            attempts = self._attempts = await attempts_for(app.proxy, call, _no_send)
            try:
                lease = await attempts.lease_only()
            except NoneLeft:
                lease = None
            if lease is None:
                await attempts.give_up()  # raises NoCapacity: nothing eligible
                raise AssertionError("give_up raises")
        except QueueFull as shed:  # shed from a saturated pool: the protocol's 429
            self._ended = True
            rec.status = 429
            return [_refusal(shed, call.anthropic, status=429)]
        except (Refused, ProxyError) as refused:
            self._ended = True
            rec.status = refused.status
            rec.error = refused.code
            return [_refusal(refused, call.anthropic)]
        held = attempts.held
        backend = held.backend
        assert backend is not None
        rec.backend = backend.name
        call.working = True
        listed = [endpoint_of(backend)]
        fallbacks = app.settings.picker.fallbacks
        if fallbacks:
            for other in app.health.eligible(call.backends, call.model):
                if len(listed) > fallbacks:
                    break
                address = endpoint_of(other)
                if address not in listed:
                    listed.append(address)
        body = call.body_for(backend)
        own = [(k.decode("latin-1").lower(), v) for k, v in backend.auth_headers]
        own.append(("x-request-id", rec.request_id.encode()))
        own.append(("content-length", str(len(body)).encode()))
        if call.hop:
            own.append((HOP_HEADER.decode(), call.hop))
        prefill = held.prefill
        if prefill is not None:  # llm-d's: the decode side's sidecar runs the prefill there
            prefiller = call.snapshot.by_name[prefill.backend]
            rec.prefill_backend = prefiller.name
            own.append((messages.PREFILLER, endpoint_of(prefiller).encode()))
        remove = [h for h in _CLIENT_AUTH if app.client_keys.enabled and h not in dict(own)]
        answers = [messages.picked(",".join(listed), own, remove)]
        answers.extend(messages.replay(body, not trailers))
        return answers

    def _request(self) -> tuple[Request, Endpoint]:
        """The request as the routing core reads it: a Starlette request over what came."""
        head = dict(self._headers)
        method = head.get(":method", b"GET").decode("latin-1")
        target = head.get(":path", b"/").decode("latin-1")
        path, _, query = target.partition("?")
        endpoint = BY_ROUTE.get((method, path))
        if endpoint is None or endpoint.state == "follows":
            raise Refused(f"The endpoint picker does not route {method} {path}.", status=404)
        body = bytes(self._body)
        rewrite = head.get(MODEL_REWRITE)
        if rewrite and body:
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None
            if isinstance(payload, dict):
                payload["model"] = rewrite.decode("latin-1")
                body = json.dumps(payload).encode()
        self._body = bytearray()  # the body is held once, by the request from here
        headers = [(k.encode("latin-1"), v) for k, v in self._headers if not k.startswith(":")]
        headers = _mapped(headers, head)
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "raw_path": path.encode("latin-1"),
            "query_string": query.encode("latin-1"),
            "headers": headers,
            "scheme": "http",
            "server": None,
            "client": None,
            "root_path": "",
            "http_version": "1.1",
        }
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return Request(scope, receive), endpoint

    async def _get_in(self, request: Request, endpoint: Endpoint) -> Call:
        app = self._app
        keys = app.client_keys
        if not keys.enabled:
            call = await get_in(
                app.proxy, request, endpoint, None, None, "standard", 1.0, None, None
            )
            tenant = tenant_of(dict(self._headers))
            if tenant is not None and call.ticket is not None:
                call.ticket.tenant = tenant
            return call
        key = keys.check(request)
        return await get_in(
            app.proxy,
            request,
            endpoint,
            key.models,
            key.name,
            key.priority,
            key.weight,
            key.limits,
            None,
            key.owner,
        )

    # -- the response -----------------------------------------------------------------------

    async def _served(self, msg: ProcessingRequest) -> None:
        """The gateway's retry went to a fallback (the `upstream.address` response attribute,
        when its filter sends it, names another endpoint than the pick): the pick failed before
        its first byte, and is charged for it (health, metrics); the lease moves to the engine
        that answers, when it has room."""
        call = self.call
        attempts = self._attempts
        if call is None or attempts is None or attempts.held.backend is None:
            return
        served = _attribute(msg, "upstream.address")
        picked = attempts.held.backend
        if served is None or served == endpoint_of(picked):
            return
        actual = next((b for b in call.backends if endpoint_of(b) == served), None)
        app = self._app
        app.health.on_failure(picked.name, FailureKind.CONNECT)
        app.metrics.attempt_failed(picked.name, FailureKind.CONNECT)
        await attempts.held.close()
        rec = call.record
        rec.backend = None
        rec.attempts += 1
        if actual is not None:
            rec.backend = actual.name
            await attempts.held.take([actual], call.balancer, NO_CONTEXT, None)

    def _response_headers(self, msg: ProcessingRequest) -> Out:
        call = self.call
        if call is None:
            return [messages.response_headers()]
        head = {
            h.key.lower(): h.raw_value or h.value.encode()
            for h in msg.response_headers.headers.headers
        }
        try:
            status = int(head.get(":status", b"0"))
        except ValueError:
            status = 0
        self._status = status
        rec = call.record
        rec.status = status
        call.trace.answered(status)
        call.started = True
        name = rec.backend
        if name is not None and status >= 500:
            self._app.health.on_failure(name, FailureKind.STATUS, status)
        self._readable = head.get("content-encoding", b"identity") == b"identity"
        self._usage = rec.usage = ResponseUsage(call.endpoint.usage)
        settings = self._app.settings
        if msg.response_headers.end_of_stream or self._headers_only:
            self._finish()
        if settings.expose_backend_header and name is not None:
            return [messages.response_headers([("x-sluicegate-backend", name.encode())])]
        return [messages.response_headers()]

    def _response_body(self, chunk: bytes) -> None:
        call = self.call
        usage = self._usage
        if call is None or usage is None:
            return
        rec = call.record
        if rec.ttfb_ms is None:
            rec.ttfb_ms = round((time.perf_counter() - rec.started) * 1000, 2)
            held = self._attempts.held if self._attempts is not None else None
            if held is not None and held.flight is not None:
                held.flight.prefilled()
        if call.stream and self._readable and self._status < 400:
            usage.feed(chunk)
        else:
            usage.keep(chunk)
        rec.bytes_out += len(chunk)

    def _finish(self) -> None:
        """The response came whole."""
        if self._ended:
            return
        self._ended = True
        call = self.call
        if call is None:
            return
        call.working = False
        usage = self._usage
        ok = 0 < self._status < 400
        if usage is not None:
            usage.close(self._readable and ok)
        name = call.record.backend
        if ok and name is not None:
            self._app.health.on_success(name)

    async def close(self) -> None:
        """Give back what the stream took, however it ended."""
        self._let_go_body()
        call = self.call
        if call is None:
            return
        app = self._app
        rec = call.record
        if not self._ended and self._attempts is not None:
            rec.disconnected = True  # the gateway cut the stream: the client or engine left
            if self._usage is not None:
                self._usage.close(False)
        try:
            if self._attempts is not None:
                try:
                    await self._attempts.held.close()
                finally:
                    call.trace.attempt_end(rec.error)
        finally:
            if self._entered:
                app.lifecycle.leave()
            settle(app.proxy, call)


def tenant_of(head: dict[str, bytes]) -> str | None:
    """The admission queue's tenant named by the fairness header (None: no header). Hashed into
    `FAIRNESS_BUCKETS` tenants, so that the ids a client makes up cannot grow the queue's
    per-tenant tags without bound."""
    fairness = next((head[h] for h in FAIRNESS if h in head), None)
    if fairness is None:
        return None
    return f"fairness-{zlib.crc32(fairness) % FAIRNESS_BUCKETS}"


def _subset(msg: ProcessingRequest) -> list[str] | None:
    """The endpoints of the subset hint (None: no hint; an empty list: a hint naming none)."""
    found = msg.metadata_context.filter_metadata.get(messages.SUBSET_NAMESPACE)
    if found is None or messages.SUBSET_KEY not in found.fields:
        return None
    value = found.fields[messages.SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return [i.strip() for i in items if i.strip()]


def _attribute(msg: ProcessingRequest, name: str) -> str | None:
    """A string attribute the gateway sent with the message (its filter's `*_attributes`)."""
    for found in msg.attributes.values():
        value = found.fields.get(name)
        if value is not None and value.WhichOneof("kind") == "string_value":
            return str(value.string_value)
    return None


def _mapped(
    headers: list[tuple[bytes, bytes]], head: dict[str, bytes]
) -> list[tuple[bytes, bytes]]:
    """The objective header as sluicegate's admission band, when it names one."""
    objective = next((head[h] for h in OBJECTIVE if h in head), None)
    if objective is not None and PRIORITY_HEADER not in head:
        band = objective.strip().lower()
        if band in (b"critical", b"standard", b"sheddable"):
            headers.append((PRIORITY_HEADER.encode(), band))
    return headers


def _is_anthropic(headers: Sequence[tuple[str, bytes]]) -> bool:
    path = dict(headers).get(":path", b"").split(b"?")[0]
    row = BY_ROUTE.get(("POST", path.decode("latin-1")))
    return row is not None and row.errors == "anthropic"


def _refusal(
    error: SluicegateError, anthropic: bool = False, status: int | None = None
) -> ProcessingResponse:
    """A refusal as the gateway's local reply, in the endpoint's error format."""
    if status is not None:
        error.status = status
    rendered = answer(error, anthropic)
    details = f"sluicegate_{error.code or 'refused'}"
    return messages.immediate(
        rendered.status_code, rendered.raw_headers, bytes(rendered.body), details
    )
