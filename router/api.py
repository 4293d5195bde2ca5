"""OpenAI-compatible routes. Each hands the request to the proxy; nothing here does I/O upstream."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from router.proxy import Proxy
from router.registry import Registry

PROXIED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def openai_routes(proxy: Proxy, registry: Registry) -> APIRouter:
    router = APIRouter()

    def _route(path: str) -> None:
        async def endpoint(request: Request) -> Response:
            return await proxy.prepare(request, path)

        endpoint.__name__ = path.strip("/").replace("/", "_")
        router.add_api_route(path, endpoint, methods=["POST"], response_class=Response)

    for path in PROXIED_PATHS:
        _route(path)

    @router.get("/v1/models")
    async def list_models() -> JSONResponse:
        snap = registry.snapshot
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "sluicegate"}
            for m in snap.models
        ]
        return JSONResponse({"object": "list", "data": data})

    return router
