"""OpenAI-compatible routes. Each hands the request to the proxy; nothing here does I/O upstream.

With client keys configured every route here needs `Authorization: Bearer <key>` (checked before
the body is read), and a key limited to some models sees and reaches only those.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from router.core.errors import error_response
from router.registry.fleet import Registry
from router.request.drain import Lifecycle
from router.request.proxy import Proxy
from router.web.auth import ClientKeys

PROXIED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")

Endpoint = Callable[[Request], Awaitable[Response]]
log = logging.getLogger("sluicegate.app")


def proxy_endpoints(proxy: Proxy, keys: ClientKeys | None = None) -> dict[str, Endpoint]:
    """Path -> the handler of a proxied POST (client key check, then the proxy)."""
    check = keys.check if keys is not None and keys.enabled else None

    def endpoint_for(path: str) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            if check is None:
                return await proxy.prepare(request, path)
            key = check(request)
            if isinstance(key, Response):
                return key
            return await proxy.prepare(
                request, path, key.models, key.name, key.priority, key.weight, key.limits
            )

        endpoint.__name__ = path.strip("/").replace("/", "_")
        return endpoint

    return {path: endpoint_for(path) for path in PROXIED_PATHS}


class FastPath:
    """Proxied POSTs go straight to their handler; everything else to the FastAPI app.

    The proxied routes use none of FastAPI's machinery (no dependencies, no body model), and its
    middleware and routing layers cost about as much CPU per request as the rest of the request
    path did in profiles. The same handlers are also registered as FastAPI routes.
    """

    def __init__(self, app: ASGIApp, endpoints: dict[str, Endpoint], lifecycle: Lifecycle) -> None:
        self.app = app
        self._endpoints = endpoints
        self.lifecycle = lifecycle  # the server's signal handlers start the drain through it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._endpoints.get(scope["path"])
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
    for path, endpoint in proxy_endpoints(proxy, keys).items():
        router.add_api_route(path, endpoint, methods=["POST"], response_class=Response)

    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        models: tuple[str, ...] = registry.snapshot.models
        if check is not None:
            key = check(request)
            if isinstance(key, Response):
                return key
            if key.models is not None:
                models = tuple(m for m in models if m in key.models)
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "sluicegate"} for m in models
        ]
        return JSONResponse({"object": "list", "data": data})

    return router
