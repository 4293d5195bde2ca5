"""create_app(settings) -> ASGI app: builds every object once, owns their lifetimes; no globals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from balancers.inflight.base import InflightStore
from balancers.inflight.local import LocalInflight
from health.monitor import HealthMonitor
from health.state import HealthBook
from router.core.backend import Backend
from router.core.errors import RegistryError, StoreUnavailable, error_response, type_for_status
from router.core.netpolicy import NetPolicy
from router.core.redis_client import RedisTarget
from router.core.settings import Settings
from router.discovery.runner import Discovery
from router.engine.kv_events import KvEvents
from router.engine.scraper import EngineScraper
from router.ops.logs import count_drops, register_secret, secret_header
from router.ops.logs import stop as stop_logging
from router.ops.memory import Trimmer, pin_mmap_threshold
from router.ops.metrics import CONTENT_TYPE, MeteredInflight, Metrics
from router.ops.tracing import make_tracing
from router.registry.admin import admin_routes
from router.registry.fleet import (
    Fleet,
    LocalRecords,
    RecordStore,
    Registry,
    Snapshot,
)
from router.request.admission import Admission
from router.request.affinity import Affinity
from router.request.drain import Lifecycle
from router.request.hops import HopMarker
from router.request.proxy import Proxy
from router.request.quota import QuotaBook, Quotas
from router.request.usage_book import UsageBook
from router.upstream.pools import Pools
from router.web.api import FastPath, openai_routes, proxy_endpoints
from router.web.auth import AdminAuth, ClientKeys
from router.web.usage_admin import usage_routes

log = logging.getLogger("sluicegate.app")


class _Closes(Protocol):
    async def aclose(self) -> None: ...


async def _every(seconds: float, step: Callable[[], Awaitable[None]], what: str) -> None:
    while True:
        await asyncio.sleep(seconds)
        try:
            await step()
        except Exception as exc:  # a background chore must outlive one bad round
            log.warning(f"{what} failed", extra={"fields": {"error": type(exc).__name__}})


def make_store(settings: Settings) -> InflightStore:
    """Local counts unless Redis is configured; then one count shared by every replica."""
    target = RedisTarget.from_settings(settings)
    if target is None:
        return LocalInflight()
    from balancers.inflight.redis import RedisInflight

    return RedisInflight(
        target,
        timeout=settings.redis_timeout,
        lease_ttl=settings.redis_lease_ttl,
        prefix=settings.redis_prefix,
    )


def make_quotas(settings: Settings, metrics: Metrics) -> QuotaBook:
    """Per-key quotas in this process, or shared by every replica when Redis is configured."""
    target = RedisTarget.from_settings(settings)
    if target is None:
        return Quotas(on_refused=metrics.ratelimited)
    from router.request.quota_shared import SharedQuotas

    return SharedQuotas(
        target,
        timeout=settings.redis_timeout,
        slot_ttl=settings.redis_lease_ttl,
        prefix=settings.redis_prefix,
        on_refused=metrics.ratelimited,
        on_degraded=metrics.quota_degraded,
    )


def make_affinity(settings: Settings, metrics: Metrics, kv: KvEvents | None = None) -> Affinity:
    """The prefix index: this process's own, plus the one shared in Redis when configured."""
    target = RedisTarget.from_settings(settings)
    shared = None
    if target is not None:
        from router.request.affinity_store import SharedPrefixIndex

        shared = SharedPrefixIndex(
            target,
            timeout=settings.redis_timeout,
            ttl=settings.affinity.ttl,
            prefix=settings.redis_prefix,
        )
    return Affinity(
        settings.affinity, shared=shared, on_fallback=metrics.affinity_fallbacks.inc, kv=kv
    )


def _record_store(settings: Settings) -> RecordStore:
    target = RedisTarget.from_settings(settings)
    if target is None:
        return LocalRecords()
    from router.registry.sync import RedisRecords

    return RedisRecords(
        target, prefix=f"{settings.redis_prefix}:registry", resync=settings.registry_resync
    )


def _usage_book(settings: Settings, metrics: Metrics) -> UsageBook:
    """Hourly usage in this process, or written to Redis in batches when it is configured."""
    target = RedisTarget.from_settings(settings)
    client = target.client(timeout=2.0, max_connections=4) if target is not None else None
    return UsageBook(client, settings.redis_prefix, on_dropped=metrics.usage_dropped.inc)


def create_app(settings: Settings) -> FastPath:
    backends = [Backend.from_config(b) for b in settings.backends]
    # Backends added at run time (admin API, discovery) reach only the networks allowed.
    policy = NetPolicy.from_config(settings.admin)
    pools = Pools(settings.timeouts, settings.limits, policy)
    metrics = Metrics()
    count_drops(metrics.log_dropped.inc)
    kv_reset: list[Callable[[str], None]] = []

    def health_changed(backend: str, healthy: bool, reason: str) -> None:
        metrics.health_changed(backend, healthy, reason)
        if not healthy:
            for reset in kv_reset:  # an engine that stopped answering may come back empty
                reset(backend)

    health = HealthBook(settings.health, settings.outlier, on_change=health_changed)
    monitor = HealthMonitor(health)
    engine = EngineScraper(
        settings.engine_metrics, on_error=metrics.engine_scrape_failed, policy=policy
    )

    def kv_capacity(name: str) -> int | None:
        """The engine's KV capacity in blocks, as its metrics say."""
        r = engine.readings.get(name)
        if r is None or not r.kv_capacity_tokens or not r.block_size:
            return None
        return r.kv_capacity_tokens // r.block_size

    kv_events = KvEvents(
        capacity=kv_capacity,
        on_events=metrics.kv_events,
        pending_ttl=settings.affinity.pending_ttl,
    )
    kv_reset.append(kv_events.reset)

    def on_swap(snapshot: Snapshot) -> None:
        # Keys of backends added through the admin API are secrets from now on, in logs too.
        register_secret(
            *(
                v.decode("latin-1").split(" ")[-1]
                for b in snapshot.backends
                for k, v in b.auth_headers
                if (name := k.decode("latin-1")) == b.key_header
                or secret_header(name, v.decode("latin-1"))
            )
        )
        health.sync(snapshot.backends)
        monitor.sync(snapshot.backends)  # new or changed backends are probed at once
        engine.sync(snapshot.backends)
        kv_events.sync(snapshot.backends)

    registry = Registry(backends, settings.balancer, settings.model_balancers, on_swap=on_swap)
    fleet = Fleet(
        registry,
        settings.backends,
        _record_store(settings),
        on_invalid=lambda _name: metrics.invalid_records.inc(),
    )
    admin_auth = AdminAuth(settings.admin_token)
    client_keys = ClientKeys(settings.api_keys, settings.api_keys_file)
    metrics.backends_known([b.name for b in backends])
    store = MeteredInflight(make_store(settings), metrics)
    lifecycle = Lifecycle()
    tracing = make_tracing(settings.tracing, metrics.tracing_header_dropped)
    admission = Admission(settings.admission, metrics) if settings.admission else None
    affinity = make_affinity(settings, metrics, kv_events)
    if admission is not None:
        engine.on_change = admission.changed
    quotas = make_quotas(settings, metrics)
    proxy = Proxy(
        settings,
        registry,
        pools,
        store,
        health,
        lifecycle,
        metrics,
        tracing,
        readings=lambda: engine.readings,
        admission=admission,
        quotas=quotas,
        affinity=affinity,
        usage=_usage_book(settings, metrics),
        hops=HopMarker(settings.deployment_id),
    )

    async def counts(names: Sequence[str]) -> dict[str, int]:
        return await store.counts(list(names))

    discovery = Discovery(settings.discovery, fleet, counts, metrics, settings.drain_grace)

    async def close_removed_pools() -> None:
        # A removed backend's pool stays open while its streams run, then closes.
        gone = pools.names() - set(registry.snapshot.by_name)
        if gone:
            counts = await store.counts(sorted(gone))
            for name in gone:
                if not counts.get(name) and name not in registry.snapshot.by_name:
                    await pools.discard(name)

    async def reload_keys() -> None:
        client_keys.reload_if_changed()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            fleet.apply(await fleet.store.load())
        except (RegistryError, StoreUnavailable):
            # Serve the file's entries meanwhile; the watch below keeps trying and catches up.
            log.warning("shared registry unavailable at start; serving the file's backends")
        for b in registry.snapshot.backends:
            pools.get(b)
        await store.start()
        await quotas.start()
        if affinity.shared is not None:
            await affinity.shared.start()
        pin_mmap_threshold()  # big bodies mapped and unmapped: a flood's memory leaves
        chores = [
            asyncio.create_task(fleet.store.watch(fleet.apply)),
            asyncio.create_task(_every(1.0, close_removed_pools, "closing removed pools")),
            asyncio.create_task(_every(5.0, Trimmer().step, "returning freed memory")),
        ]
        if proxy.usage.shared:
            chores.append(asyncio.create_task(proxy.usage.run(settings.usage_flush)))
        if settings.api_keys_file:
            chores.append(
                asyncio.create_task(
                    _every(settings.api_keys_reload, reload_keys, "reloading client keys")
                )
            )
        if settings.workers > 1 and fleet.store.kind == "local" and admin_auth.configured:
            log.warning(
                "admin changes reach only the worker that takes them: set SLUICEGATE_REDIS_URL"
            )
        snap = registry.snapshot
        log.info(
            "started",
            extra={
                "fields": {
                    "backends": len(snap.backends),
                    "models": len(snap.models),
                    "registry_store": fleet.store.kind,
                    "admin_api": "on" if admin_auth.configured else "read-only",
                    "client_keys": client_keys.enabled,
                    "tracing": tracing.enabled,
                }
            },
        )
        await monitor.start()
        await engine.start()
        await kv_events.start()
        await discovery.start()
        try:
            yield
        finally:
            lifecycle.draining = True
            await lifecycle.wait_idle(settings.drain_grace)
            for task in chores:
                task.cancel()
            for task in chores:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            closers: list[_Closes | None] = [discovery, fleet.store, monitor, engine, kv_events]
            closers.append(pools)
            closers += [store, quotas, affinity.shared, tracing, proxy.usage, admission]
            for part in closers:
                if part is None:
                    continue
                # One part failing to close (Redis gone) must not leave the others open.
                try:
                    await part.aclose()
                except Exception:
                    log.exception("shutdown: closing %s failed", type(part).__name__)
            # A worker may end by uvicorn's re-raised SIGTERM, which skips atexit: write the
            # queued log lines now (bounded wait).
            stop_logging()

    app = FastAPI(
        title="sluicegate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.include_router(openai_routes(proxy, registry, client_keys))
    app.include_router(
        admin_routes(
            fleet,
            store,
            health,
            admin_auth,
            settings.drain_grace,
            lambda: engine.readings,
            settings.admin,
            kv_events.status,
        )
    )

    app.include_router(usage_routes(proxy.usage, admin_auth))

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        store.check_fallback()
        if affinity.shared is not None:
            metrics.affinity_shared_entries.set(affinity.shared.entries)
        metrics.engine_readings(engine.readings, time.time())
        metrics.kv_state(kv_events.blocks(), kv_events.lags())
        discovery.refresh_metrics()
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        # Stale discovery keeps serving its last known set: a detail, not a reason to be unready.
        details: dict[str, object] = {"discovery": discovery.status()} if discovery.sources else {}
        quota_status = quotas.status()
        if quota_status is not None:
            # Redis down: still ready (each process enforces its share), and says so.
            details["quotas"] = quota_status
        if lifecycle.draining:
            return JSONResponse({"status": "draining", **details}, status_code=503)
        if not registry.snapshot.backends:
            return JSONResponse({"status": "no backends", **details}, status_code=503)
        return JSONResponse({"status": "ready", **details})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(
            exc.status_code,
            str(exc.detail),
            type_for_status(exc.status_code),
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

    # Proxied POSTs skip FastAPI's layers; everything else (and the lifespan) goes through it.
    return FastPath(app, proxy_endpoints(proxy, client_keys), lifecycle)
