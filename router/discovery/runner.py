"""Builds the configured discovery sources, runs them as tasks the app owns, and reports them
(the `/readyz` details, the `sluicegate_discovery_*` gauges). A source's task never ends on an
error: every failure is caught in the source, logged, counted, and retried."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx

from router.core.settings import ConfigError, DnsDiscovery, KubernetesDiscovery, Settings
from router.discovery.reconcile import DiscoveryMetrics, InFlight, Reconciler
from router.registry.fleet import Fleet

log = logging.getLogger("sluicegate.discovery")

_TICK = 0.25  # seconds between checks for vanished backends whose streams have ended


def check_discovery(settings: Settings) -> None:
    """A `kind: kubernetes` source needs the optional Kubernetes client (`sluicegate[kubernetes]`,
    which the container image has): without it a `ConfigError` at startup, not a traceback in
    every worker."""
    kinds = [cfg.kind for cfg in settings.discovery]
    if "kubernetes" in kinds and importlib.util.find_spec("kubernetes_asyncio") is None:
        i = kinds.index("kubernetes")
        origin = f"config file {settings.config}" if settings.config else "settings"
        raise ConfigError(
            f"{origin}: discovery[{i}]: kind kubernetes needs the Kubernetes client, which is "
            "not installed: pip install 'sluicegate[kubernetes]'"
        )


class Source(Protocol):
    rec: Reconciler

    async def run(self) -> None: ...


class RunnerMetrics(DiscoveryMetrics, Protocol):
    def discovery_state(self, source: str, backends: int, age: float | None) -> None: ...


class Discovery:
    def __init__(
        self,
        configs: Sequence[KubernetesDiscovery | DnsDiscovery],
        fleet: Fleet,
        in_flight: InFlight,
        metrics: RunnerMetrics,
        grace: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._clock = clock
        self._http = httpx.AsyncClient(trust_env=False)
        self._tasks: list[asyncio.Task[None]] = []
        self.sources: list[Source] = []
        for i, cfg in enumerate(configs):
            source_id = f"{cfg.kind}[{i}]:{cfg.names_prefix}"
            rec = Reconciler(source_id, cfg, fleet, in_flight, metrics, grace, self._http, clock)
            if isinstance(cfg, KubernetesDiscovery):
                from router.discovery.kubernetes import KubernetesSource

                self.sources.append(KubernetesSource(cfg, rec, clock))
            else:
                from router.discovery.dns import DnsSource

                self.sources.append(DnsSource(cfg, rec, clock))

    async def start(self) -> None:
        for src in self.sources:
            self._tasks.append(asyncio.create_task(self._guard(src.run, src.rec.source_id)))
        if self.sources:
            self._tasks.append(asyncio.create_task(self._ticks()))

    async def _guard(self, run: Callable[[], Any], what: str) -> None:
        while True:
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug in one round must not end discovery for good
                log.error(
                    "discovery source failed; restarting it",
                    extra={"fields": {"source": what, "error": type(exc).__name__}},
                    exc_info=exc,
                )
                await asyncio.sleep(1.0)

    async def _ticks(self) -> None:
        while True:
            await asyncio.sleep(_TICK)
            for src in self.sources:
                try:
                    await src.rec.tick()
                except Exception as exc:
                    log.warning(
                        "discovery tick failed",
                        extra={
                            "fields": {"source": src.rec.source_id, "error": type(exc).__name__}
                        },
                    )
            self.refresh_metrics()

    def refresh_metrics(self) -> None:
        now = self._clock()
        by_kind: dict[str, tuple[int, float | None]] = {}
        for src in self.sources:
            rec = src.rec
            age = None if rec.last_sync is None else now - rec.last_sync
            n, worst = by_kind.get(rec.kind, (0, 0.0))
            worst = None if age is None or worst is None else max(worst, age)
            by_kind[rec.kind] = (n + rec.backends, worst)
        for kind, (n, age) in by_kind.items():
            self._metrics.discovery_state(kind, n, age)

    def status(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [
            {
                "source": src.rec.source_id,
                "kind": src.rec.kind,
                "backends": src.rec.backends,
                "stale": src.rec.stale or src.rec.last_sync is None,
                "last_sync_seconds_ago": None
                if src.rec.last_sync is None
                else round(now - src.rec.last_sync, 3),
                "error": src.rec.error,
            }
            for src in self.sources
        ]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._http.aclose()
