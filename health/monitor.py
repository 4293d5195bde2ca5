"""Background scheduling for health: active probes, and the tick that applies time's transitions.

One task per backend: probe at once (a new backend is checked before it has to prove itself on
traffic), then every `interval` seconds with +-10 % jitter so replicas drift apart instead of
probing in lockstep; while the backend is out of rotation (ejected by traffic or failing probes)
every `unhealthy_interval` seconds instead, so a restarted backend is readmitted within seconds.
Between probes the task looks at the HealthBook every `unhealthy_interval` (a read), so an
ejection is followed by a probe within that. A semaphore bounds how many probes run at once,
and a budget how many start a second (`health.max_probes_per_second`): a large fleet's
intervals stretch, its cost stays flat.
Results go to the HealthBook. One more task calls `HealthBook.advance()` every `tick` seconds
(ejections and cooldowns ending, panic mode), since reading health never changes it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Sequence

from health.probes import probe, probe_transport
from health.state import HealthBook
from router.core.backend import Backend
from router.core.netpolicy import NetPolicy
from router.core.runner import Runner, shared_or_own

log = logging.getLogger("sluicegate.health")

JITTER = 0.1


class HealthMonitor:
    def __init__(
        self,
        book: HealthBook,
        concurrency: int = 32,
        rng: random.Random | None = None,
        tick: float = 0.25,
        policy: NetPolicy | None = None,
        runner: Runner | None = None,
    ) -> None:
        self._book = book
        self._policy = policy  # for backends not from the file, as their traffic
        self._tick = tick
        self._runner = runner  # the app's; None: one of its own at start
        self._own_runner: Runner | None = None
        self._rng = rng or random.Random()
        self._sem = asyncio.Semaphore(concurrency)
        # The global section (no backend has the empty name): the budget is the process's.
        self._budget = _Budget(book.health_config("").max_probes_per_second)
        self._backends: dict[str, Backend] = {}
        self._tasks: dict[str, tuple[Backend, asyncio.Task[None]]] = {}
        self._started = False

    def sync(self, backends: Sequence[Backend]) -> None:
        """Adopt a backend set; once started, probe new or changed backends at once."""
        self._backends = {b.name: b for b in backends}
        if self._started:
            self._reconcile()

    def update(self, upserted: Sequence[Backend], removed: Sequence[str]) -> None:
        """`sync` for a change alone: only these backends' probe tasks are looked at."""
        for name in removed:
            self._backends.pop(name, None)
            held = self._tasks.pop(name, None)
            if held is not None:
                held[1].cancel()
        for b in upserted:
            self._backends[b.name] = b
            held = self._tasks.get(b.name)
            if held is not None and held[0] != b:
                held[1].cancel()
                del self._tasks[b.name]
            if self._started:
                self._start_one(b)

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._reconcile()
        runner, self._own_runner = shared_or_own(self._runner)

        async def advance() -> None:
            self._book.advance()

        runner.every("health_tick", advance, self._tick)

    def probing(self) -> set[str]:
        """The backends whose probe task is running."""
        return {name for name, (_, task) in self._tasks.items() if not task.done()}

    async def aclose(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self._own_runner is not None:
            await self._own_runner.stop()
            self._own_runner = None
        self._started = False

    def _reconcile(self) -> None:
        for name, (backend, task) in list(self._tasks.items()):
            if self._backends.get(name) != backend:
                task.cancel()
                del self._tasks[name]
        for backend in self._backends.values():
            self._start_one(backend)

    def _start_one(self, backend: Backend) -> None:
        name = backend.name
        if name in self._tasks or not self._book.health_config(name).enabled:
            return
        task = asyncio.get_running_loop().create_task(self._loop(backend))
        self._tasks[name] = (backend, task)

    async def _loop(self, backend: Backend) -> None:
        cfg = self._book.health_config(backend.name)
        # This backend's own (a changed backend gets a new loop, so a new TLS context is used).
        transport = probe_transport(backend, self._policy)
        try:
            while True:
                try:
                    await self._budget.take()
                    async with self._sem:
                        result = await probe(transport, backend, cfg)
                    self._book.on_probe(backend.name, result)
                except Exception:
                    # A bug here must not stop this backend's probes for good.
                    log.exception("probe loop error", extra={"fields": {"backend": backend.name}})
                await self._until_next_probe(backend.name, cfg.interval, cfg.unhealthy_interval)
        finally:
            transport.retire()

    async def _until_next_probe(self, name: str, interval: float, unhealthy: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.next_delay(interval)
        while (left := end - loop.time()) > 0:
            await asyncio.sleep(min(left, self.next_delay(unhealthy)))
            if self._book.out_of_rotation(name):
                return

    def next_delay(self, interval: float) -> float:
        return interval * self._rng.uniform(1 - JITTER, 1 + JITTER)


class _Budget:
    """At most `rate` probe starts a second across every backend (a burst of up to one
    second's worth). Takers queue on a lock, so only the first of them sleeps: a fleet of
    thousands waiting costs no wake-ups."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = rate
        self._last: float | None = None
        self._lock = asyncio.Lock()

    async def take(self) -> None:
        loop = asyncio.get_running_loop()
        async with self._lock:
            while True:
                now = loop.time()
                if self._last is not None:
                    self._tokens = min(self.rate, self._tokens + (now - self._last) * self.rate)
                self._last = now
                if self._tokens >= 1:
                    self._tokens -= 1
                    return
                await asyncio.sleep((1 - self._tokens) / self.rate)
