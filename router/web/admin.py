"""Admin routes: read and change the backend set (never showing a secret).

    GET    /admin/backends            every backend, with in-flight count and health
    GET    /admin/backends/{name}
    POST   /admin/backends            register (the YAML file's fields)        201 | 409 | 400
    PATCH  /admin/backends/{name}     weight, models, max_inflight, draining   200 | 404 | 400
    DELETE /admin/backends/{name}     drain, wait for streams in flight, remove 200 | 404

Reads need the admin token when one is configured; changes always need it (403 without one).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from balancers.inflight.base import InflightStore
from health.state import HealthBook
from router.core.backend import Backend
from router.core.engine import EngineReading
from router.core.errors import (
    Invalid,
    RegistryError,
    StoreUnavailable,
    answer,
    error_response,
)
from router.core.netpolicy import NetPolicy
from router.core.settings import AdminConfig, BackendConfig, describe_validation
from router.engine.kv_endpoints import config_refusal
from router.registry.fleet import Fleet
from router.web.auth import AdminAuth

_MAX_ADMIN_BODY = 64 * 1024


async def _json_object(request: Request) -> dict[str, Any]:
    body = await request.body()
    if len(body) > _MAX_ADMIN_BODY:
        raise Invalid(f"body: larger than {_MAX_ADMIN_BODY} bytes")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise Invalid("body: not valid JSON") from None
    if not isinstance(data, dict):
        raise Invalid("body: must be a JSON object")
    return data


async def _registration(
    data: dict[str, Any], admin: AdminConfig, policy: NetPolicy
) -> BackendConfig:
    try:
        cfg = BackendConfig.model_validate(data)
    except ValidationError as exc:
        raise Invalid(describe_validation(exc)) from None
    if cfg.api_key_env:
        # The admin API must not become a way to send the router's own secrets (or any other
        # variable of its environment) to a URL of the caller's choosing: only variables meant
        # for backends, by name. The file may name any variable: it is the operator's.
        name = cfg.api_key_env
        if name.upper().startswith("SLUICEGATE_"):
            raise Invalid("api_key_env: may not name a SLUICEGATE_* variable")
        prefix = admin.api_key_env_prefix
        if not name.startswith(prefix):
            raise Invalid(
                f"api_key_env: through the admin API it must start with `{prefix}` "
                "(admin.api_key_env_prefix)"
            )
        if not os.environ.get(name):
            raise Invalid(f"api_key_env: `{name}` is not set in the router's environment")
    host = urlsplit(cfg.url).hostname or ""
    reason = await policy.check_host(host)
    if reason is not None:
        raise Invalid(f"url: {reason} (admin.allowed_backend_networks / denied_backend_networks)")
    if cfg.kv_events is not None:  # its sockets are held to the same networks (and more)
        refusal = await config_refusal(cfg.kv_events, cfg.url, policy, admin.kv_events_bind_and_ipc)
        if refusal is not None:
            raise Invalid(refusal)
    return cfg


def _engine_view(reading: EngineReading | None) -> dict[str, Any] | None:
    """The engine's last reading; None when the backend is not scraped."""
    return reading.public() if reading is not None else None


class BackendRows:
    """Backends as the admin API shows them: config without secrets, in flight, health, the
    engine's last reading and the KV-event state (also what the console's live view lists)."""

    def __init__(
        self,
        fleet: Fleet,
        store: InflightStore,
        health: HealthBook,
        engine_readings: Callable[[], Mapping[str, EngineReading]] | None = None,
        kv_status: Callable[[str], dict[str, Any] | None] | None = None,
        token_load: Callable[[str], dict[str, object]] | None = None,
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.health = health
        self.engine_readings = engine_readings
        self.kv_status = kv_status
        self.token_load = token_load

    async def __call__(self, backends: tuple[Backend, ...]) -> list[dict[str, Any]]:
        store, health, kv_status = self.store, self.health, self.kv_status
        counts = await store.counts([b.name for b in backends])
        readings = self.engine_readings() if self.engine_readings else {}
        return [
            {
                **b.public(),
                "in_flight": counts.get(b.name, 0),
                "inflight_store": store.kind,
                "inflight_shared": store.kind != "local" and not store.degraded,
                "registry_store": self.fleet.store.kind,
                **health.describe(b.name),
                "engine": _engine_view(readings.get(b.name)),
                # KV-cache events: state, lag, blocks indexed, per-publisher seq (None: off)
                "kv_events_state": kv_status(b.name) if kv_status is not None else None,
                # This process's tokens in flight there (prefill: prompt; decode: to come) and
                # `balancer: latency`'s model of it
                "inflight_tokens": self.token_load(b.name) if self.token_load else None,
            }
            for b in backends
        ]


def admin_routes(
    describe: BackendRows,
    auth: AdminAuth,
    drain_grace: float,
    admin: AdminConfig | None = None,
    fallbacks: list[dict[str, Any]] | None = None,
) -> APIRouter:
    router = APIRouter(prefix="/admin")
    admin = admin or AdminConfig()
    policy = NetPolicy.from_config(admin)
    fleet, store = describe.fleet, describe.store
    registry = fleet.registry

    async def in_flight(name: str) -> int:
        return (await store.counts([name])).get(name, 0)

    @router.get("/backends")
    async def list_backends(request: Request) -> Response:
        if denied := auth.check(request, mutating=False):
            return denied
        return JSONResponse(await describe(registry.snapshot.backends))

    @router.get("/fallbacks")
    async def list_fallbacks(request: Request) -> Response:
        """The model fallback chains (docs/fallbacks.md), one row per model and key."""
        if denied := auth.check(request, mutating=False):
            return denied
        return JSONResponse({"data": fallbacks or []})

    @router.get("/backends/{name}")
    async def get_backend(request: Request, name: str) -> Response:
        if denied := auth.check(request, mutating=False):
            return denied
        b = registry.snapshot.by_name.get(name)
        if b is None:
            return error_response(
                404, f"No backend named `{name[:100]}`.", "not_found_error", "backend_not_found"
            )
        return JSONResponse((await describe((b,)))[0])

    @router.post("/backends")
    async def register(request: Request) -> Response:
        if denied := auth.check(request, mutating=True):
            return denied
        try:
            cfg = await _registration(await _json_object(request), admin, policy)
            b = await fleet.register(cfg)
        except (RegistryError, StoreUnavailable) as exc:
            return answer(exc)
        return JSONResponse((await describe((b,)))[0], status_code=201)

    @router.patch("/backends/{name}")
    async def update(request: Request, name: str) -> Response:
        if denied := auth.check(request, mutating=True):
            return denied
        try:
            b = await fleet.update(name, await _json_object(request))
        except (RegistryError, StoreUnavailable) as exc:
            return answer(exc)
        return JSONResponse((await describe((b,)))[0])

    @router.delete("/backends/{name}")
    async def delete(request: Request, name: str) -> Response:
        if denied := auth.check(request, mutating=True):
            return denied
        try:
            result = await fleet.remove(name, lambda: in_flight(name), drain_grace)
        except (RegistryError, StoreUnavailable) as exc:
            return answer(exc)
        return JSONResponse(result)

    return router
