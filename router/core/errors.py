"""The project's own errors, the one map from foreign exceptions to them, and OpenAI's error shape.

SluicegateError
  ├── ProxyError                 an error answered before any byte went to the client (502)
  │     ├── UpstreamConnectError (502, a backend could not be reached or closed before answering)
  │     ├── UpstreamTimeout      (504, a backend did not answer in time)
  │     └── NoCapacity           (503, every candidate is full, ejected or cooling down)
  ├── StoreUnavailable           a shared store (Redis) did not answer; callers fall back or 503
  └── RegistryError              an admin change that cannot be made (400)
        ├── Invalid              (400, a field is wrong)
        ├── NotFound             (404)
        └── Conflict             (409)

Foreign exceptions (httpx's tree, which the upstream transport speaks; OSError, TimeoutError;
redis-py) are mapped here and nowhere else: `upstream_failure()` for an attempt at a backend,
`store_unavailable()` for Redis. `FailureKind` names what went wrong with an attempt, for health,
metrics and logs alike. `STATUS_TYPES` is the one status -> OpenAI error type table;
`ANTHROPIC_TYPES` the same for Anthropic's format (`{"type":"error","error":{"type","message"}}`),
which endpoints of the Messages API answer in (`as_anthropic()`: the same status, headers and
message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

import httpx
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.responses import Response

# Upstream or our own message text never carries secrets: messages are built here from fixed
# strings plus model/backend names, never from exception reprs that may hold URLs with keys.


def error_payload(
    message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> bytes:
    error: dict[str, str | int | None] = {"message": message, "type": type_, "code": code}
    if param is not None:
        error["param"] = param  # the request field at fault, as OpenAI names it
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


def as_anthropic(response: Response) -> Response:
    """One of the router's own OpenAI-format error answers in Anthropic's format: the same
    status, headers (request id, Retry-After, rate limits) and message."""
    status = response.status_code
    try:
        message = str(json.loads(bytes(response.body))["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = "The request failed."
    type_ = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    headers = {
        k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")
    }
    return Response(
        anthropic_payload(message, type_),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


class SluicegateError(Exception):
    """Every error the project raises on purpose; str() is safe to show (never holds a secret)."""


class ProxyError(SluicegateError):
    status = 502
    type_ = "upstream_error"
    code = "upstream_error"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def response(self, request_id: str, anthropic: bool = False) -> Response:
        headers = {"x-request-id": request_id}
        if self.retry_after is not None:
            headers["retry-after"] = str(max(1, round(self.retry_after)))
        answer = error_response(self.status, self.message, self.type_, self.code, headers)
        return as_anthropic(answer) if anthropic else answer


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


# Redis Cluster's own errors (no slot map, no node reachable) are no RedisError.
STORE_FAILURES: tuple[type[BaseException], ...] = (
    RedisError,
    RedisClusterException,
    OSError,
    TimeoutError,
)
# A pooled connection that died with a Redis restart: reading again on a fresh one is safe.
STORE_STALE_CONNECTION: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ConnectionError,
)


def store_unavailable(exc: BaseException) -> StoreUnavailable:
    """The one map from a Redis call's failure to ours. Raises `exc` again when it is not one."""
    if isinstance(exc, STORE_FAILURES):
        # The exception's own text may carry the Redis address; its type name is enough.
        return StoreUnavailable(f"The shared store (Redis) is unavailable ({type(exc).__name__}).")
    raise exc
