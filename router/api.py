"""OpenAI-compatible routes. Each hands the request to the proxy; nothing here does I/O upstream.

With client keys configured every route here needs `Authorization: Bearer <key>` (checked before
the body is read), and a key limited to some models sees and reaches only those.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from router.auth import ClientKeys
from router.proxy import Proxy
from router.registry import Registry

PROXIED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def openai_routes(proxy: Proxy, registry: Registry, keys: ClientKeys | None = None) -> APIRouter:
    router = APIRouter()
    check = keys.check if keys is not None and keys.enabled else None

    def _route(path: str) -> None:
        async def endpoint(request: Request) -> Response:
            if check is None:
                return await proxy.prepare(request, path)
            key = check(request)
            if isinstance(key, Response):
                return key
            return await proxy.prepare(request, path, key.models)

        endpoint.__name__ = path.strip("/").replace("/", "_")
        router.add_api_route(path, endpoint, methods=["POST"], response_class=Response)

    for path in PROXIED_PATHS:
        _route(path)

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
