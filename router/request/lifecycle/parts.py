"""What every request's steps use, built once per app: the stores, books and policies.

`Proxy` (router/request/lifecycle/proxy.py) is these parts plus the order of the steps; each step
module (getting_in, attempt, prefill_leg, pump, migrate, account) takes them as its first argument.
"""

from __future__ import annotations

from collections.abc import Callable

from balancers.inflight.base import InflightStore, Readings
from health.state import HealthBook
from router.core.clock import SYSTEM, Clock
from router.core.settings import AdmissionConfig, Settings
from router.engine.lora_loads import LoraLoads
from router.ops.metrics import Metrics
from router.ops.tracing import NO_TRACING, Tracing
from router.registry.fleet import Registry
from router.request.admit.admission import Admission
from router.request.admit.byte_budget import ByteBudget
from router.request.admit.holding import Holding, declared_models
from router.request.admit.hops import HopMarker
from router.request.admit.quota import QuotaBook, Quotas
from router.request.lifecycle.drain import Lifecycle
from router.request.lifecycle.endings import Retry
from router.request.lifecycle.failover import Failover
from router.request.migration.policy import Migration
from router.request.placement.adapter_flights import AdapterFlights
from router.request.placement.affinity import Affinity
from router.request.placement.fallbacks import Fallbacks
from router.request.placement.latency_feed import LatencyFeed
from router.request.placement.pd import Disaggregation
from router.request.placement.response_ids import ResponseIds, ResponseIdStore
from router.request.placement.session_token import SessionTokens
from router.request.usage.book import UsageBook, UsageStore
from router.upstream.pools import Pools


class Parts:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        pools: Pools,
        store: InflightStore,
        health: HealthBook,
        lifecycle: Lifecycle,
        metrics: Metrics | None = None,
        tracing: Tracing = NO_TRACING,
        readings: Callable[[], Readings] | None = None,
        admission: Admission | None = None,
        affinity: Affinity | None = None,
        quotas: QuotaBook | None = None,
        usage: UsageStore | None = None,
        response_ids: ResponseIdStore | None = None,
        hops: HopMarker | None = None,
        lora: LoraLoads | None = None,
        clock: Clock = SYSTEM,
    ) -> None:
        self.metrics = metrics or Metrics()
        # LoRA adapters loaded on demand, and the requests using them (None: never loads).
        self.lora = lora
        self.flights = AdapterFlights()  # adapters in flight per engine, for the balancer
        # Response id -> the backend holding it (Responses API follow-ups).
        self.response_ids: ResponseIdStore = (
            response_ids
            if response_ids is not None
            else ResponseIds(
                settings.response_ids.ttl,
                settings.response_ids.max_local,
                max_per_key=settings.response_ids.max_per_key,
            )
        )
        # This deployment's mark on upstream requests; a request bearing it already is a loop.
        self.hops = hops or HopMarker(settings.deployment_id)
        # Hourly token usage per key and model (/admin/usage); written at each request's end.
        self.usage: UsageStore = usage or UsageBook()
        # Ask streams' backends for usage the client did not ask for (and hide it from them).
        self.inject_usage = settings.usage_accounting == "active"
        # The prefix index and prompt hashing, for balancers that route on cached prefixes.
        self.affinity = affinity or Affinity(settings.affinity)
        # `balancer: latency`: the token load, the samples and models, the session tokens.
        self.latency = LatencyFeed(settings.latency)
        key = settings.affinity.session_token_key
        self.session_tokens = SessionTokens(key.get_secret_value().encode() if key else None)
        self.tracing = tracing
        # The engine scraper's latest readings, for balancers that score engine load.
        self.readings = readings
        self.settings = settings
        # Bodies read and held by requests in this process; any one body always fits.
        self.bodies = ByteBudget(
            max(settings.max_held_body_bytes, settings.max_body_bytes, settings.max_upload_bytes)
        )
        self.registry = registry
        self.pools = pools
        self.store = store
        self.health = health
        self.lifecycle = lifecycle
        self.admission = admission  # None: a full fleet answers 503 at once
        # Per-key rpm / tpm / max_parallel: shared through Redis, or in this process.
        self.quotas = quotas or Quotas(on_refused=self.metrics.ratelimited)
        # The completion estimate of a body without max_tokens, and the longest sequence:
        # admission's, also for quotas.
        estimates = settings.admission or AdmissionConfig()
        self.default_max_tokens = estimates.default_max_tokens
        self.max_model_len = estimates.max_model_len
        self.failover = Failover(settings.retries, lambda: lifecycle.active, Retry)
        self.migration = Migration(settings.migration, self.metrics.migrated)
        # Model fallbacks by model (router/request/placement/fallbacks.py): empty, a dict miss.
        self.fallbacks = Fallbacks(settings)
        self.pd = Disaggregation(
            settings
        )  # prefill/decode pools per model (router/request/placement/pd.py)
        # Declared models (scale_from_zero): held while no backend is ready, their demand.
        self.holding = Holding(
            settings.scale_from_zero,
            declared_models(settings),
            clock,
            self._ready,
            admission.changed if admission is not None else None,
        )

    def _ready(self, model: str) -> bool:
        """Some backend of `model` is in the registry and routable by health now."""
        backends = self.registry.snapshot.by_model.get(model)
        return bool(backends) and bool(self.health.healthy(backends or ()))
