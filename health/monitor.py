"""Background scheduling for health: active probes, and the tick that applies time's transitions.

One scheduler for every backend, not a task each: a heap of when each backend is due. A backend
is probed at once when it arrives (a new one is checked before it has to prove itself on
traffic), then every `interval` seconds with +-10 % jitter so replicas drift apart instead of
probing in lockstep; while it is out of rotation (ejected by traffic or failing probes) every
`unhealthy_interval` seconds instead, so a restarted backend is readmitted within seconds. An
ejection by traffic moves the backend's next probe forward to within `unhealthy_interval` (the
HealthBook tells the scheduler), so nothing polls the book between probes. A semaphore bounds
how many probes run at once, and a budget how many start a second
(`health.max_probes_per_second`): a large fleet's intervals stretch, its cost stays flat, and
a backend costs a heap entry, not a task that wakes (50,000 of those woke ~50,000 times a
second between them).
Results go to the HealthBook. Two chores on the runner (the app's, or one of the monitor's own):
`health_probes`, a timer that starts the probes due and sleeps until the heap's next entry
(woken sooner by an earlier one: a new backend, an ejection), and `health_tick`, which calls
`HealthBook.advance()` every `tick` seconds (ejections and cooldowns ending, panic mode), since
reading health never changes it. Its time is the injected `clock` (in the app, the book's and
the runner's too: a manual clock moves probes and ejections alike).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
import time
from collections.abc import Callable, Sequence

from health.probes import probe, probe_transport
from health.state import HealthBook
from router.core.backend import Backend
from router.core.netpolicy import NetPolicy
from router.core.runner import Runner, Wake, shared_or_own

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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._book = book
        self._policy = policy  # for backends not from the file, as their traffic
        self._tick = tick
        # The app's runner and clock (its `sleep` and `now`); None: a runner of its own at
        # start, on real time.
        self._runner = runner
        self._own_runner: Runner | None = None
        self._clock = clock
        self._rng = rng or random.Random()
        self._sem = asyncio.Semaphore(concurrency)
        # The global section (no backend has the empty name): the budget is the process's.
        self._budget = _Budget(book.health_config("").max_probes_per_second)
        self._backends: dict[str, Backend] = {}
        self._scheduled: dict[str, Backend] = {}  # the backends probed
        # When each scheduled backend's next probe is due; none while its probe starts or runs.
        # A heap entry whose time is not its backend's `_due` is stale (moved, or it left).
        self._due: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._running: dict[str, asyncio.Task[None]] = {}  # probes under way
        self._wake = Wake()  # an entry sooner than the one the schedule sleeps for
        self._started = False
        self._chores = False  # registered on the runner (once: a runner keeps its chores)
        book.on_ejected = self._ejected

    def sync(self, backends: Sequence[Backend]) -> None:
        """Adopt a backend set; once started, probe new or changed backends at once."""
        self._backends = {b.name: b for b in backends}
        if self._started:
            self._reconcile()

    def update(self, upserted: Sequence[Backend], removed: Sequence[str]) -> None:
        """`sync` for a change alone: only these backends are looked at."""
        for name in removed:
            self._backends.pop(name, None)
            self._unschedule(name)
        for b in upserted:
            self._backends[b.name] = b
            held = self._scheduled.get(b.name)
            if held is not None and held != b:
                self._unschedule(b.name)
            if self._started:
                self._schedule_new(b)

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._reconcile()
        if not self._chores:  # a runner keeps its chores: started again, the app's has them
            runner, self._own_runner = shared_or_own(self._runner)
            runner.timer("health_probes", self._start_due, self._wake)
            runner.every("health_tick", self._advance, self._tick)
            self._chores = True

    async def _advance(self) -> None:
        self._book.advance()

    def probing(self) -> set[str]:
        """The backends that are probed (scheduled, or with a probe under way)."""
        return set(self._scheduled)

    async def aclose(self) -> None:
        # Its own runner first: no probe starts while those under way are cancelled.
        if self._own_runner is not None:
            await self._own_runner.stop()
            self._own_runner = None
            self._chores = False
        tasks = list(self._running.values())
        self._running.clear()
        self._scheduled.clear()
        self._heap.clear()
        self._due.clear()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._started = False

    # -- the schedule -------------------------------------------------------------------------

    def _reconcile(self) -> None:
        for name, backend in list(self._scheduled.items()):
            if self._backends.get(name) != backend:
                self._unschedule(name)
        for backend in self._backends.values():
            self._schedule_new(backend)

    def _schedule_new(self, backend: Backend) -> None:
        if backend.name in self._scheduled or not self._book.health_config(backend.name).enabled:
            return
        self._scheduled[backend.name] = backend
        self._push(backend.name, self._clock())

    def _unschedule(self, name: str) -> None:
        self._scheduled.pop(name, None)
        self._due.pop(name, None)
        task = self._running.pop(name, None)
        if task is not None:
            task.cancel()

    def _push(self, name: str, at: float) -> None:
        self._due[name] = at
        heapq.heappush(self._heap, (at, name))
        if self._heap[0][1] == name:
            self._wake.set()  # sooner than what the schedule sleeps for

    def _ejected(self, name: str) -> None:
        """Traffic ejected `name`: its next probe comes within `unhealthy_interval`."""
        due = self._due.get(name)
        if due is None:
            return  # not probed, or its probe starts or runs: it reschedules by what it finds
        soon = self._clock() + self.next_delay(self._book.health_config(name).unhealthy_interval)
        if soon < due:
            self._push(name, soon)

    async def _start_due(self) -> float | None:
        """The `health_probes` round: start every probe that is due, within the budget and the
        semaphore; the seconds until the next one (None: no backend is probed)."""
        heap = self._heap
        while heap:
            at, name = heap[0]
            if self._due.get(name) != at:
                heapq.heappop(heap)  # stale
                continue
            now = self._clock()
            if at > now:
                return at - now
            wait = self._budget.wait(now)
            if wait > 0:
                return wait
            heapq.heappop(heap)
            del self._due[name]
            backend = self._scheduled[name]
            await self._sem.acquire()
            if self._scheduled.get(name) is not backend:  # left or changed meanwhile
                self._sem.release()
                continue
            self._running[name] = asyncio.get_running_loop().create_task(self._probe(backend))
        return None

    async def _probe(self, backend: Backend) -> None:
        name = backend.name
        cfg = self._book.health_config(name)
        # Made per probe (it keeps no connection: max_keepalive 0), so a backend costs no
        # transport between probes; a changed backend is a new entry, with its TLS context.
        transport = probe_transport(backend, self._policy)
        try:
            result = await probe(transport, backend, cfg)
            self._book.on_probe(name, result)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("probe error", extra={"fields": {"backend": name}})
        finally:
            transport.retire()
            self._sem.release()
            if self._running.get(name) is asyncio.current_task():
                del self._running[name]
        if self._scheduled.get(name) is backend and name not in self._due:
            out = self._book.out_of_rotation(name)
            every = cfg.unhealthy_interval if out else cfg.interval
            self._push(name, self._clock() + self.next_delay(every))

    def next_delay(self, interval: float) -> float:
        return interval * self._rng.uniform(1 - JITTER, 1 + JITTER)


class _Budget:
    """At most `rate` probe starts a second across every backend (a burst of up to a tenth of
    a second's worth: a second's worth, 200 connects in one loop turn, held the loop ~30 ms).
    The schedule asks it before each start and, when it says wait, sleeps that long."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._burst = max(1.0, rate / 10)
        self._tokens = self._burst
        self._last: float | None = None

    def wait(self, now: float) -> float:
        """0 (and one start taken) when a start may come at `now`, else the seconds until one."""
        if self._last is not None:
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self.rate
