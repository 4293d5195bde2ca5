"""Every foreign exception the code can meet maps, in `router.core.errors`, to our own error and
failure kind; anything else (a bug) is raised again rather than blamed on a backend."""

from __future__ import annotations

import ast
import asyncio
import importlib
import json
import re
import socket
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.core import errors
from router.core.backend import Backend
from router.core.errors import (
    STORE_FAILURES,
    UPSTREAM_FAILURES,
    FailureKind,
    StoreUnavailable,
    UpstreamConnectError,
    UpstreamTimeout,
    mid_stream_kind,
    store_unavailable,
    type_for_status,
    upstream_failure,
)
from router.core.settings import BackendConfig, PoolLimits, Timeouts
from router.upstream.pools import Pools

# (what the transport or the OS raises, the kind it is, the error the client would get)
UPSTREAM_CASES: list[tuple[BaseException, FailureKind, type[Exception], int]] = [
    (httpx.ConnectError("detail-1"), FailureKind.CONNECT, UpstreamConnectError, 502),
    (httpx.ConnectTimeout("detail-2"), FailureKind.CONNECT, UpstreamConnectError, 502),
    (httpx.PoolTimeout("detail-3"), FailureKind.POOL, UpstreamConnectError, 502),
    (httpx.ReadTimeout("detail-4"), FailureKind.TIMEOUT, UpstreamTimeout, 504),
    (httpx.WriteTimeout("detail-5"), FailureKind.TIMEOUT, UpstreamTimeout, 504),
    (httpx.RemoteProtocolError("detail-6"), FailureKind.CONNECT, UpstreamConnectError, 502),
    (httpx.ReadError("detail-7"), FailureKind.CONNECT, UpstreamConnectError, 502),
    (httpx.WriteError("detail-8"), FailureKind.CONNECT, UpstreamConnectError, 502),
    (TimeoutError(), FailureKind.TIMEOUT, UpstreamTimeout, 504),
    (ConnectionResetError(104, "detail-r"), FailureKind.CONNECT, UpstreamConnectError, 502),
    (BrokenPipeError(32, "detail-p"), FailureKind.CONNECT, UpstreamConnectError, 502),
    (OSError(113, "detail-o"), FailureKind.CONNECT, UpstreamConnectError, 502),
]


@pytest.mark.parametrize(("exc", "kind", "error", "status"), UPSTREAM_CASES)
def test_upstream_exceptions_map_to_a_kind_and_a_client_error(
    exc: BaseException, kind: FailureKind, error: type[Exception], status: int
) -> None:
    assert isinstance(exc, UPSTREAM_FAILURES)
    failure = upstream_failure(exc, "vllm-a")
    assert failure.kind is kind
    assert type(failure.error) is error and failure.error.status == status
    assert "vllm-a" in failure.error.message
    assert "detail" not in failure.error.message  # foreign text (addresses, keys) never shown


def test_a_bug_is_not_an_upstream_failure() -> None:
    with pytest.raises(KeyError):
        upstream_failure(KeyError("oops"), "vllm-a")
    with pytest.raises(ValueError):
        store_unavailable(ValueError("oops"))


def test_mid_stream_failures_are_timeouts_or_breaks() -> None:
    assert mid_stream_kind(httpx.ReadTimeout("x")) is FailureKind.TIMEOUT
    assert mid_stream_kind(TimeoutError()) is FailureKind.TIMEOUT
    assert mid_stream_kind(httpx.RemoteProtocolError("x")) is FailureKind.MID_STREAM
    assert mid_stream_kind(ConnectionResetError()) is FailureKind.MID_STREAM


@pytest.mark.parametrize(
    "exc",
    [
        RedisConnectionError("Error 111 connecting to 10.0.0.7:6379"),
        RedisTimeoutError("Timeout reading from redis://:hunter2@10.0.0.7"),
        ResponseError("NOSCRIPT"),
        TimeoutError(),
        ConnectionRefusedError(111, "refused"),
    ],
)
def test_redis_failures_map_to_store_unavailable_without_their_text(exc: BaseException) -> None:
    assert isinstance(exc, STORE_FAILURES)
    mapped = store_unavailable(exc)
    assert isinstance(mapped, StoreUnavailable) and mapped.status == 503
    assert type(exc).__name__ in str(mapped)
    assert "10.0.0.7" not in str(mapped) and "hunter2" not in str(mapped)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_real_failures_raised_by_our_transport_and_redis_py_are_mapped() -> None:
    """The same exceptions, raised for real: a refused upstream connect through the pools, a
    refused Redis connection through redis-py."""
    port = _closed_port()

    async def main() -> tuple[FailureKind, BaseException]:
        backend = Backend.from_config(
            BackendConfig(name="gone", url=f"http://127.0.0.1:{port}", models=["m"])
        )
        pools = Pools(Timeouts(), PoolLimits())
        try:
            transport, request = pools.request(backend, "/v1/chat/completions", [], b"{}")
            with pytest.raises(UPSTREAM_FAILURES) as upstream:
                await transport.send(request)
        finally:
            await pools.aclose()
        client = aioredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
        try:
            with pytest.raises(STORE_FAILURES) as store:
                await client.get("k")
        finally:
            await client.aclose()
        return upstream_failure(upstream.value, "gone").kind, store.value

    kind, store_exc = asyncio.run(main())
    assert kind is FailureKind.CONNECT
    assert isinstance(store_unavailable(store_exc), StoreUnavailable)


def test_one_status_to_error_type_table() -> None:
    assert type_for_status(401) == "authentication_error"
    assert type_for_status(403) == "permission_error"
    assert type_for_status(404) == "not_found_error"
    assert type_for_status(409) == "conflict_error"
    assert type_for_status(418) == "invalid_request_error"
    assert type_for_status(503) == "api_error"


def _exception_classes() -> list[tuple[str, str]]:
    """(module, class) of every exception class defined in router/, balancers/ and health/:
    each module imported, and its classes that subclass BaseException kept; a class defined
    inside a function (not importable) is found by name in the module's syntax tree."""
    root = Path(__file__).resolve().parents[2]
    found: list[tuple[str, str]] = []
    for package in ("router", "balancers", "health"):
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            module = importlib.import_module(name)
            top = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}
            for cls_name in top:
                cls = getattr(module, cls_name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found.append((name, cls_name))
            nested = {
                n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)
            } - top
            found += [(name, n) for n in nested if n.endswith(("Error", "Exception"))]
    return found


def test_the_tree_names_every_exception_class() -> None:
    """router/core/errors.py's docstring is the one map of the project's exceptions: a new one
    must be placed in it (in the tree, under a foreign base, or among those never answered)."""
    classes = _exception_classes()
    assert len(classes) >= 40  # the walk found the packages
    tree = errors.__doc__ or ""
    missing = [f"{m}.{c}" for m, c in classes if not re.search(rf"(?<![\w.-]){c}(?![\w-])", tree)]
    assert missing == []


def test_every_refusal_renders_in_both_formats_from_its_own_fields() -> None:
    """One `answer()` for every error: the class's defaults, a keyword's replacement, the
    request id first among the headers, and no re-parse (the message is the error's own)."""
    refused = errors.RateLimited(
        "slow down", request_id="r-9", headers=((b"retry-after", b"3"),), param="n"
    )
    openai_answer = errors.answer(refused)
    assert openai_answer.status_code == 429
    assert openai_answer.raw_headers[:2] == [(b"x-request-id", b"r-9"), (b"retry-after", b"3")]
    assert json.loads(bytes(openai_answer.body)) == {
        "error": {
            "message": "slow down",
            "type": "rate_limit_exceeded",
            "param": "n",
            "code": "rate_limit_exceeded",
        }
    }
    anthropic_answer = errors.answer(refused, anthropic=True)
    assert anthropic_answer.raw_headers[:2] == openai_answer.raw_headers[:2]
    assert json.loads(bytes(anthropic_answer.body)) == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    # A subclass's default type (not its status's), and a status given for one refusal.
    unknown = json.loads(bytes(errors.answer(errors.Unknown("gone")).body))["error"]
    assert unknown["type"] == "invalid_request_error" and unknown["code"] is None
    teapot = errors.answer(errors.Refused("no", status=418))
    assert teapot.status_code == 418
    assert json.loads(bytes(teapot.body))["error"]["type"] == "invalid_request_error"
    # Admin changes and upstream failures share it: no request id, no headers of their own.
    conflict = errors.answer(errors.Conflict("taken"))
    assert conflict.status_code == 409 and b"x-request-id" not in dict(conflict.raw_headers)
    assert json.loads(bytes(conflict.body))["error"] == {
        "message": "taken",
        "type": "conflict_error",
        "code": "backend_exists",
    }
