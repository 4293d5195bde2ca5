"""Every kind of refusal, walked through one endpoint of each error format: OpenAI's
(`/v1/chat/completions`) and Anthropic's (`/v1/messages`). Each answer is held to what the router
sent before refusals were raised rather than returned: the status, every header (x-request-id,
retry-after, x-ratelimit-*, x-should-retry; no other) and the body, parsed.

The app is the real one (`create_app`, its lifespan) in this process; no request here reaches a
backend, except the two cooled down for `no_capacity`, which none is picked for.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from starlette.types import Message

from router.core import errors
from router.core.settings import AdmissionConfig, ClientKeyConfig
from router.request.admit.quota import KeyLimits
from tests.request.lifecycle.test_inprocess import BACKENDS, Router, serve

OPENAI = "/v1/chat/completions"
ANTHROPIC = "/v1/messages"
DEPLOYMENT = "dep-refusals"
RID = "rid-1"

KEYS: dict[bytes, dict[str, Any]] = {  # key -> its entry
    b"key-any": {"name": "any"},
    b"key-few": {"name": "few", "models": ["other"]},
    b"key-tpm": {"name": "tpm", "tpm": 10},
    b"key-par": {"name": "par", "max_parallel": 1},
}
CONFIG: dict[str, Any] = {
    "deployment_id": DEPLOYMENT,
    "max_body_bytes": 1024,
    "admission": AdmissionConfig(),
    "api_keys": [
        ClientKeyConfig(sha256=hashlib.sha256(k).hexdigest(), **v) for k, v in KEYS.items()
    ],
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def body(**fields: Any) -> bytes:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return json.dumps({**payload, **fields}).encode()


Prepare = Callable[[Router], Awaitable[None]]


async def _nothing(r: Router) -> None:
    return None


async def _draining(r: Router) -> None:
    r.app.lifecycle.draining = True


async def _bodies_full(r: Router) -> None:
    bodies = r.proxy.bodies
    assert bodies.take(bodies.limit - bodies.held - 10)


async def _slot_taken(r: Router) -> None:
    if r.proxy.quotas.in_use("par")[2] == 0:  # held by the first of the two walks
        await r.proxy.quotas.admit(KeyLimits("par", max_parallel=1, label="par"), 1, "other")


async def _cooled(r: Router) -> None:
    for name in BACKENDS:
        r.proxy.health.cool_down(name, 7.0)


class Kind:
    """One refusal: the request that gets it, and what the OpenAI-format answer is."""

    def __init__(
        self,
        name: str,
        status: int,
        error: dict[str, Any],
        headers: dict[str, str],
        *,
        request: bytes | None = None,
        key: bytes = b"key-any",
        sent: list[tuple[bytes, bytes]] | None = None,
        method: str = "POST",
        prepare: Prepare = _nothing,
        disconnect: bool = False,
    ) -> None:
        self.name = name
        self.status = status
        self.error = error
        self.headers = headers
        self.request = body() if request is None else request
        self.sent = [(b"authorization", b"Bearer " + key), *(sent or [])]
        self.method = method
        self.prepare = prepare
        self.disconnect = disconnect


def _e(message: str, type_: str, code: str | None, **more: Any) -> dict[str, Any]:
    return {"message": message, "type": type_, "code": code, **more}


R = {"x-request-id": RID}
KINDS = [
    Kind(
        "shutting_down",
        503,
        _e("The router is shutting down; retry.", "service_unavailable", "shutting_down"),
        {**R, "retry-after": "1"},
        prepare=_draining,
    ),
    Kind(
        "loop_detected",
        508,
        _e(
            "This request already passed through this router: a backend points back at it.",
            "api_error",
            "loop_detected",
        ),
        R,
        sent=[(b"x-sluicegate-hop", b"other, " + DEPLOYMENT.encode())],
    ),
    Kind(
        "too_many_hops",
        508,
        _e(
            "This request passed through 8 routers already: a routing loop.",
            "api_error",
            "too_many_hops",
        ),
        R,
        sent=[(b"x-sluicegate-hop", b"a, b, c, d, e, f, g, h")],
    ),
    Kind(
        "body_too_large",
        413,
        _e("The request body exceeds 1024 bytes.", "invalid_request_error", "request_too_large"),
        R,
        request=body(pad="x" * 2000),
    ),
    Kind(
        "bodies_over_budget",
        503,
        _e(
            "The router holds as many request bodies as it may (max_held_body_bytes); retry "
            "shortly.",
            "service_unavailable",
            "bodies_over_budget",
        ),
        {"retry-after": "1", **R},
        prepare=_bodies_full,
    ),
    Kind(
        "client_disconnected",
        400,
        _e("Client disconnected.", "invalid_request_error", None),
        R,
        disconnect=True,
    ),
    Kind(
        "invalid_json",
        400,
        _e("The request body is not valid JSON.", "invalid_request_error", "invalid_json"),
        R,
        request=b"{not json",
    ),
    Kind(
        "invalid_body",
        400,
        _e("The request body must be a JSON object.", "invalid_request_error", "invalid_body"),
        R,
        request=b"[1]",
    ),
    Kind(
        "missing_model",
        400,
        _e("You must provide a model parameter.", "invalid_request_error", "missing_model"),
        R,
        request=body(model=""),
    ),
    Kind(
        "model_not_allowed",
        403,
        _e("This API key may not use the model `m`.", "permission_error", "model_not_allowed"),
        R,
        key=b"key-few",
    ),
    Kind(
        "model_not_found",
        404,
        _e("The model `nope` does not exist.", "invalid_request_error", "model_not_found"),
        R,
        request=body(model="nope"),
    ),
    Kind(
        "invalid_limit",
        400,
        _e(
            "Invalid type for 'max_tokens': expected an integer, but got a string.",
            "invalid_request_error",
            "invalid_type",
            param="max_tokens",
        ),
        R,
        request=body(max_tokens="2"),
    ),
    Kind(
        "invalid_priority",
        400,
        _e(
            "Header `x-sluicegate-priority` must be one of: critical, standard, sheddable.",
            "invalid_request_error",
            "invalid_priority",
        ),
        R,
        sent=[(b"x-sluicegate-priority", b"urgent")],
    ),
    Kind(
        "invalid_timeout",
        400,
        _e(
            "Header `x-sluicegate-timeout` must be a positive number of seconds.",
            "invalid_request_error",
            "invalid_timeout",
        ),
        R,
        sent=[(b"x-sluicegate-timeout", b"-1")],
    ),
    Kind(
        "missing_api_key",
        401,
        _e(
            "You didn't provide an API key. Send `Authorization: Bearer <key>` or "
            "`x-api-key: <key>`.",
            "invalid_request_error",
            "missing_api_key",
        ),
        {},
        key=b"",
    ),
    Kind(
        "invalid_api_key",
        401,
        _e("Incorrect API key provided.", "invalid_request_error", "invalid_api_key"),
        {},
        key=b"wrong",
    ),
    Kind(
        "request_too_large_for_key",
        429,
        _e(
            f"Request too large for this key: its estimated {len(body()) // 4 + 2} tokens "
            "(prompt, stored "
            "conversation, and max tokens x n for each prompt) exceed the key's whole limit of "
            "10 tokens per minute, so it can never be admitted. Reduce the input, the max "
            "tokens, n or the number of prompts.",
            "rate_limit_exceeded",
            "request_too_large",
        ),
        {**R, "x-should-retry": "false", "x-ratelimit-limit-tokens": "10"},
        key=b"key-tpm",
    ),
    Kind(
        "rate_limited",
        429,
        _e(
            "Rate limit reached for parallel requests on this key; retry after 1s.",
            "rate_limit_exceeded",
            "rate_limit_exceeded",
        ),
        {"retry-after": "1", **R},
        key=b"key-par",
        prepare=_slot_taken,
    ),
    Kind(
        "method_not_allowed",
        405,
        _e("Method Not Allowed", "invalid_request_error", None),
        {"allow": "POST"},
        method="GET",
    ),
    Kind(
        "no_capacity",
        503,
        _e(
            "Every backend serving `m` is busy or unavailable; retry later.",
            "service_unavailable",
            "no_capacity",
        ),
        # It got in: the answer names the model it was for (docs/fallbacks.md).
        {**R, "retry-after": "7", "x-sluicegate-model": "m"},
        prepare=_cooled,
    ),
]


async def _ask(r: Router, kind: Kind, path: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The app's answer to the kind's request at `path`: status, headers, body."""
    headers = [
        (b"host", b"router.test"),
        (b"content-type", b"application/json"),
        (b"x-request-id", RID.encode()),
        *[(k, v) for k, v in kind.sent if v != b"Bearer "],
    ]
    if not kind.disconnect:
        headers.append((b"content-length", str(len(kind.request)).encode()))
    got: list[Message] = []
    given = False

    async def receive() -> Message:
        nonlocal given
        if kind.disconnect or given:
            return {"type": "http.disconnect"}
        given = True
        return {"type": "http.request", "body": kind.request, "more_body": False}

    async def send(message: Message) -> None:
        got.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": kind.method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "state": {},
    }
    await r.app(scope, receive, send)
    start, *parts = got
    assert start["type"] == "http.response.start"
    return start["status"], list(start["headers"]), b"".join(p.get("body", b"") for p in parts)


def _check(
    answer: tuple[int, list[tuple[bytes, bytes]], bytes], kind: Kind, anthropic: bool
) -> None:
    status, raw, text = answer
    assert status == kind.status, text
    headers = {k.decode(): v.decode() for k, v in raw}
    assert len(headers) == len(raw), f"a header twice: {raw}"
    assert headers.pop("content-type") == "application/json"
    assert headers.pop("content-length") == str(len(text))
    assert headers == kind.headers
    if anthropic:
        fallback = "invalid_request_error" if status < 500 else "api_error"
        expected = {
            "type": "error",
            "error": {
                "type": ANTHROPIC_TYPES.get(status, fallback),
                "message": kind.error["message"],
            },
        }
        assert json.loads(text) == expected
    else:
        assert json.loads(text) == {"error": kind.error}


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_each_refusal_in_each_format(kind: Kind) -> None:
    async def scenario(r: Router) -> None:
        for path, anthropic in ((OPENAI, False), (ANTHROPIC, True)):
            await kind.prepare(r)
            _check(await _ask(r, kind, path), kind, anthropic)
            r.app.lifecycle.draining = False
        assert r.proxy.bodies.held in (0, r.proxy.bodies.limit - 10)

    serve(scenario, **CONFIG)


@pytest.mark.parametrize(
    ("method", "path", "sent", "param"),
    [
        ("GET", "/v1/responses/resp_gone", b"", "response_id"),
        ("POST", "/v1/responses", body(previous_response_id="resp_gone"), "previous_response_id"),
    ],
)
def test_a_stored_response_not_found(method: str, path: str, sent: bytes, param: str) -> None:
    """Only the Responses API (OpenAI's format) follows a stored response."""
    kind = Kind(
        "response_not_found",
        404,
        {
            "message": "Response with id 'resp_gone' not found: the router does not know which "
            "engine stored it (unknown or expired).",
            "type": "invalid_request_error",
            "param": param,
            "code": "response_not_found",
        },
        R,
        request=sent,
        method=method,
    )

    async def scenario(r: Router) -> None:
        _check(await _ask(r, kind, path), kind, False)

    serve(scenario, **CONFIG)


RAISED: dict[str, type[errors.SluicegateError]] = {  # each kind's error (router/core/errors.py)
    "shutting_down": errors.ShuttingDown,
    "loop_detected": errors.Loop,
    "too_many_hops": errors.Loop,
    "body_too_large": errors.TooLarge,
    "bodies_over_budget": errors.OverBudget,
    "client_disconnected": errors.BadRequest,
    "invalid_json": errors.BadRequest,
    "invalid_body": errors.BadRequest,
    "missing_model": errors.BadRequest,
    "model_not_allowed": errors.Forbidden,
    "model_not_found": errors.Unknown,
    "invalid_limit": errors.BadRequest,
    "invalid_priority": errors.BadRequest,
    "invalid_timeout": errors.BadRequest,
    "missing_api_key": errors.Unauthorized,
    "invalid_api_key": errors.Unauthorized,
    "request_too_large_for_key": errors.RateLimited,
    "rate_limited": errors.RateLimited,
    "method_not_allowed": errors.Refused,
    "no_capacity": errors.NoCapacity,
}


def test_every_kind_of_refusal_is_walked() -> None:
    """A refusal added to the tree gets a walk above (its class's status is the one answered)."""
    assert sorted(RAISED) == sorted(k.name for k in KINDS)
    for kind in KINDS:
        assert RAISED[kind.name].status == kind.status or RAISED[kind.name] is errors.Refused

    def leaves(cls: type[errors.Refused]) -> set[type[errors.Refused]]:
        below = cls.__subclasses__()
        return set().union(*(leaves(c) for c in below)) if below else {cls}

    assert leaves(errors.Refused) <= set(RAISED.values())
