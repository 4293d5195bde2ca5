"""`GET /admin/usage?key=&model=&since=`: token usage per client key and model, by the hour.

Authenticated like the other admin reads (the admin token when one is configured). `since` is
unix seconds or ISO-8601 (default: 7 days ago); `key` (a key's name, `unnamed` for keys without
one) and `model` (the public model name) filter exactly. Answers
`{"object": "list", "data": [{"key", "model", "hour", "hour_unix", "prompt_tokens",
"completion_tokens", "cached_tokens", "requests", "estimated_requests"}]}`, oldest hour first.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from router.core.errors import StoreUnavailable, error_response
from router.request.usage.book import UsageStore, parse_since
from router.web.auth import AdminAuth

_MAX_FILTER = 256


def usage_routes(book: UsageStore, auth: AdminAuth) -> APIRouter:
    router = APIRouter(prefix="/admin")

    @router.get("/usage")
    async def usage(request: Request) -> Response:
        if denied := auth.check(request, mutating=False):
            return denied
        params = request.query_params
        since: float | None = None
        raw = params.get("since")
        if raw is not None:
            try:
                since = parse_since(raw)
            except ValueError:
                return error_response(
                    400,
                    "since: expected unix seconds or an ISO-8601 time (e.g. 2026-11-30T13:00:00Z).",
                    "invalid_request_error",
                    "invalid_since",
                )
        key, model = params.get("key"), params.get("model")
        for name, value in (("key", key), ("model", model)):
            if value is not None and not 0 < len(value) <= _MAX_FILTER:
                return error_response(
                    400,
                    f"{name}: 1 to {_MAX_FILTER} characters.",
                    "invalid_request_error",
                    f"invalid_{name}",
                )
        try:
            rows = await book.query(key, model, since)
        except StoreUnavailable as exc:
            why = type(exc.__cause__ or exc).__name__  # what Redis failed with, if it was asked
            return error_response(
                503,
                f"The shared store (Redis) is unavailable ({why}); usage is "
                "kept in memory and written when it answers.",
                "service_unavailable",
                "usage_unavailable",
                {"retry-after": "1"},
            )
        return JSONResponse({"object": "list", "data": rows})

    return router
