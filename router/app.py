"""create_app(settings) -> FastAPI: builds every object once, owns their lifetimes; no globals."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from balancers.inflight.local import LocalInflight
from health.monitor import HealthMonitor
from health.state import HealthBook
from router.admin import admin_routes
from router.api import openai_routes
from router.errors import error_response
from router.metrics import CONTENT_TYPE, MeteredInflight, Metrics
from router.proxy import Lifecycle, Proxy
from router.registry import Registry, Snapshot
from router.settings import Settings
from router.upstreams import Backend, Pools

log = logging.getLogger("sluicegate.app")

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
}


def create_app(settings: Settings) -> FastAPI:
    backends = [Backend.from_config(b) for b in settings.backends]
    pools = Pools(settings.timeouts, settings.limits)
    health = HealthBook(settings.health, settings.outlier)
    monitor = HealthMonitor(health)

    def on_swap(snapshot: Snapshot) -> None:
        health.sync(snapshot.backends)
        monitor.sync(snapshot.backends)  # new or changed backends are probed at once

    registry = Registry(backends, settings.balancer, settings.model_balancers, on_swap=on_swap)
    metrics = Metrics()
    metrics.backends_known([b.name for b in backends])
    store = MeteredInflight(LocalInflight(), metrics)
    lifecycle = Lifecycle()
    proxy = Proxy(settings, registry, pools, store, health, lifecycle, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for b in registry.snapshot.backends:
            pools.get(b)
        log.info(
            "started",
            extra={"fields": {"backends": len(backends), "models": len(registry.snapshot.models)}},
        )
        await monitor.start()
        try:
            yield
        finally:
            lifecycle.draining = True
            await lifecycle.wait_idle(settings.drain_grace)
            await monitor.aclose()
            await pools.aclose()
            await store.aclose()

    app = FastAPI(
        title="sluicegate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.lifecycle = lifecycle
    app.include_router(openai_routes(proxy, registry))
    app.include_router(admin_routes(registry, store, health))

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        store.check_fallback()
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if lifecycle.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not registry.snapshot.backends:
            return JSONResponse({"status": "no backends"}, status_code=503)
        return JSONResponse({"status": "ready"})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(
            exc.status_code,
            str(exc.detail),
            _STATUS_TYPES.get(exc.status_code, "api_error"),
            None,
            dict(exc.headers or {}),
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(
            422, f"{where}: {first.get('msg', 'invalid')}", "invalid_request_error", "invalid_field"
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("unhandled error", exc_info=exc)
        return error_response(500, "Internal router error.", "api_error", "internal_error")

    return app
