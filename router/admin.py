"""Admin routes: the backend set as the router sees it (no secrets, ever)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.responses import JSONResponse

from balancers.inflight.base import InflightStore
from health.state import HealthBook
from router.registry import Registry


def admin_routes(registry: Registry, store: InflightStore, health: HealthBook) -> APIRouter:
    router = APIRouter(prefix="/admin")

    async def describe() -> list[dict[str, Any]]:
        snap = registry.snapshot
        counts = await store.counts([b.name for b in snap.backends])
        return [
            {
                **b.public(),
                "in_flight": counts.get(b.name, 0),
                "inflight_store": store.kind,
                "inflight_shared": store.kind != "local" and not store.degraded,
                **health.describe(b.name),
            }
            for b in snap.backends
        ]

    @router.get("/backends")
    async def list_backends() -> JSONResponse:
        return JSONResponse(await describe())

    return router
