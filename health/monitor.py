"""Background scheduling for health: active probes, and the tick that applies time's transitions.

One task per backend: probe at once (a new backend is checked before it has to prove itself on
traffic), then every `interval` seconds with +-10 % jitter so replicas drift apart instead of
probing in lockstep; while the backend is out of rotation (ejected by traffic or failing probes)
every `unhealthy_interval` seconds instead, so a restarted backend is readmitted within seconds.
Between probes the task looks at the HealthBook every `unhealthy_interval` (a read), so an
ejection is followed by a probe within that. A semaphore bounds how many probes run at once.
Results go to the HealthBook. One more task calls `HealthBook.advance()` every `tick` seconds
(ejections and cooldowns ending, panic mode), since reading health never changes it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

import httpx

from health.probes import probe, probe_client
from health.state import HealthBook
from router.core.backend import Backend

log = logging.getLogger("sluicegate.health")

JITTER = 0.1


class HealthMonitor:
    def __init__(
        self,
        book: HealthBook,
        concurrency: int = 32,
        rng: random.Random | None = None,
        tick: float = 0.25,
    ) -> None:
        self._book = book
        self._tick = tick
        self._ticker: asyncio.Task[None] | None = None
        self._rng = rng or random.Random()
        self._sem = asyncio.Semaphore(concurrency)
        self._concurrency = concurrency
        self._backends: dict[str, Backend] = {}
        self._tasks: dict[str, tuple[Backend, asyncio.Task[None]]] = {}
        self._client: httpx.AsyncClient | None = None

    def sync(self, backends: Sequence[Backend]) -> None:
        """Adopt a backend set; once started, probe new or changed backends at once."""
        self._backends = {b.name: b for b in backends}
        if self._client is not None:
            self._reconcile()

    async def start(self) -> None:
        self._client = probe_client(self._concurrency)
        self._reconcile()
        self._ticker = asyncio.get_running_loop().create_task(self._ticking())

    async def _ticking(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            try:
                self._book.advance()
            except Exception:
                log.exception("health tick error")  # a bug must not stop the transitions

    def probing(self) -> set[str]:
        """The backends whose probe task is running."""
        return {name for name, (_, task) in self._tasks.items() if not task.done()}

    async def aclose(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        if self._ticker is not None:
            tasks.append(self._ticker)
            self._ticker = None
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _reconcile(self) -> None:
        for name, (backend, task) in list(self._tasks.items()):
            if self._backends.get(name) != backend:
                task.cancel()
                del self._tasks[name]
        for name, backend in self._backends.items():
            if name in self._tasks or not self._book.health_config(name).enabled:
                continue
            task = asyncio.get_running_loop().create_task(self._loop(backend))
            self._tasks[name] = (backend, task)

    async def _loop(self, backend: Backend) -> None:
        cfg = self._book.health_config(backend.name)
        client = self._client
        assert client is not None
        while True:
            try:
                async with self._sem:
                    result = await probe(client, backend, cfg)
                self._book.on_probe(backend.name, result)
            except Exception:
                # A bug here must not stop this backend's probes for good.
                log.exception("probe loop error", extra={"fields": {"backend": backend.name}})
            await self._until_next_probe(backend.name, cfg.interval, cfg.unhealthy_interval)

    async def _until_next_probe(self, name: str, interval: float, unhealthy: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.next_delay(interval)
        while (left := end - loop.time()) > 0:
            await asyncio.sleep(min(left, self.next_delay(unhealthy)))
            if self._book.out_of_rotation(name):
                return

    def next_delay(self, interval: float) -> float:
        return interval * self._rng.uniform(1 - JITTER, 1 + JITTER)
