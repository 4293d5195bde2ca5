"""What a proxied request must be before any backend is chosen: checked once, at the edge.

`validate()` reads the body (bounded by `max_body_bytes`), parses it as a JSON object, requires a
`model` the client's key may use and some backend serves, and answers anything else with an
OpenAI-format error carrying the request id. Nothing here does I/O upstream.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from router.core.backend import Backend
from router.core.errors import error_response


@dataclass(frozen=True, slots=True)
class ValidRequest:
    body: bytes
    payload: dict[str, Any]
    model: str
    backends: tuple[Backend, ...]
    stream: bool


def request_id_of(header: str | None) -> str:
    """The client's `x-request-id` when it is sane, else a fresh one."""
    if header and 0 < len(header) <= 128 and header.isascii() and header.isprintable():
        return header
    return uuid.uuid4().hex


async def validate(
    request: Request,
    request_id: str,
    max_body_bytes: int,
    allowed_models: Set[str] | None,
    by_model: Mapping[str, tuple[Backend, ...]],
) -> ValidRequest | Response:
    """`allowed_models`: the public names the client's key may use (None: any)."""
    rid = {"x-request-id": request_id}
    body = await _read_body(request, max_body_bytes)
    if isinstance(body, Response):
        body.headers.update(rid)
        return body
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return error_response(
            400, "The request body is not valid JSON.", "invalid_request_error", "invalid_json", rid
        )
    if not isinstance(payload, dict):
        return error_response(
            400,
            "The request body must be a JSON object.",
            "invalid_request_error",
            "invalid_body",
            rid,
        )
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return error_response(
            400,
            "You must provide a model parameter.",
            "invalid_request_error",
            "missing_model",
            rid,
        )
    if allowed_models is not None and model not in allowed_models:
        return error_response(
            403,
            f"This API key may not use the model `{model[:200]}`.",
            "permission_error",
            "model_not_allowed",
            rid,
        )
    backends = by_model.get(model)
    if not backends:
        return error_response(
            404,
            f"The model `{model[:200]}` does not exist.",
            "invalid_request_error",
            "model_not_found",
            rid,
        )
    return ValidRequest(body, payload, model, backends, payload.get("stream") is True)


async def _read_body(request: Request, limit: int) -> bytes | Response:
    too_big = error_response(
        413,
        f"The request body exceeds {limit} bytes.",
        "invalid_request_error",
        "request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return too_big
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return too_big
            chunks.append(chunk)
    except ClientDisconnect:
        return error_response(400, "Client disconnected.", "invalid_request_error", None)
    return b"".join(chunks)
