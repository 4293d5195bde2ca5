"""create_app(settings) -> ASGI app: builds every object once, owns their lifetimes; no globals."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from balancers.inflight.local import LocalInflight
from health.monitor import HealthMonitor
from health.state import HealthBook
from router.core.backend import Backend
from router.core.clock import SYSTEM, Clock
from router.core.endpoints import ANTHROPIC_PATHS, Endpoint
from router.core.errors import (
    Refused,
    RegistryError,
    StoreUnavailable,
    answer,
    error_response,
)
from router.core.netpolicy import NetPolicy
from router.core.redis_config import RedisConfig
from router.core.runner import Runner
from router.core.settings import BatchConfig, Settings
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
from router.registry.fleet import Change, Fleet, Registry, Snapshot
from router.request.admit.admission import Admission
from router.request.admit.holding import Holding
from router.request.admit.hops import HopMarker
from router.request.lifecycle.drain import Lifecycle
from router.request.lifecycle.proxy import Proxy
from router.request.migration.policy import Migration
from router.request.placement.affinity import Affinity
from router.scaling.demand import DemandBook
from router.stores import STORES, Wiring, build
from router.upstream.pools import Pools, Sender
from router.web.admin import BackendRows, admin_routes
from router.web.api import FastPath, Handler, openai_routes, proxy_endpoints
from router.web.auth import AdminAuth, ClientKeys
from router.web.console import console_routes
from router.web.live_state import LiveState
from router.web.usage_admin import usage_routes

if TYPE_CHECKING:
    from router.batch.runner import BatchRunner
    from router.scaling.scaler import Scaler

log = logging.getLogger("sluicegate.app")


class _Follows(Protocol):
    """A part that follows the backend set: told it whole, or a change of it."""

    def sync(self, backends: Sequence[Backend]) -> None: ...

    def update(self, upserted: Sequence[Backend], removed: Sequence[str]) -> None: ...


Step = Callable[[], Awaitable[None]]


def create_app(
    settings: Settings,
    *,
    transport: Callable[[Backend], Sender] | None = None,
    clock: Clock = SYSTEM,
    tune_gc: bool = True,
    proxy_routes: bool = True,
) -> App:
    """The router: its parts built once (`AppParts`), started and closed by the lifespan in that
    order and its reverse (`_lifespan`), reached through the routes (`_routes`) and as the
    returned app's `parts`. The seams: `transport` sends every request to a backend in place
    of the pools' own connections (backend -> its sender); `clock` (router/core/clock.py) is the
    time every chore of the runner waits on, and the time of health (ejections, probes),
    admission (deadlines, re-checks) and KV events (retries, flights); `tune_gc` False leaves
    the process's garbage collector as it is (`sluicegate serve` freezes the startup heap);
    `proxy_routes` False serves no /v1 route and runs no batch job (the endpoint picker's HTTP
    port: its requests come through the gateway, router/picker/)."""
    parts = AppParts(
        settings, transport=transport, clock=clock, tune_gc=tune_gc, batch=proxy_routes
    )
    app = FastAPI(
        title="sluicegate",
        lifespan=_lifespan(parts),
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    _routes(app, parts, proxy_routes)
    # Proxied POSTs skip FastAPI's layers; everything else (and the lifespan) goes through it.
    endpoints = proxy_endpoints(parts.proxy, parts.client_keys) if proxy_routes else {}
    return App(app, endpoints, parts.lifecycle, parts)


class App(FastPath):
    """The ASGI app `create_app` returns, with every part of the process reachable."""

    def __init__(
        self,
        app: FastAPI,
        endpoints: dict[Endpoint, Handler],
        lifecycle: Lifecycle,
        parts: AppParts,
    ) -> None:
        super().__init__(app, endpoints, lifecycle)
        self.parts = parts


class AppParts:
    """Every object of one router process, built once, each from those built before it."""

    def __init__(
        self,
        settings: Settings,
        *,
        transport: Callable[[Backend], Sender] | None = None,
        clock: Clock = SYSTEM,
        tune_gc: bool = True,
        batch: bool = True,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self._tune_gc = tune_gc
        # Backends added at run time (admin API, discovery) reach only the networks allowed.
        policy = NetPolicy.from_config(settings.admin)
        self.pools = pools = Pools(settings.timeouts, settings.limits, policy, transport)
        self.metrics = metrics = Metrics()
        count_drops(metrics.log_dropped.inc)
        # One Redis client (one connection pool) for every part that shares state through Redis.
        redis = RedisConfig.from_settings(settings)
        self.redis_client = redis_client = redis.client() if redis is not None else None
        # Every background chore of this process runs on it (and is counted per chore).
        now = clock.now
        self.runner = runner = Runner(sleep=clock.sleep, clock=now, on_run=metrics.background_run)
        # Each store this process's own, or shared through Redis: chosen from one table.
        wiring = Wiring(settings, metrics, runner, redis, redis_client)
        self.health = HealthBook(
            settings.health, settings.outlier, clock=now, on_change=self._health_changed
        )
        self.monitor = HealthMonitor(self.health, policy=policy, runner=runner, clock=now)
        self.engine = engine = EngineScraper(
            settings.engine_metrics,
            on_error=metrics.engine_scrape_failed,
            policy=policy,
            lora_refresh=settings.lora.refresh,
            runner=runner,
        )
        self.kv_events = KvEvents(
            capacity=self._kv_capacity,
            on_events=metrics.kv_events,
            pending_ttl=settings.affinity.pending_ttl,
            policy=policy,
            local_sockets=settings.admin.kv_events_bind_and_ipc,
            monotonic=now,
            runner=runner,
        )
        # What follows the backend set (`_changed`); new or changed backends are probed at once.
        self._followers: tuple[_Follows, ...] = (
            self.health,
            self.monitor,
            self.engine,
            self.kv_events,
        )
        backends = [Backend.from_config(b) for b in settings.backends]
        # The registry's constructor swaps in its first snapshot before the proxy (and its
        # migration) exists: streams to move are told of only once there is one.
        self._migration: Migration | None = None
        self._holding: Holding | None = None  # the proxy's, once it exists
        self.registry = registry = Registry(
            backends,
            settings.balancer,
            settings.model_balancers,
            on_change=self._changed,
        )
        self.lora = LoraLoads(settings.lora, pool_sender(pools), metrics.lora_load)
        self.lora.on_loaded = engine.refresh_adapters
        engine.on_adapters = self._adapters_changed
        self._adapters_changed()  # lora.sources route from the start
        self.fleet = Fleet(
            registry,
            settings.backends,
            build(STORES.registry, wiring),
            on_invalid=lambda _name: metrics.invalid_records.inc(),
        )
        self.admin_auth = AdminAuth(settings.admin_token)
        self.client_keys = ClientKeys(settings.api_keys, settings.api_keys_file)
        metrics.backends_known([b.name for b in backends])
        self.store = store = MeteredInflight(build(STORES.inflight, wiring), metrics)
        if isinstance(store.inner, LocalInflight):
            # A reading pairs with our count when its scrape was sent only where that count is
            # the one balancers see (a shared store's is every replica's, read at the pick).
            engine.inflight = store.inner.count
        self.lifecycle = Lifecycle()
        self.tracing = make_tracing(settings.tracing, metrics.tracing_header_dropped)
        self.admission = (
            Admission(settings.admission, metrics, clock=now, runner=runner)
            if settings.admission
            else None
        )
        if self.admission is not None:
            engine.on_change = self.admission.changed
        self.affinity = Affinity(
            settings.affinity,
            shared=build(STORES.prefix_index, wiring),
            on_fallback=metrics.affinity_fallbacks.inc,
            kv=self.kv_events,
            pools=pools,
        )
        self.affinity.default_tokenizers(  # models routed cache_aware on KV events
            sorted(
                m
                for m in {m for b in settings.backends if b.kv_events for m in b.models}
                if settings.model_balancers.get(m, settings.balancer) == "cache_aware"
            )
        )
        self.quotas = build(STORES.quotas, wiring)
        self.proxy = Proxy(
            settings,
            registry,
            pools,
            store,
            self.health,
            self.lifecycle,
            metrics,
            self.tracing,
            readings=lambda: engine.readings,
            admission=self.admission,
            quotas=self.quotas,
            affinity=self.affinity,
            usage=build(STORES.usage, wiring),
            response_ids=build(STORES.response_ids, wiring),
            hops=HopMarker(settings.deployment_id),
            lora=self.lora if settings.lora.load_on_demand else None,
            clock=clock,
        )
        self._migration = self.proxy.migration
        self._holding = self.proxy.holding
        # Declared models' demand (this process's, or every replica's through Redis) and the
        # KEDA scaler reading it: only with `scale_from_zero`.
        self.demand: DemandBook | None = None
        self.scaler: Scaler | None = None
        sfz = settings.scale_from_zero
        if sfz is not None:
            self.demand = build(STORES.demand, wiring)
            self.demand.follow(self.proxy.holding)
            if sfz.scaler_port:
                # gRPC is loaded only by a process that serves KEDA (~0.1 s of its start).
                from router.scaling.scaler import Scaler

                self.scaler = Scaler(self.demand, sfz, settings.host)
        self.discovery = Discovery(
            settings.discovery,
            self.fleet,
            self._counts,
            metrics,
            settings.drain_grace,
            policy=policy,
            runner=runner,
        )
        self.batch: BatchParts | None = None
        if settings.batch is not None and batch:
            self.batch = _batch_parts(settings.batch, self)
        elif settings.batch is not None:
            # The endpoint picker sends nothing itself (the gateway does): jobs run on the
            # proxy replicas that share its Redis and storage (docs/batch.md).
            log.warning("batch: not run by the endpoint picker; proxy replicas run its jobs")
        self.rows = BackendRows(
            self.fleet,
            store,
            self.health,
            lambda: engine.readings,
            self.kv_events.status,
            self.proxy.latency.view,
        )

    # --- what one part tells the others -----------------------------------------------------

    def _health_changed(self, backend: str, healthy: bool, reason: str) -> None:
        self.metrics.health_changed(backend, healthy, reason)
        if not healthy:  # an engine that stopped answering may come back empty
            self.kv_events.reset(backend)
        elif self._holding is not None:  # a held request's model may be ready now
            self._holding.changed()

    def _kv_capacity(self, name: str) -> int | None:
        """The engine's KV capacity in blocks, as its metrics say."""
        r = self.engine.readings.get(name)
        if r is None or not r.kv_capacity_tokens or not r.block_size:
            return None
        return r.kv_capacity_tokens // r.block_size

    def _changed(self, snapshot: Snapshot, change: Change | None) -> None:
        """A new backend set: each part that follows it takes the whole set on a swap (`change`
        None), or only what changed on a patch (a discovery change: one slice of a 50,000
        endpoint fleet moved)."""
        if change is None:
            _learn_secrets(snapshot.backends)
            for part in self._followers:
                part.sync(snapshot.backends)
        else:
            _learn_secrets(change.upserted)
            for part in self._followers:
                part.update(change.upserted, change.removed)
        if self._holding is not None:  # requests held for a model that has a backend now go
            self._holding.changed()
        # Streams on a backend gone from the registry (its drain grace over) migrate, when on.
        if self._migration is None:
            return
        if change is None:
            self._migration.backends_changed(frozenset(snapshot.by_name))
        elif change.removed:
            self._migration.backends_removed(change.removed)

    def _adapters_changed(self) -> None:
        routes = adapter_routes(
            self.registry.snapshot.backends, self.engine.readings, self.settings.lora
        )
        self.registry.set_adapters(routes)

    async def _counts(self, names: Sequence[str]) -> dict[str, int]:
        return await self.store.counts(list(names))

    # --- chores ------------------------------------------------------------------------------

    async def close_removed_pools(self) -> None:
        # A removed backend's pool stays open while its streams run, then closes.
        pools, snapshot = self.pools, self.registry.snapshot
        gone = pools.names() - set(snapshot.by_name)
        if gone:
            counts = await self.store.counts(sorted(gone))
            for name in gone:
                if not counts.get(name) and name not in self.registry.snapshot.by_name:
                    await pools.discard(name)

    async def reload_keys(self) -> None:
        self.client_keys.reload_if_changed()

    async def lora_sweep(self) -> None:
        self.lora.sweep(self.registry.snapshot.by_name, self.engine.readings)

    # --- start and stop ----------------------------------------------------------------------

    def _order(self) -> list[tuple[str, Step | None, Step | None]]:
        """Every part with something to start or close: (name, start, close), in start order.
        `stop` closes them in the reverse order: the runner first (no chore runs on a closed
        part), the Redis client last (every part before it shares it)."""
        admission, shared = self.admission, self.affinity.shared
        demand, scaler = self.demand, self.scaler
        ids, usage = self.proxy.response_ids, self.proxy.usage
        return [
            ("redis", None, self.redis_client.aclose if self.redis_client else None),
            ("response_ids", ids.start, ids.aclose),
            ("admission", None, admission.aclose if admission else None),
            ("usage", usage.start, usage.aclose),
            ("tracing", None, self.tracing.aclose),
            ("prefix_index", shared.start if shared else None, shared.aclose if shared else None),
            ("quotas", self.quotas.start, self.quotas.aclose),
            ("inflight", self.store.start, self.store.aclose),
            ("batch", None, self.batch.runner.aclose if self.batch else None),
            ("pools", None, self.pools.aclose),
            ("lora", None, self.lora.aclose),
            ("kv_events", self.kv_events.start, self.kv_events.aclose),
            ("engine", self.engine.start, self.engine.aclose),
            ("health", self.monitor.start, self.monitor.aclose),
            ("registry", None, self.fleet.store.aclose),
            ("discovery", self.discovery.start, self.discovery.aclose),
            ("demand", demand.start if demand else None, demand.aclose if demand else None),
            ("scaler", scaler.start if scaler else None, scaler.aclose if scaler else None),
            ("runner", self._start_chores, self.runner.stop),
        ]

    async def start(self) -> None:
        fleet = self.fleet
        # Before the pools, stores and discovery start: what is frozen here lives as long as
        # the process (a pool frozen with its backend could not be collected once closed).
        if self._tune_gc:
            tune_collector()
        try:
            fleet.apply(await fleet.store.load())
        except (RegistryError, StoreUnavailable):
            # Serve the file's entries meanwhile; the watch below keeps trying and catches up.
            log.warning("shared registry unavailable at start; serving the file's backends")
        for b in self.registry.snapshot.backends:
            self.pools.transport(b)
        pin_mmap_threshold()  # big bodies mapped and unmapped: a flood's memory leaves
        for _, start, _ in self._order():
            if start is not None:
                await start()
        self._log_started()

    async def _start_chores(self) -> None:
        settings, fleet, runner = self.settings, self.fleet, self.runner
        if fleet.store.kind != "local":
            runner.forever(
                "registry_sync",
                lambda: fleet.store.watch(fleet.apply),
                backoff_max=settings.registry_resync,
            )
        runner.every("close_removed_pools", self.close_removed_pools, 1.0)
        runner.every("memory_trim", Trimmer().step, 5.0)
        if settings.lora.load_on_demand:
            runner.every("lora_sweep", self.lora_sweep, 1.0)
        if settings.api_keys_file:
            runner.every("client_keys_reload", self.reload_keys, settings.api_keys_reload)
        if "latency" in {settings.balancer, *settings.model_balancers.values()}:
            runner.every("latency_refit", self.latency_refit, settings.latency.refit_interval)
        runner.start()

    async def latency_refit(self) -> None:
        """`balancer: latency`'s models, refitted on the samples of the backends still here."""
        feed = self.proxy.latency
        feed.forget(self.registry.snapshot.by_name)
        await feed.refit()

    def _log_started(self) -> None:
        if (
            self.settings.workers > 1
            and self.fleet.store.kind == "local"
            and self.admin_auth.configured
        ):
            log.warning(
                "admin changes reach only the worker that takes them: set SLUICEGATE_REDIS_URL"
            )
        snap = self.registry.snapshot
        log.info(
            "started",
            extra={
                "fields": {
                    "backends": len(snap.backends),
                    "models": len(snap.models),
                    "registry_store": self.fleet.store.kind,
                    "admin_api": "on" if self.admin_auth.configured else "read-only",
                    "client_keys": self.client_keys.enabled,
                    "tracing": self.tracing.enabled,
                }
            },
        )

    async def stop(self) -> None:
        self.lifecycle.draining = True
        await self.lifecycle.wait_idle(self.settings.drain_grace)
        for name, _, close in reversed(self._order()):
            if close is None:
                continue
            # One part failing to close (Redis gone) must not leave the others open.
            try:
                await close()
            except Exception:
                log.exception("shutdown: closing %s failed", name)
        # A worker may end by uvicorn's re-raised SIGTERM, which skips atexit: write the queued
        # log lines now (bounded wait).
        stop_logging()


class BatchParts:
    """The Batch API's parts (docs/batch.md), built only with `batch:` configured."""

    def __init__(self, runner: BatchRunner, routes: APIRouter) -> None:
        self.runner = runner
        self.routes = routes


def _batch_parts(cfg: BatchConfig, p: AppParts) -> BatchParts:
    # Imported here: a router without `batch:` never loads the Batch API's code.
    from router.batch.files import Storage
    from router.batch.runner import BatchRunner
    from router.batch.store import BatchStore
    from router.web.batch_api import batch_routes

    assert p.redis_client is not None  # settings refuse `batch` without Redis
    store = BatchStore(p.redis_client, p.settings.redis_prefix)
    storage = Storage(cfg.storage_dir)
    keys = p.client_keys
    runner = BatchRunner(
        cfg, store, storage, p.proxy, keys.by_owner if keys.enabled else None, p.runner
    )
    routes = batch_routes(
        cfg, store, storage, p.registry, keys, p.quotas, p.settings.max_body_bytes
    )
    return BatchParts(runner, routes)


def _learn_secrets(backends: Sequence[Backend]) -> None:
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


def _lifespan(parts: AppParts) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await parts.start()
        try:
            yield
        finally:
            await parts.stop()

    return lifespan


def _routes(app: FastAPI, p: AppParts, proxy_routes: bool = True) -> None:
    """The HTTP face: the API, admin, usage and console routes, health, metrics, errors."""
    settings = p.settings
    if proxy_routes:
        app.include_router(openai_routes(p.proxy, p.registry, p.client_keys))
    app.include_router(
        admin_routes(
            p.rows,
            p.admin_auth,
            settings.drain_grace,
            settings.admin,
            fallbacks=p.proxy.fallbacks.table(),
        )
    )
    app.include_router(usage_routes(p.proxy.usage, p.admin_auth))
    if proxy_routes and p.batch is not None:  # its lines run through the proxy's lifecycle
        app.include_router(p.batch.routes)
    if settings.console.enabled:
        live = LiveState(
            p.rows,
            p.metrics.live,
            p.admission,
            p.quotas,
            p.client_keys,
            p.admin_auth.configured,
            settings.console.refresh,
            fallbacks=p.proxy.fallbacks.table(),
            batch=p.batch.runner.view if p.batch is not None else None,
        )
        app.include_router(console_routes(settings.console, p.admin_auth, live))

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        metrics = p.metrics
        p.store.check_fallback()
        if p.affinity.shared is not None:
            metrics.affinity_shared_entries.set(p.affinity.shared.entries)
        metrics.engine_readings(p.engine.readings, time.time())
        tokens = p.proxy.latency.tokens
        metrics.token_load(tokens.prefill, tokens.decode)
        metrics.body_bytes_held.set(p.proxy.bodies.held)
        p.kv_events.flush()
        metrics.kv_state(p.kv_events.blocks(), p.kv_events.lags())
        p.discovery.refresh_metrics()
        if p.demand is not None:
            metrics.scale_from_zero(p.demand.held(), p.demand.totals())
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        # Stale discovery keeps serving its last known set: a detail, not a reason to be unready.
        details: dict[str, object] = (
            {"discovery": p.discovery.status()} if p.discovery.sources else {}
        )
        quota_status = p.quotas.status()
        if quota_status is not None:
            # Redis down: still ready (each process enforces its share), and says so.
            details["quotas"] = quota_status
        if p.lifecycle.draining:
            return JSONResponse({"status": "draining", **details}, status_code=503)
        # Declared models (scale_from_zero) are served with no backend yet: their requests wait
        # here while their pools wake, so the router must stay in its Service meanwhile.
        if not p.registry.snapshot.backends and not p.proxy.holding.models:
            return JSONResponse({"status": "no backends", **details}, status_code=503)
        return JSONResponse({"status": "ready", **details})

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        given = (exc.headers or {}).items()
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in given]
        refused = Refused(str(exc.detail), status=exc.status_code, headers=headers)
        # A method the Messages API's paths do not take (405) is still their client's error.
        return answer(refused, request.scope["path"] in ANTHROPIC_PATHS)

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
