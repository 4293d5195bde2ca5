"""Which store each concern of a process gets, its own or one shared through Redis: one table.

`STORES` has a row per concern: (the process's own, the one shared through Redis), each a
factory of the `Wiring` (settings, metrics, runner, the Redis config and the app's client).
`build(row, wiring)` is the one place that chooses: shared when Redis is configured, else local.
A part never decides for itself; the next concern is a row. Every shared store but the
registry's is a `SharedStore` (router/state/store.py) and degrades and recovers by its rule.

The shared factories import their modules when called: a process without Redis never loads the
shared stores' code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from balancers.inflight.base import InflightStore
from balancers.inflight.local import LocalInflight
from router.core.redis_config import RedisConfig, RedisTarget
from router.core.runner import Runner
from router.core.settings import Settings
from router.ops.metrics import Metrics
from router.registry.fleet import LocalRecords, RecordStore
from router.request.admit.quota import QuotaBook, Quotas
from router.request.placement.response_ids import ResponseIds, ResponseIdStore
from router.request.usage.book import UsageBook, UsageStore
from router.scaling.demand import DemandBook, LocalDemand

if TYPE_CHECKING:
    from router.core.redis_client import Client
    from router.request.placement.affinity_store import SharedPrefixIndex

T = TypeVar("T")


@dataclass(frozen=True)
class Wiring:
    """What a store is built from."""

    settings: Settings
    metrics: Metrics
    runner: Runner
    redis: RedisConfig | None = None  # None: no Redis configured
    client: Client | None = None  # the app's, shared; None: a shared store opens its own

    @property
    def link(self) -> Client | RedisTarget:
        """What a shared store reaches Redis through."""
        assert self.redis is not None
        return self.client if self.client is not None else self.redis.target


@dataclass(frozen=True)
class Row(Generic[T]):
    local: Callable[[Wiring], T]
    shared: Callable[[Wiring], T]


def build(row: Row[T], wiring: Wiring) -> T:
    """The one choice: the shared store when Redis is configured, else the process's own."""
    return (row.local if wiring.redis is None else row.shared)(wiring)


# --- the shared factories ------------------------------------------------------------------


def _inflight(w: Wiring) -> InflightStore:
    from balancers.inflight.redis import RedisInflight

    assert w.redis is not None
    return RedisInflight(
        w.link,
        timeout=w.redis.timeout,
        lease_ttl=w.redis.lease_ttl,
        prefix=w.redis.prefix,
        runner=w.runner,
    )


def _quotas(w: Wiring) -> QuotaBook:
    from router.request.admit.quota_shared import SharedQuotas

    assert w.redis is not None
    return SharedQuotas(
        w.link,
        timeout=w.redis.timeout,
        slot_ttl=w.redis.lease_ttl,
        prefix=w.redis.prefix,
        on_refused=w.metrics.ratelimited,
        on_degraded=w.metrics.quota_degraded,
        runner=w.runner,
    )


def _prefix_index(w: Wiring) -> SharedPrefixIndex | None:
    from router.request.placement.affinity_store import SharedPrefixIndex

    s = w.settings
    return SharedPrefixIndex(
        w.link, timeout=s.redis_timeout, ttl=s.affinity.ttl, prefix=s.redis_prefix, runner=w.runner
    )


def _registry(w: Wiring) -> RecordStore:
    from router.registry.sync import RedisRecords

    s = w.settings
    return RedisRecords(w.link, prefix=f"{s.redis_prefix}:registry", resync=s.registry_resync)


def _usage(w: Wiring) -> UsageStore:
    from router.request.usage.book_shared import SharedUsageBook

    s = w.settings
    return SharedUsageBook(
        w.link,
        prefix=s.redis_prefix,
        on_dropped=w.metrics.usage_dropped.inc,
        flush_every=s.usage_flush,
        runner=w.runner,
    )


def _response_ids(w: Wiring) -> ResponseIdStore:
    from router.request.placement.response_ids_shared import SharedResponseIds

    s, cfg = w.settings, w.settings.response_ids
    return SharedResponseIds(
        w.link,
        ttl=cfg.ttl,
        max_local=cfg.max_local,
        max_per_key=cfg.max_per_key,
        prefix=s.redis_prefix,
        timeout=s.redis_timeout * 4,  # a follow-up that finds nothing is refused: more patience
        runner=w.runner,
    )


def _demand(w: Wiring) -> DemandBook:
    from router.scaling.demand_shared import SharedDemand

    assert w.redis is not None
    return SharedDemand(
        w.link,
        lease_ttl=w.redis.lease_ttl,
        timeout=w.redis.timeout * 4,  # off the request path: a little patience
        prefix=w.redis.prefix,
        runner=w.runner,
    )


@dataclass(frozen=True)
class Table:
    inflight: Row[InflightStore]  # in-flight counts per backend
    quotas: Row[QuotaBook]  # per-key rpm, tpm, parallel
    prefix_index: Row[SharedPrefixIndex | None]  # the process's own index is the affinity's
    registry: Row[RecordStore]  # admin changes
    usage: Row[UsageStore]  # hourly usage per key and model
    response_ids: Row[ResponseIdStore]  # which backend holds a stored response
    demand: Row[DemandBook]  # declared models' demand (scale_from_zero), for KEDA


STORES = Table(
    inflight=Row(lambda w: LocalInflight(), _inflight),
    quotas=Row(lambda w: Quotas(on_refused=w.metrics.ratelimited), _quotas),
    prefix_index=Row(lambda w: None, _prefix_index),
    registry=Row(lambda w: LocalRecords(), _registry),
    usage=Row(lambda w: UsageBook(on_dropped=w.metrics.usage_dropped.inc), _usage),
    response_ids=Row(
        lambda w: ResponseIds(
            w.settings.response_ids.ttl,
            w.settings.response_ids.max_local,
            max_per_key=w.settings.response_ids.max_per_key,
        ),
        _response_ids,
    ),
    demand=Row(lambda w: LocalDemand(), _demand),
)
