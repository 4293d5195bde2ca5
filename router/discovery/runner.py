"""Builds the configured discovery sources, runs them as chores on the app's runner, and reports
them (the `/readyz` details, the `sluicegate_discovery_*` gauges). A source never ends on an
error: its own failures are caught in the source, logged, counted and retried, and a bug that
escapes it is logged by the runner and the source started again after a backoff."""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from router.core.netpolicy import NetPolicy
from router.core.runner import Runner, shared_or_own
from router.core.settings import (
    ConfigError,
    DnsDiscovery,
    InferencePoolDiscovery,
    KubernetesDiscovery,
    Settings,
)
from router.discovery.reconcile import DiscoveryMetrics, InFlight, Reconciler
from router.registry.fleet import Fleet

log = logging.getLogger("sluicegate.discovery")

_TICK = 0.25  # seconds between checks for vanished backends whose streams have ended


def check_discovery(settings: Settings) -> None:
    """A `kind: kubernetes` or `kind: inferencepool` source needs the optional Kubernetes client
    (`sluicegate[kubernetes]`, which the container image has): without it a `ConfigError` at
    startup, not a traceback in every worker."""
    kube = [
        (i, cfg.kind)
        for i, cfg in enumerate(settings.discovery)
        if isinstance(cfg, KubernetesDiscovery | InferencePoolDiscovery)
    ]
    if kube and importlib.util.find_spec("kubernetes_asyncio") is None:
        i, kind = kube[0]
        origin = f"config file {settings.config}" if settings.config else "settings"
        raise ConfigError(
            f"{origin}: discovery[{i}]: kind {kind} needs the Kubernetes client, which is "
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
        configs: Sequence[KubernetesDiscovery | InferencePoolDiscovery | DnsDiscovery],
        fleet: Fleet,
        in_flight: InFlight,
        metrics: RunnerMetrics,
        grace: float,
        clock: Callable[[], float] = time.monotonic,
        policy: NetPolicy | None = None,
        runner: Runner | None = None,
    ) -> None:
        self._runner = runner  # the app's; None: one of its own at start
        self._own_runner: Runner | None = None
        self._metrics = metrics
        self._clock = clock
        self.sources: list[Source] = []
        for i, cfg in enumerate(configs):
            source_id = f"{cfg.kind}[{i}]:{cfg.names_prefix}"
            rec = Reconciler(source_id, cfg, fleet, in_flight, metrics, grace, clock, policy)
            if isinstance(cfg, KubernetesDiscovery):
                from router.discovery.kubernetes import KubernetesSource

                self.sources.append(KubernetesSource(cfg, rec, clock))
            elif isinstance(cfg, InferencePoolDiscovery):
                from router.discovery.inferencepool import InferencePoolSource

                self.sources.append(InferencePoolSource(cfg, rec, clock))
            else:
                from router.discovery.dns import DnsSource

                self.sources.append(DnsSource(cfg, rec, clock))

    async def start(self) -> None:
        if not self.sources:
            return
        runner, self._own_runner = shared_or_own(self._runner)
        for src in self.sources:
            # A source's run() loops until cancelled; one that raises is started again.
            runner.forever(f"discovery:{src.rec.source_id}", src.run, backoff=1.0)
            # One chore a source: a failing tick leaves the other sources' ticks alone.
            runner.every(f"discovery_tick:{src.rec.source_id}", src.rec.tick, _TICK)

        async def refresh() -> None:
            self.refresh_metrics()

        runner.every("discovery_metrics", refresh, _TICK)

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
                "refused": src.rec.refused,
                "network_refused": src.rec.denied,
            }
            for src in self.sources
        ]

    async def aclose(self) -> None:
        if self._own_runner is not None:
            await self._own_runner.stop()
            self._own_runner = None
        for src in self.sources:
            src.rec.forget_questions()
