"""The proxied routes, one per row of the endpoint table (`router/core/endpoints.py`), and
`/v1/models`. Each hands the request to the proxy; nothing here does I/O upstream.

With client keys configured every route here needs a key (`Authorization: Bearer <key>` or
`x-api-key`, checked before the body is read), and a key limited to some models sees and reaches
only those. A request refused on its way in (the key check, getting in: a `Refused` of
router/core/errors.py) is answered here, once, in the endpoint's error format (Anthropic's for
the Messages API) by `answer()`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.core.endpoints import ENDPOINTS, FIXED, Endpoint, match_follow
from router.core.errors import Refused, answer, error_response
from router.registry.fleet import Registry
from router.request.lifecycle.drain import Lifecycle
from router.request.lifecycle.proxy import Proxy
from router.web.auth import ClientKeys

PROXIED_PATHS = tuple(e.path for e in ENDPOINTS if e.method == "POST" and "{" not in e.path)

Handler = Callable[[Request], Awaitable[Response]]
log = logging.getLogger("sluicegate.app")


def proxy_endpoints(proxy: Proxy, keys: ClientKeys | None = None) -> dict[Endpoint, Handler]:
    """Each row of the endpoint table -> its handler (client key check, then the proxy)."""
    check = keys.check if keys is not None and keys.enabled else None

    def handler_for(row: Endpoint) -> Handler:
        follows = row.state == "follows"
        anthropic = row.errors == "anthropic"

        async def handler(request: Request) -> Response:
            try:
                response_id = None
                if follows:
                    matched = match_follow(request.method, request.scope["path"])
                    if matched is None:
                        raise Refused("Not Found", status=404)
                    response_id = matched[1]
                if check is None:
                    return await proxy.prepare(request, row, response_id=response_id)
                key = check(request)
                return await proxy.prepare(
                    request,
                    row,
                    key.models,
                    key.name,
                    key.priority,
                    key.weight,
                    key.limits,
                    response_id,
                    key.owner,
                    key.fallbacks,
                    key.slo,
                )
            except Refused as refused:
                return answer(refused, anthropic)

        handler.__name__ = row.method.lower() + "_" + row.path.strip("/").replace("/", "_")
        return handler

    return {row: handler_for(row) for row in ENDPOINTS}


class FastPath:
    """Proxied routes go straight to their handler; everything else to the FastAPI app.

    The proxied routes use none of FastAPI's machinery (no dependencies, no body model), and its
    middleware and routing layers cost about as much CPU per request as the rest of the request
    path did in profiles. The same handlers are also registered as FastAPI routes.
    """

    def __init__(
        self, app: ASGIApp, endpoints: dict[Endpoint, Handler], lifecycle: Lifecycle
    ) -> None:
        self.app = app
        # method -> fixed path -> handler: one dict get per request for a fixed path
        self._fixed: dict[str, dict[str, Handler]] = {
            method: {path: endpoints[row] for path, row in rows.items() if row in endpoints}
            for method, rows in FIXED.items()
        }
        self._follows = {(row.method, row.path): h for row, h in endpoints.items()}
        self.lifecycle = lifecycle  # the server's signal handlers start the drain through it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            paths = self._fixed.get(scope["method"])
            endpoint = paths.get(scope["path"]) if paths is not None else None
            if endpoint is None:
                matched = match_follow(scope["method"], scope["path"])
                if matched is not None:
                    endpoint = self._follows.get((matched[0].method, matched[0].path))
            if endpoint is not None:
                try:
                    response = await endpoint(Request(scope, receive, send))
                except Exception as exc:  # a bug: answer like FastAPI's handler would
                    log.error("unhandled error", exc_info=exc)
                    response = error_response(
                        500, "Internal router error.", "api_error", "internal_error"
                    )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def openai_routes(proxy: Proxy, registry: Registry, keys: ClientKeys | None = None) -> APIRouter:
    router = APIRouter()
    check = keys.check if keys is not None and keys.enabled else None
    for row, handler in proxy_endpoints(proxy, keys).items():
        router.add_api_route(row.path, handler, methods=[row.method], response_class=Response)

    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        models: tuple[str, ...] = registry.snapshot.models
        declared = proxy.holding.models  # known while no backend serves them (scale_from_zero)
        if declared:
            models = (*models, *(m for m in declared if m not in registry.snapshot.by_model))
        if check is not None:
            try:
                key = check(request)
            except Refused as refused:
                return answer(refused)
            if key.models is not None:
                models = tuple(m for m in models if m in key.models)
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "sluicegate"} for m in models
        ]
        return JSONResponse({"object": "list", "data": data})

    return router
