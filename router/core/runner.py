"""The background chores of a process in one place: each named, started, paced, logged, stopped.

Three shapes cover every loop the router runs beside requests:
- `every(name, step, interval)`: call `step` every `interval` seconds (a number, or a function
  read before each wait, so a store can probe faster while degraded). A `wake` event cuts a wait
  short (a store with owed work).
- `timer(name, step, wake)`: a step that says when it is due next (a schedule: health's probes,
  admission's deadlines). `step` returns the seconds until its next round, or None for none
  until `wake.set()`; a set `wake` makes the next round come at once, also one set while the
  step runs. The wake interrupts the wait as `asyncio.timeout` does (a cancel taken back), so
  a wait costs no task beside the chore's own.
- `forever(name, body)`: a body that runs until it fails (a watch, a subscription); it is started
  again after a backoff that doubles from `backoff` up to `backoff_max` and resets once a run has
  lasted `backoff_max`. A body that returns has done its work: it is not started again.

A chore that raises is counted and logged (the first failure of a streak as a warning with its
exception's type; later ones at debug, so a dead dependency does not flood the log), and it keeps
its schedule: one bad round never ends a chore. A failing `every` chore backs off the same way;
a failing `timer` waits `backoff` doubling up to `backoff_max`, wakes or not.
`on_run(name, ok)` reports each round (the metrics count them); `stats()` has the streaks.
`stop()` cancels every chore and waits for it, bounded. Waits go through an injected `sleep` (the
app's clock, router/core/clock.py), so tests drive the pacing without real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from router.core.errors import is_store_failure

log = logging.getLogger("sluicegate.runner")

Sleep = Callable[[float], Awaitable[None]]
Interval = float | Callable[[], float]


@dataclass
class ChoreStats:
    name: str
    runs: int = 0
    failures: int = 0
    streak: int = 0  # failures in a row, 0 after a good round
    last_error: str | None = None  # the exception's type, never its message (it may hold secrets)


@dataclass
class _Chore:
    stats: ChoreStats
    run: Callable[[], Coroutine[Any, Any, None]]
    task: asyncio.Task[None] | None = field(default=None)


class Runner:
    def __init__(
        self,
        *,
        sleep: Sleep = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        on_run: Callable[[str, bool], None] | None = None,
    ) -> None:
        self._sleep = sleep
        self._clock = clock
        self._on_run = on_run
        self._chores: dict[str, _Chore] = {}
        self._started = False

    def every(
        self,
        name: str,
        step: Callable[[], Awaitable[object]],
        interval: Interval,
        *,
        wake: asyncio.Event | None = None,
        backoff_max: float | None = None,
        immediately: bool = False,
    ) -> None:
        """`step` every `interval` s (the first round at once with `immediately`); after
        failures the wait doubles, up to `backoff_max` (default: 8 intervals)."""

        async def loop() -> None:
            if immediately:
                await self._round(name, step)
            while True:
                base = interval() if callable(interval) else interval
                cap = backoff_max if backoff_max is not None else 8 * base
                streak = self._chores[name].stats.streak
                await self._wait(min(base * 2**streak, max(cap, base)) if streak else base, wake)
                await self._round(name, step)

        self._add(name, loop)

    def timer(
        self,
        name: str,
        step: Callable[[], Awaitable[float | None]],
        wake: Wake,
        *,
        backoff: float = 1.0,
        backoff_max: float = 30.0,
    ) -> None:
        """`step` at once, then whenever it said it is due next or `wake` is set."""
        due: list[float | None] = [None]

        async def call() -> None:
            due[0] = await step()

        async def loop() -> None:
            task = asyncio.current_task()
            assert task is not None
            while True:
                wake.pending = False
                if not await self._round(name, call):
                    streak = self._chores[name].stats.streak
                    await self._sleep(min(backoff * 2 ** (streak - 1), backoff_max))
                    continue
                delay = due[0]
                if wake.pending or (delay is not None and delay <= 0):
                    await asyncio.sleep(0)  # due again at once: the loop's others first
                    continue
                wake.sleeper = task
                try:
                    if delay is None:
                        await asyncio.get_running_loop().create_future()
                    else:
                        await self._sleep(delay)
                except asyncio.CancelledError:
                    # The wake's cancel is taken back; a stop's (alone or beside it) is not.
                    if wake.sleeper is task or task.uncancel() > 0:
                        raise
                finally:
                    wake.sleeper = None

        self._add(name, loop)

    def forever(
        self,
        name: str,
        body: Callable[[], Awaitable[object]],
        *,
        backoff: float = 0.1,
        backoff_max: float = 30.0,
    ) -> None:
        """`body` again whenever it fails, after a doubling backoff."""

        async def loop() -> None:
            delay = backoff
            while True:
                began = self._clock()
                if await self._round(name, body):
                    return
                if self._clock() - began >= backoff_max:
                    delay = backoff  # a long good run: the next failure starts the backoff over
                await self._sleep(delay)
                delay = min(delay * 2, backoff_max)

        self._add(name, loop)

    def _add(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        if name in self._chores:
            raise ValueError(f"a chore named {name!r} is registered already")
        chore = _Chore(ChoreStats(name), loop)
        self._chores[name] = chore
        if self._started:
            chore.task = asyncio.get_running_loop().create_task(loop(), name=name)

    async def _wait(self, seconds: float, wake: asyncio.Event | None) -> None:
        if wake is None:
            await self._sleep(seconds)
            return
        if wake.is_set():
            wake.clear()
            return
        sleeper = asyncio.ensure_future(self._sleep(seconds))
        woken = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait((sleeper, woken), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (sleeper, woken):
                t.cancel()
            for t in (sleeper, woken):
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        wake.clear()

    async def _round(self, name: str, fn: Callable[[], Awaitable[object]]) -> bool:
        """One call of `fn`, counted and reported; True when it did not raise."""
        stats = self._chores[name].stats
        stats.runs += 1
        try:
            await fn()
        except Exception as exc:  # a chore must outlive one bad round
            stats.failures += 1
            stats.streak += 1
            stats.last_error = type(exc).__name__
            if stats.streak == 1:
                log.warning(
                    f"{name} failed",
                    # A dependency away (a backend, Redis): its name is the news. Anything else is
                    # a bug: traceback.
                    exc_info=not is_store_failure(exc),
                    extra={"fields": {"chore": name, "error": stats.last_error}},
                )
            else:
                log.debug(f"{name} failed again", extra={"fields": {"streak": stats.streak}})
            ok = False
        else:
            if stats.streak:
                log.info(f"{name} works again", extra={"fields": {"after": stats.streak}})
            stats.streak = 0
            ok = True
        if self._on_run is not None:
            self._on_run(name, ok)
        return ok

    def start(self) -> None:
        """Starts the chores registered so far; later ones start as they are registered."""
        loop = asyncio.get_running_loop()
        self._started = True
        for name, chore in self._chores.items():
            if chore.task is None:
                chore.task = loop.create_task(chore.run(), name=name)

    def stats(self) -> list[ChoreStats]:
        return [c.stats for c in self._chores.values()]

    async def stop(self, within: float = 5.0) -> None:
        """Cancels every chore and waits (at most `within` s) for each to unwind."""
        tasks = [c.task for c in self._chores.values() if c.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=within)
            for task in pending:
                log.warning(
                    "a chore did not stop in time", extra={"fields": {"chore": task.get_name()}}
                )
        for chore in self._chores.values():
            chore.task = None
        self._started = False


class Wake:
    """Makes a `timer` chore's next round come at once: its wait is cut short, or, set while
    the chore works, the next wait is skipped. Set before the chore exists, it is remembered."""

    __slots__ = ("pending", "sleeper")

    def __init__(self) -> None:
        self.pending = False
        self.sleeper: asyncio.Task[None] | None = None  # the chore's task while it waits

    def set(self) -> None:
        self.pending = True
        task, self.sleeper = self.sleeper, None
        if task is not None:
            task.cancel()


def shared_or_own(shared: Runner | None) -> tuple[Runner, Runner | None]:
    """The runner a part registers its chores on: the app's, or (for a part used outside the
    app: tests, tools) a started one of its own, returned second so the part stops it when it
    closes."""
    if shared is not None:
        return shared, None
    own = Runner()
    own.start()
    return own, own
