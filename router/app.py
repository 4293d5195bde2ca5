"""create_app(settings) -> ASGI app: builds every object once, owns their lifetimes; no globals."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
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
from router.core.redis_client import Client, RedisConfig
from router.core.runner import Runner
from router.core.settings import Settings
from router.discovery.runner import Discovery
from router.engine.adapters import routes as adapter_routes
from router.engine.kv_events import KvEvents
from router.engine.lora_loads import LoraLoads, pool_sender
from router.engine.scraper import EngineScraper
from router.ops.collector import tune_collector
from router.ops.logs import count_drops, register_secret, secret_header
from router.ops.logs import stop as stop_logging
from router.ops.memory import Trimmer, pin_mmap_threshold
from router.ops.metrics import CONTENT_TYPE, MeteredInflight, Metrics
from router.ops.tracing import make_tracing
from router.registry.admin import BackendRows, admin_routes
from router.registry.fleet import (
    Change,
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
from router.request.response_ids import ResponseIds
from router.request.usage_book import UsageBook
from router.upstream.pools import Pools
from router.web.api import FastPath, openai_routes, proxy_endpoints
from router.web.auth import AdminAuth, ClientKeys
from router.web.console import console_routes
from router.web.live_state import LiveState
from router.web.usage_admin import usage_routes

log = logging.getLogger("sluicegate.app")


class _Closes(Protocol):
    async def aclose(self) -> None: ...


def make_store(redis: RedisConfig | None, client: Client | None, runner: Runner) -> InflightStore:
    """Local counts unless Redis is configured; then one count shared by every replica."""
    if redis is None or client is None:
        return LocalInflight()
    from balancers.inflight.redis import RedisInflight

    return RedisInflight(
        client,
        timeout=redis.timeout,
        lease_ttl=redis.lease_ttl,
        prefix=redis.prefix,
        runner=runner,
    )


def make_quotas(
    redis: RedisConfig | None, client: Client | None, metrics: Metrics, runner: Runner
) -> QuotaBook:
    """Per-key quotas in this process, or shared by every replica when Redis is configured."""
    if redis is None or client is None:
        return Quotas(on_refused=metrics.ratelimited)
    from router.request.quota_shared import SharedQuotas

    return SharedQuotas(
        client,
        timeout=redis.timeout,
        slot_ttl=redis.lease_ttl,
        prefix=redis.prefix,
        on_refused=metrics.ratelimited,
        on_degraded=metrics.quota_degraded,
        runner=runner,
    )


def make_affinity(
    settings: Settings,
    client: Client | None,
    metrics: Metrics,
    runner: Runner,
    kv: KvEvents | None = None,
    pools: Pools | None = None,
) -> Affinity:
    """The prefix index: this process's own, plus the one shared in Redis when configured."""
    shared = None
    if client is not None:
        from router.request.affinity_store import SharedPrefixIndex

        shared = SharedPrefixIndex(
            client,
            timeout=settings.redis_timeout,
            ttl=settings.affinity.ttl,
            prefix=settings.redis_prefix,
            runner=runner,
        )
    return Affinity(
        settings.affinity,
        shared=shared,
        on_fallback=metrics.affinity_fallbacks.inc,
        kv=kv,
        pools=pools,
    )


def _record_store(settings: Settings, client: Client | None = None) -> RecordStore:
    """The registry's records: shared through `client` (the app's), or through a client of the
    store's own when none is given (tools, tests)."""
    redis = RedisConfig.from_settings(settings)
    if redis is None:
        return LocalRecords()
    from router.registry.sync import RedisRecords

    return RedisRecords(
        client or redis.target,
        prefix=f"{settings.redis_prefix}:registry",
        resync=settings.registry_resync,
    )


def _usage_book(settings: Settings, client: Client | None, metrics: Metrics) -> UsageBook:
    """Hourly usage in this process, or written to Redis in batches when it is configured."""
    return UsageBook(
        client, settings.redis_prefix, on_dropped=metrics.usage_dropped.inc, owns_client=False
    )


def _response_ids(settings: Settings, client: Client | None) -> ResponseIds:
    """Response id -> backend: shared through Redis when it is configured, else this process's."""
    cfg = settings.response_ids
    return ResponseIds(
        cfg.ttl,
        cfg.max_local,
        client,
        settings.redis_prefix,
        timeout=settings.redis_timeout * 4,
        owns_client=False,
    )


def create_app(settings: Settings) -> FastPath:
    backends = [Backend.from_config(b) for b in settings.backends]
    # Backends added at run time (admin API, discovery) reach only the networks allowed.
    policy = NetPolicy.from_config(settings.admin)
    pools = Pools(settings.timeouts, settings.limits, policy)
    metrics = Metrics()
    # One Redis client (one connection pool) for every part that shares state through Redis.
    redis = RedisConfig.from_settings(settings)
    redis_client = redis.client() if redis is not None else None
    # Every background chore of this process runs on it (and is counted per chore).
    runner = Runner(on_run=metrics.background_run)
    count_drops(metrics.log_dropped.inc)
    kv_reset: list[Callable[[str], None]] = []
    # Streams on a backend gone from the registry (its drain grace over) migrate, when on: after
    # a whole swap (admin, config) and after a discovery patch (only the names it removed).
    backends_now: list[Callable[[frozenset[str]], None]] = []
    backends_gone: list[Callable[[tuple[str, ...]], None]] = []

    def health_changed(backend: str, healthy: bool, reason: str) -> None:
        metrics.health_changed(backend, healthy, reason)
        if not healthy:
            for reset in kv_reset:  # an engine that stopped answering may come back empty
                reset(backend)

    health = HealthBook(settings.health, settings.outlier, on_change=health_changed)
    monitor = HealthMonitor(health, policy=policy, runner=runner)
    engine = EngineScraper(
        settings.engine_metrics,
        on_error=metrics.engine_scrape_failed,
        policy=policy,
        lora_refresh=settings.lora.refresh,
        runner=runner,
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
        policy=policy,
    )
    kv_reset.append(kv_events.reset)

    def learn_secrets(backends: Sequence[Backend]) -> None:
        # Keys of backends added through the admin API are secrets from now on, in logs too.
        register_secret(
            *(
                v.decode("latin-1").split(" ")[-1]
                for b in backends
                for k, v in b.auth_headers
                if (name := k.decode("latin-1")) == b.key_header
                or secret_header(name, v.decode("latin-1"))
            )
        )

    def on_swap(snapshot: Snapshot) -> None:
        learn_secrets(snapshot.backends)
        health.sync(snapshot.backends)
        monitor.sync(snapshot.backends)  # new or changed backends are probed at once
        engine.sync(snapshot.backends)
        kv_events.sync(snapshot.backends)
        for moved in backends_now:
            moved(frozenset(snapshot.by_name))

    def on_patch(snapshot: Snapshot, change: Change) -> None:
        # A discovery change: only what changed (a 50,000 endpoint fleet, one slice moved).
        learn_secrets(change.upserted)
        health.update(change.upserted, change.removed)
        monitor.update(change.upserted, change.removed)
        engine.update(change.upserted, change.removed)
        kv_events.update(change.upserted, change.removed)
        if change.removed:
            for gone in backends_gone:
                gone(change.removed)

    registry = Registry(
        backends, settings.balancer, settings.model_balancers, on_swap=on_swap, on_patch=on_patch
    )
    lora = LoraLoads(settings.lora, pool_sender(pools), metrics.lora_load)
    lora.on_loaded = engine.refresh_adapters

    def adapters_changed() -> None:
        registry.set_adapters(
            adapter_routes(registry.snapshot.backends, engine.readings, settings.lora)
        )

    engine.on_adapters = adapters_changed
    adapters_changed()  # lora.sources route from the start
    fleet = Fleet(
        registry,
        settings.backends,
        _record_store(settings, redis_client),
        on_invalid=lambda _name: metrics.invalid_records.inc(),
    )
    admin_auth = AdminAuth(settings.admin_token)
    client_keys = ClientKeys(settings.api_keys, settings.api_keys_file)
    metrics.backends_known([b.name for b in backends])
    store = MeteredInflight(make_store(redis, redis_client, runner), metrics)
    if isinstance(store.inner, LocalInflight):
        # A reading pairs with our count when its scrape was sent only where that count is the
        # one balancers see (a shared store's is every replica's, read at the pick).
        engine.inflight = store.inner.count
    lifecycle = Lifecycle()
    tracing = make_tracing(settings.tracing, metrics.tracing_header_dropped)
    admission = Admission(settings.admission, metrics) if settings.admission else None
    affinity = make_affinity(settings, redis_client, metrics, runner, kv_events, pools)
    if admission is not None:
        engine.on_change = admission.changed
    quotas = make_quotas(redis, redis_client, metrics, runner)
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
        usage=_usage_book(settings, redis_client, metrics),
        response_ids=_response_ids(settings, redis_client),
        hops=HopMarker(settings.deployment_id),
        lora=lora if settings.lora.load_on_demand else None,
    )

    backends_now.append(proxy.migration.backends_changed)
    backends_gone.append(proxy.migration.backends_removed)

    async def counts(names: Sequence[str]) -> dict[str, int]:
        return await store.counts(list(names))

    discovery = Discovery(
        settings.discovery,
        fleet,
        counts,
        metrics,
        settings.drain_grace,
        policy=policy,
        runner=runner,
    )

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
        # Before the pools, stores and discovery start: what is frozen here lives as long as
        # the process (a pool frozen with its backend could not be collected once closed).
        tune_collector()
        try:
            fleet.apply(await fleet.store.load())
        except (RegistryError, StoreUnavailable):
            # Serve the file's entries meanwhile; the watch below keeps trying and catches up.
            log.warning("shared registry unavailable at start; serving the file's backends")
        for b in registry.snapshot.backends:
            pools.transport(b)
        await store.start()
        await quotas.start()
        if affinity.shared is not None:
            await affinity.shared.start()
        pin_mmap_threshold()  # big bodies mapped and unmapped: a flood's memory leaves
        if fleet.store.kind != "local":
            runner.forever(
                "registry_sync",
                lambda: fleet.store.watch(fleet.apply),
                backoff_max=settings.registry_resync,
            )
        runner.every("close_removed_pools", close_removed_pools, 1.0)
        runner.every("memory_trim", Trimmer().step, 5.0)
        if settings.lora.load_on_demand:

            async def lora_sweep() -> None:
                lora.sweep(registry.snapshot.by_name, engine.readings)

            runner.every("lora_sweep", lora_sweep, 1.0)
        if proxy.usage.shared:
            runner.every("usage_flush", proxy.usage.flush_round, settings.usage_flush)
        if settings.api_keys_file:
            runner.every("client_keys_reload", reload_keys, settings.api_keys_reload)
        runner.start()
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
            await runner.stop()
            closers: list[_Closes | None] = [discovery, fleet.store, monitor, engine, kv_events]
            closers.append(lora)
            closers.append(pools)
            closers += [store, quotas, affinity.shared, tracing, proxy.usage, admission]
            closers.append(proxy.response_ids)
            closers.append(redis_client)  # last: every part above shares it
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
    rows = BackendRows(fleet, store, health, lambda: engine.readings, kv_events.status)
    app.include_router(admin_routes(rows, admin_auth, settings.drain_grace, settings.admin))

    app.include_router(usage_routes(proxy.usage, admin_auth))
    if settings.console.enabled:
        live = LiveState(
            rows,
            metrics.live,
            admission,
            quotas,
            client_keys,
            admin_auth.configured,
            settings.console.refresh,
        )
        app.include_router(console_routes(settings.console, admin_auth, live))

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
