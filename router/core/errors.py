"""The project's own errors, the one map from foreign exceptions to them, and the one rendering
of an error a client is answered with.

SluicegateError                  every error raised on purpose; str() is safe to show
  ├── Refused                    the router refuses the request itself, before any backend
  │     ├── BadRequest           (400, the body, a limit field or a header is wrong; the client
  │     │                        left before its body was read)
  │     ├── Unauthorized         (401, no client key, or an unknown one)
  │     ├── Forbidden            (403, the key may not use the model)
  │     ├── Unknown              (404, no such model, or a stored response out of reach)
  │     ├── TooLarge             (413, a body over max_body_bytes / max_upload_bytes)
  │     ├── RateLimited          (429, a key's rpm, tpm or max_parallel; an estimate over its
  │     │                        whole tpm, which never fits)
  │     ├── Unavailable          (503, retry shortly)
  │     │     ├── ShuttingDown   (the router drains)
  │     │     └── OverBudget     (max_held_body_bytes of bodies are held already)
  │     └── Loop                 (508, the request passed here before, or through MAX_HOPS routers)
  ├── ProxyError                 it got in, but no backend's answer reached the client (502)
  │     ├── UpstreamConnectError (502, a backend could not be reached or closed before answering)
  │     ├── UpstreamTimeout      (504, a backend did not answer in time)
  │     └── NoCapacity           (503, every candidate is full, ejected or cooling down)
  │           ├── QueueTimeout   (request/admit/admission.py: it waited past its deadline)
  │           ├── QueueFull      (request/admit/admission.py: shed from a full queue)
  │           ├── NoBackend      (request/admit/holding.py: a declared model's request held
  │           │                  past its timeout with no backend ready)
  │           ├── TooManyHeld    (request/admit/holding.py: max_held of the model's requests
  │           │                  are held already)
  │           └── SloUnattainable (429, request/lifecycle/attempt.py: a sheddable request no
  │                              engine is predicted to serve within its SLO, `balancer: latency`)
  ├── StoreUnavailable           a shared store (Redis) did not answer; callers fall back or 503
  │     └── ScriptFailed         (state/store.py: a store's script failed on its arguments: no
  │                              outage; a quota check answers it 429)
  └── RegistryError              an admin change that cannot be made (400)
        ├── Invalid              (400, a field is wrong)
        ├── NotFound             (404)
        └── Conflict             (409)

Each carries what its answer needs: `status`, `code`, `message`, and where they apply the
`request_id`, the `param` at fault, more `headers` (Retry-After, x-ratelimit-*), and OpenAI's
error `type_` where it is not its status's own (`STATUS_TYPES`). Getting in raises a `Refused`;
the web face (router/web/api.py) catches it and renders it once with `answer(error, anthropic)`,
which also renders a `ProxyError` (the lifecycle's, router/request/lifecycle/proxy.py) and an
admin change's error: OpenAI's `{"error": {message, type, code, param}}`, or Anthropic's
`{"type": "error", "error": {type, message}}` (`ANTHROPIC_TYPES`) on the Messages API's paths; the
same status and headers either way.

Raised in a foreign tree, for the code that speaks it; they reach ours through the maps below
(`upstream_failure()`, after the transport turns NetworkRefused into an httpx.ConnectError;
`store_unavailable()`):
  httpx.RemoteProtocolError
    └── InvalidUpstreamResponse  an answer the upstream transport refuses to relay
  httpx.ConnectError
    └── UpstreamTlsError         the TLS handshake with a backend failed
  redis.exceptions.ClusterDownError
    └── SlotNotCovered           (core/redis_client.py: no primary serves the slot)
  OSError
    └── NetworkRefused           (core/netpolicy.py: a backend address the policy refuses; a
                                 connect failure to the attempt, a refused KV endpoint)

Never reaching a client as they are: each is caught by its module's caller, which says what
happens (an error of the tree above, a reading or event dropped, a log line, a CLI message):
  request/lifecycle/endings.py   Retry, Broken, NoneLeft, Refusal: the attempt loop's control flow
                                 (another backend, a migration, a fallback model, or the last
                                 ProxyError or backend answer answered)
  request/admit/estimate.py      BadLimit: a limit field refused; answered as a BadRequest
  request/wire/multipart.py      BadForm: a form refused; answered as a BadRequest
  request/placement/pd.py        BadPrefillAnswer: a prefill answer unusable; a ProxyError
  request/migration/continuation.py  CannotContinue: a broken stream ends with an error event
  request/placement/tokens.py    TokenizerError: a tokenizer that cannot be loaded (startup)
  engine/lora_loads.py           LoadFailed: an adapter load failed; a failure kind, a retry
  engine/parse.py                MetricsError: an engine's /metrics text refused
  engine/scraper.py              _BadStatus: an engine's /metrics answered other than 200
  engine/adapters.py             AdaptersError: an engine's model list refused
  engine/kv_wire.py              WireError: a KV-event message refused
  engine/kv_endpoints.py         EndpointRefused: a KV-event endpoint refused
  core/settings.py               ConfigError: a configuration that cannot start the router
  batch/files.py                 BadFile, TooBig: a batch input refused; a BadRequest, a TooLarge
  batch/upload.py                BadUpload: an upload's form refused; a BadRequest
  core/tls.py                    TlsError: a TLS setting that cannot make a context
  tools/status.py                StatusError: `sluicegate status` could not ask the router
  tools/mock/wire.py             RequestError: the mock engine's refusal of a request
tests/core/test_errors.py checks that every exception class of router/, balancers/ and health/ is
named here.

A backend's refusal that another model may not meet (a prompt over its context, a content
policy) is told from an ordinary 400 once, by `refusal_reason()` and its tables of engines'
wordings; `FallbackReason` names why a request went to a fallback model.

Foreign exceptions (httpx's tree, which the upstream transport speaks; OSError, TimeoutError;
redis-py) are mapped here and nowhere else: `upstream_failure()` for an attempt at a backend,
`store_unavailable()` for Redis. `FailureKind` names what went wrong with an attempt, for health,
metrics and logs alike.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import httpx
from starlette.responses import Response

# Upstream or our own message text never carries secrets: messages are built here from fixed
# strings plus model/backend names, never from exception reprs that may hold URLs with keys.

Headers = Sequence[tuple[bytes, bytes]]
RETRY_SOON: Headers = ((b"retry-after", b"1"),)


def error_payload(
    message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> bytes:
    error: dict[str, str | int | None] = {"message": message, "type": type_}
    if param is not None:
        error["param"] = param  # the request field at fault, where OpenAI puts it
    error["code"] = code
    return json.dumps({"error": error}).encode()


STATUS_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
}


def type_for_status(status: int) -> str:
    """OpenAI's error `type` for a status we answer ourselves."""
    return STATUS_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_response(
    status: int,
    message: str,
    type_: str,
    code: str | int | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> Response:
    return Response(
        error_payload(message, type_, code, param),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def sse_error_event(message: str, type_: str, code: str, anthropic: bool = False) -> bytes:
    """The closing events of a stream that failed after it began (Anthropic's: one `error`
    event, which its SDKs raise)."""
    if anthropic:
        return b"event: error\ndata: " + anthropic_payload(message, "api_error") + b"\n\n"
    return b"data: " + error_payload(message, type_, code) + b"\n\ndata: [DONE]\n\n"


ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_payload(message: str, type_: str) -> bytes:
    return json.dumps({"type": "error", "error": {"type": type_, "message": message}}).encode()


def answer(error: SluicegateError, anthropic: bool = False) -> Response:
    """The one rendering of an error a client is answered with: its status; `x-request-id`, then
    its own headers; its message in the endpoint's format (Anthropic's for the Messages API)."""
    status = error.status
    if anthropic:
        fallback = "invalid_request_error" if status < 500 else "api_error"
        body = anthropic_payload(error.message, ANTHROPIC_TYPES.get(status, fallback))
    else:
        type_ = error.type_ or type_for_status(status)
        body = error_payload(error.message, type_, error.code, error.param)
    out = Response(body, status_code=status, media_type="application/json")
    head = list(error.headers)
    if error.request_id is not None:
        head.insert(0, (b"x-request-id", error.request_id.encode()))
    out.raw_headers[:0] = head  # before content-length and content-type
    return out


class SluicegateError(Exception):
    """Every error the project raises on purpose; str() is safe to show (never holds a secret).
    The class attributes are its answer's defaults (`answer()`)."""

    status = 500
    code: str | None = "internal_error"
    type_: str | None = None  # OpenAI's error type, where it is not `type_for_status(status)`'s
    param: str | None = None  # the request field at fault
    request_id: str | None = None
    headers: Headers = ()  # more headers of its answer, after x-request-id

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Refused(SluicegateError):
    """A request the router refuses itself, before any backend is picked: raised by getting in
    (router/request/admit/, router/request/lifecycle/getting_in.py) and the client-key check,
    answered once by the web face. Keywords given replace the class's defaults."""

    status = 400
    code = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        request_id: str | None = None,
        param: str | None = None,
        headers: Headers | None = None,
        status: int | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.request_id = request_id
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param
        if headers is not None:
            self.headers = headers
        if status is not None:
            self.status = status
        if type_ is not None:
            self.type_ = type_


class BadRequest(Refused):
    status = 400


class Unauthorized(Refused):
    status = 401
    type_ = "invalid_request_error"  # OpenAI's for a missing or unknown key


class Forbidden(Refused):
    status = 403


class Unknown(Refused):
    status = 404
    type_ = "invalid_request_error"  # OpenAI's for an unknown model or stored response


class TooLarge(Refused):
    status = 413
    code = "request_too_large"


class RateLimited(Refused):
    status = 429
    code = "rate_limit_exceeded"


class Unavailable(Refused):
    status = 503
    type_ = "service_unavailable"
    headers = RETRY_SOON


class ShuttingDown(Unavailable):
    code = "shutting_down"


class OverBudget(Unavailable):
    code = "bodies_over_budget"


class Loop(Refused):
    status = 508


class ProxyError(SluicegateError):
    status = 502
    type_ = "upstream_error"
    code = "upstream_error"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        if retry_after is not None:
            self.headers = ((b"retry-after", b"%d" % max(1, round(retry_after))),)


class UpstreamConnectError(ProxyError):
    status = 502
    code = "upstream_connect_error"


class UpstreamTimeout(ProxyError):
    status = 504
    code = "upstream_timeout"


class NoCapacity(ProxyError):
    status = 503
    type_ = "service_unavailable"
    code = "no_capacity"


class NoBackend(NoCapacity):
    code = "no_backend"


class TooManyHeld(NoCapacity):
    code = "too_many_held"


class SloUnattainable(NoCapacity):
    """Shed at once, not queued: waiting would only make its SLO further out of reach."""

    status = 429
    type_ = "rate_limit_exceeded"
    code = "slo_unattainable"


class StoreUnavailable(SluicegateError):
    """Redis did not answer in time or refused. The message names only the exception type: the
    foreign exception's own text may carry the Redis address or password."""

    status = 503
    code = "registry_unavailable"


class RegistryError(SluicegateError):
    """An admin change that cannot be made."""

    status = 400
    code = "invalid_request"


class NotFound(RegistryError):
    status = 404
    code = "backend_not_found"


class Conflict(RegistryError):
    status = 409
    code = "backend_exists"


class Invalid(RegistryError):
    status = 400
    code = "invalid_field"


class FailureKind(StrEnum):
    """What went wrong with one attempt at a backend (the values are metric label values)."""

    CONNECT = "connect"  # no connection, it closed before an answer, or the answer was invalid
    TIMEOUT = "timeout"  # connect, write or the first byte took too long
    POOL = "pool"  # our own pool to it had no free connection: not the backend's failure
    STATUS = "status"  # it answered 5xx or 429
    MID_STREAM = "mid_stream"  # it failed after the answer began
    LORA_LOAD = "lora_load"  # loading the request's LoRA adapter there failed (not its health)


class InvalidUpstreamResponse(httpx.RemoteProtocolError):
    """An answer the upstream transport refuses to relay (a head over its limits, a 101, a status
    outside 100-599); it drops the connection. Raised in httpx's tree, mapped below."""


class UpstreamTlsError(httpx.ConnectError):
    """The TLS handshake with a backend failed (its certificate refused, or the backend refused
    ours): a connect error everywhere, told apart in probe reasons and logs."""


@dataclass(frozen=True, slots=True)
class UpstreamFailure:
    kind: FailureKind
    error: ProxyError


# Most specific first: the first entry the exception is an instance of wins.
_UPSTREAM: tuple[tuple[type[BaseException], FailureKind, type[ProxyError], str], ...] = (
    (
        httpx.PoolTimeout,
        FailureKind.POOL,
        UpstreamConnectError,
        "No connection to backend `{}` is free.",
    ),
    (
        httpx.ConnectError,
        FailureKind.CONNECT,
        UpstreamConnectError,
        "Could not connect to backend `{}`.",
    ),
    (
        httpx.ConnectTimeout,
        FailureKind.CONNECT,
        UpstreamConnectError,
        "Could not connect to backend `{}`.",
    ),
    (
        httpx.TimeoutException,
        FailureKind.TIMEOUT,
        UpstreamTimeout,
        "Backend `{}` did not answer in time.",
    ),
    (TimeoutError, FailureKind.TIMEOUT, UpstreamTimeout, "Backend `{}` did not answer in time."),
    (
        InvalidUpstreamResponse,
        FailureKind.CONNECT,
        UpstreamConnectError,
        "Backend `{}` sent an invalid response.",
    ),
    (
        httpx.TransportError,
        FailureKind.CONNECT,
        UpstreamConnectError,
        "Backend `{}` closed the connection before answering.",
    ),
    (
        OSError,
        FailureKind.CONNECT,
        UpstreamConnectError,
        "Backend `{}` closed the connection before answering.",
    ),
)

UPSTREAM_FAILURES: tuple[type[BaseException], ...] = tuple(row[0] for row in _UPSTREAM)


def upstream_failure(exc: BaseException, backend: str) -> UpstreamFailure:
    """The one map from what an attempt at `backend` can raise to a failure kind and the error the
    client would see. Raises `exc` again when it is not a failure of the upstream (a bug)."""
    for foreign, kind, error, message in _UPSTREAM:
        if isinstance(exc, foreign):
            return UpstreamFailure(kind, error(message.format(backend)))
    raise exc


def mid_stream_kind(exc: BaseException) -> FailureKind:
    """A stream that began and then broke: it timed out, or it failed otherwise."""
    return (
        FailureKind.TIMEOUT
        if isinstance(exc, httpx.TimeoutException | TimeoutError)
        else (FailureKind.MID_STREAM)
    )


class FallbackReason(StrEnum):
    """Why a request went to a fallback model (docs/fallbacks.md; the metric's `reason`)."""

    ERROR = "error"  # `fallbacks`: its own backends failed, were full, ejected or cooling down
    CONTEXT_WINDOW = "context_window"  # `context_window_fallbacks`: the prompt does not fit
    CONTENT_POLICY = "content_policy"  # `content_policy_fallbacks`: a content-policy refusal
    MID_STREAM = "mid_stream"  # `fallbacks`: a stream broke and no engine of its own continued


# An engine's refusal of a prompt too long for its context, by the wording of each version
# (tests/core/test_error_classes.py holds each row to its version's text). Matched in the
# first bytes of a 400's body only.
CONTEXT_WINDOW_TEXTS: tuple[tuple[str, re.Pattern[bytes]], ...] = (
    # vLLM <= 0.6: "... However, you requested N tokens (P in the messages, C in the completion)"
    ("vllm-0.6", re.compile(rb"maximum context length is \d+ tokens\. However, you requested")),
    # vLLM 0.7-0.10: "... However, your request has N input tokens. Please reduce ..."
    ("vllm-0.8", re.compile(rb"maximum context length is \d+ tokens\. However, your request has")),
    # vLLM >= 0.8: "'max_tokens' or 'max_completion_tokens' is too large: C. This model's
    # maximum context length is N tokens and your request has P input tokens (C > N - P)."
    ("vllm-0.9", re.compile(rb"is too large: \d+\. This model's maximum context length is")),
    # vLLM >= 0.11 (the V1 processor): "The decoder prompt (length P) is longer than the
    # maximum model length of N."
    ("vllm-0.11", re.compile(rb"prompt \(length \d+\) is longer than the maximum model length")),
    # vLLM 0.32: "... However, your prompt contains at least N input tokens, which exceeds
    # this limit even without any output tokens."
    ("vllm-0.32", re.compile(rb"maximum context length is \d+ tokens\. However, your prompt")),
    ("vllm-0.32-max-tokens", re.compile(rb"max_tokens=\d+ cannot be greater than max_model_len")),
    # SGLang: "Input length (P tokens) exceeds the maximum allowed length (N tokens)."
    ("sglang", re.compile(rb"Input length \(\d+ tokens\) exceeds the maximum allowed length")),
    # OpenAI's own API: `"code": "context_length_exceeded"`.
    ("openai", re.compile(rb'"code"\s*:\s*"context_length_exceeded"')),
)
# A content-policy refusal: OpenAI's code, Azure OpenAI's content filter codes.
CONTENT_POLICY_TEXTS: tuple[tuple[str, re.Pattern[bytes]], ...] = (
    ("openai", re.compile(rb'"code"\s*:\s*"content_policy_violation"')),
    ("azure", re.compile(rb'"code"\s*:\s*"(?:content_filter|ResponsibleAIPolicyViolation)"')),
)
_CLASS_WINDOW = 4096  # bytes of an error body the texts are looked for in


def refusal_reason(status: int, body: bytes) -> FallbackReason | None:
    """The one map from a backend's refusal (status, body) to a fallback class: the context
    window or content policy (a 400), or None: an ordinary 4xx, which reaches the client as it
    is. 429 and 5xx are `ERROR`, decided where the attempts run out."""
    if status != 400:
        return None
    head = body[:_CLASS_WINDOW]
    for _, pattern in CONTEXT_WINDOW_TEXTS:
        if pattern.search(head):
            return FallbackReason.CONTEXT_WINDOW
    for _, pattern in CONTENT_POLICY_TEXTS:
        if pattern.search(head):
            return FallbackReason.CONTENT_POLICY
    return None


# redis-py's tree is imported on first use (PEP 562), by the modules that talk to Redis: a
# process without Redis never loads redis-py (a third of the router's import time).
if TYPE_CHECKING:
    STORE_FAILURES: tuple[type[BaseException], ...]
    STORE_STALE_CONNECTION: tuple[type[BaseException], ...]


def __getattr__(name: str) -> tuple[type[BaseException], ...]:
    if name == "STORE_FAILURES":
        from redis.exceptions import RedisClusterException, RedisError

        # Redis Cluster's own errors (no slot map, no node reachable) are no RedisError.
        found: tuple[type[BaseException], ...] = (
            RedisError,
            RedisClusterException,
            OSError,
            TimeoutError,
        )
    elif name == "STORE_STALE_CONNECTION":
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        # A pooled connection that died with a Redis restart: reading again on a fresh one is
        # safe.
        found = (RedisConnectionError, RedisTimeoutError, ConnectionError)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = found
    return found


def is_store_failure(exc: BaseException) -> bool:
    """A Redis call's failure; without redis-py loaded only OSError and TimeoutError can be."""
    if isinstance(exc, OSError | TimeoutError):
        return True
    return "redis" in sys.modules and isinstance(exc, __getattr__("STORE_FAILURES"))


def store_unavailable(exc: BaseException) -> StoreUnavailable:
    """The one map from a Redis call's failure to ours. Raises `exc` again when it is not one."""
    if is_store_failure(exc):
        # The exception's own text may carry the Redis address; its type name is enough.
        return StoreUnavailable(f"The shared store (Redis) is unavailable ({type(exc).__name__}).")
    raise exc
