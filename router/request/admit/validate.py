"""What a proxied request must be before any backend is chosen: checked once, at the edge.

`validate()` reads the body (bounded by `max_body_bytes`, or `max_upload_bytes` for a multipart
form), parses it as a JSON object (or finds a form's `model` and `stream` fields), requires a
`model` the client's key may use and some backend serves, and refuses anything else (a `Refused`
of router/core/errors.py carrying the request id, answered by the web face in the client's
format). Nothing here does I/O upstream.

Every body is held against the process's body budget (`max_held_body_bytes`) from its first
byte: its declared length at once, or chunk by chunk as it comes. A body that would not fit gets
503 with Retry-After. A valid request leaves holding exactly its body's bytes (the caller gives
them back when the request ends); every other way out of here has given them back already.
"""

from __future__ import annotations

import os
from collections.abc import Container, Mapping, Set
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from router.core.backend import Backend
from router.core.endpoints import Endpoint
from router.core.errors import BadRequest, Forbidden, OverBudget, TooLarge, Unknown
from router.core.fastjson import loads
from router.request.admit.byte_budget import ByteBudget
from router.request.wire.multipart import BadForm, boundary_of, form_fields

_FORM_FIELDS = frozenset({"model", "stream"})


@dataclass(frozen=True, slots=True)
class ValidRequest:
    body: bytes
    payload: dict[str, Any]
    model: str
    backends: tuple[Backend, ...]
    stream: bool
    model_span: tuple[int, int] | None = None  # a multipart form's model value, for aliases


def request_id_of(header: str | None) -> str:
    """The client's `x-request-id` when it is sane, else a fresh one."""
    if header and 0 < len(header) <= 128 and header.isascii() and header.isprintable():
        return header
    # 128 random bits as 32 hex digits, the shape `uuid4().hex` had: 1.1 us against 5.2 us
    # (timeit), the UUID object and its version bits being of no use to a request id.
    return os.urandom(16).hex()


async def validate(
    request: Request,
    request_id: str,
    max_body_bytes: int,
    allowed_models: Set[str] | None,
    by_model: Mapping[str, tuple[Backend, ...]],
    endpoint: Endpoint | None = None,
    max_upload_bytes: int = 0,
    *,
    bodies: ByteBudget,
    declared: Container[str] = (),
) -> ValidRequest:
    """`allowed_models`: the public names the client's key may use (None: any); `declared`:
    models known while no backend serves them (scale_from_zero: valid with no backends, held
    later). A valid request holds `len(body)` bytes of `bodies`; a refused one holds none."""
    multipart = endpoint is not None and endpoint.body == "multipart"
    body = await _read_body(
        request,
        max(max_upload_bytes, max_body_bytes) if multipart else max_body_bytes,
        bodies,
        request_id,
    )
    try:
        if multipart:
            return _form(
                body,
                request.headers.get("content-type"),
                request_id,
                allowed_models,
                by_model,
                declared,
            )
        return _json(body, request_id, allowed_models, by_model, declared)
    except BaseException:
        bodies.give(len(body))
        raise


def _json(
    body: bytes,
    request_id: str,
    allowed_models: Set[str] | None,
    by_model: Mapping[str, tuple[Backend, ...]],
    declared: Container[str],
) -> ValidRequest:
    try:
        payload = loads(body)  # bench: 4.9 -> 0.55 us on a chat body
    except (ValueError, RecursionError):
        raise BadRequest(
            "The request body is not valid JSON.", code="invalid_json", request_id=request_id
        ) from None
    if not isinstance(payload, dict):
        raise BadRequest(
            "The request body must be a JSON object.", code="invalid_body", request_id=request_id
        )
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise _no_model(request_id)
    backends = _backends_for(model, allowed_models, by_model, request_id, declared)
    return ValidRequest(body, payload, model, backends, payload.get("stream") is True)


def _no_model(request_id: str) -> BadRequest:
    return BadRequest(
        "You must provide a model parameter.", code="missing_model", request_id=request_id
    )


def _backends_for(
    model: str,
    allowed_models: Set[str] | None,
    by_model: Mapping[str, tuple[Backend, ...]],
    request_id: str,
    declared: Container[str],
) -> tuple[Backend, ...]:
    if allowed_models is not None and model not in allowed_models:
        raise Forbidden(
            f"This API key may not use the model `{model[:200]}`.",
            code="model_not_allowed",
            request_id=request_id,
        )
    backends = by_model.get(model)
    if not backends:
        if model in declared:  # no backend yet: held until one is ready
            return ()
        raise Unknown(
            f"The model `{model[:200]}` does not exist.",
            code="model_not_found",
            request_id=request_id,
        )
    return backends


def _form(
    body: bytes,
    content_type: str | None,
    request_id: str,
    allowed_models: Set[str] | None,
    by_model: Mapping[str, tuple[Backend, ...]],
    declared: Container[str],
) -> ValidRequest:
    """A multipart upload: its `model` and `stream` fields, the rest left for the backend."""
    boundary = boundary_of(content_type)
    if boundary is None:
        raise BadRequest(
            "The request body must be multipart/form-data with a boundary.",
            code="invalid_body",
            request_id=request_id,
        )
    try:
        spans = form_fields(body, boundary, _FORM_FIELDS)
    except BadForm as bad:
        raise BadRequest(str(bad), code=bad.code, request_id=request_id) from None
    span = spans.get("model")
    model = body[span[0] : span[1]].decode("utf-8", "replace").strip() if span else ""
    if not model:
        raise _no_model(request_id)
    backends = _backends_for(model, allowed_models, by_model, request_id, declared)
    at = spans.get("stream")
    stream = at is not None and body[at[0] : at[1]].strip().lower() == b"true"
    return ValidRequest(body, {"model": model, "stream": stream}, model, backends, stream, span)


def too_big(limit: int, request_id: str) -> TooLarge:
    """A body over `limit` bytes (also the endpoint picker's, which buffers bodies itself)."""
    return TooLarge(f"The request body exceeds {limit} bytes.", request_id=request_id)


def over_budget(request_id: str) -> OverBudget:
    """A body the body budget (`max_held_body_bytes`) has no room for."""
    return OverBudget(
        "The router holds as many request bodies as it may (max_held_body_bytes); retry shortly.",
        request_id=request_id,
    )


async def _read_body(request: Request, limit: int, bodies: ByteBudget, request_id: str) -> bytes:
    # A refusal is built only when it is raised: building an answer for every request (a
    # Response, a json.dumps) cost ~25 us each, measured.
    declared = request.headers.get("content-length")
    taken = 0  # bytes held in `bodies` for this body
    if declared is not None and declared.isdigit():
        taken = int(declared)
        if taken > limit:
            raise too_big(limit, request_id)
        # Held before the first byte is read: a body that cannot fit is not read at all.
        if not bodies.take(taken):
            raise over_budget(request_id)
    chunks: list[bytes] = []
    size = 0
    whole = False
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > taken:  # no length declared (chunked), or more than it said
                if size > limit:
                    raise too_big(limit, request_id)
                if not bodies.take(size - taken):
                    raise over_budget(request_id)
                taken = size
            chunks.append(chunk)
        whole = True
    except ClientDisconnect:  # gone, or cut at server.body_timeout
        raise BadRequest("Client disconnected.", request_id=request_id) from None
    finally:  # also when cancelled
        if not whole:
            bodies.give(taken)
    if taken > size:
        bodies.give(taken - size)
    return b"".join(chunks)
