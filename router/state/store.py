"""A store shared through Redis that may degrade to this process's own state: the one skeleton.

What every shared store (in-flight counts, quotas, the prefix index, usage, Responses ids) needs
around its own keys, scripts and logic, written once:
- calls: commands go pipelined through a `Batcher` (one per server: one, or on Cluster one per
  hash tag the store writes), each bounded by `timeout`. A failure is `StoreUnavailable`; a
  script's own runtime error (its request's arguments) is `ScriptFailed`. A store whose calls
  the client must make itself (a MULTI/EXEC transaction; keys spread over every Cluster slot)
  sends them through `_direct`: bounded and judged the same way, one round trip each.
- round trips: each one Redis took resets the failure count. DEGRADE_AFTER failed in a row (no
  answer in time, a lost connection, a redirect, a server refusing work: OOM, READONLY) and the
  store is `degraded`: one warning, `on_degraded(True)`, and the heartbeat is woken to probe.
  One late answer only sends its own request to local state.
- recovery, one rule for every store: a heartbeat round while degraded writes a probe key on the
  store's own slot, then runs the store's beat (re-registering what it holds) and settles its
  owed work; when all of that was answered the store is shared again. A write, not a PING: a
  demoted master, a full or a loading Redis answer PING yet refuse writes, and a store whose
  work is writing is not back until its writes are taken.
- heartbeat: one chore on the app's runner (`chore`), every `beat_every` s while healthy (only
  when woken, with None), every PROBE_EVERY s while degraded.
- owed work (`Owed`): what could not reach Redis yet (a lost release, a record made while
  degraded), capped: past the cap the oldest go (they are nearest to expiring on their own),
  counted in `dropped`. The heartbeat settles it, and `aclose` gives it one bounded try.
- scripts: registered by source (`_script` -> sha), loaded at `start`, reloaded on NOSCRIPT.
- `aclose`: the chore stops, the store hands back what it holds, owed work and queued commands
  get one bounded try, and a client the store opened itself is closed (the app's is not).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ClassVar, Generic, TypeVar

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from router.core.errors import STORE_FAILURES, StoreUnavailable, store_unavailable
from router.core.redis_client import Client, KeyConnections, RedisTarget, client_for, follow_master
from router.core.runner import Runner, shared_or_own
from router.state.batch import Batcher, HeldConnection, script_failed

DEGRADE_AFTER = 3  # failed round trips in a row before the whole store goes local
PROBE_EVERY = 0.5  # s between heartbeat rounds while degraded: shared state comes back quickly
_IDLE = 3600.0  # s between rounds of a store with no beat of its own (woken when degraded)
_PROBE_TTL_MS = 1000

T = TypeVar("T")
R = TypeVar("R")


class ScriptFailed(StoreUnavailable):
    """Redis ran the store's script and it failed on this request's arguments: not an outage."""


class Owed(Generic[T]):
    """Work that could not reach Redis yet, oldest first, at most `cap` items."""

    __slots__ = ("_items", "cap", "dropped")

    def __init__(self, cap: int) -> None:
        self._items: deque[T] = deque()
        self.cap = cap
        self.dropped = 0  # items let go at the cap

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: T) -> None:
        items = self._items
        if len(items) >= self.cap:
            items.popleft()
            self.dropped += 1
        items.append(item)

    def take(self, most: int | None = None) -> list[T]:
        """The oldest `most` (default: all), removed."""
        items = self._items
        if most is None or most >= len(items):
            out = list(items)
            items.clear()
            return out
        return [items.popleft() for _ in range(most)]

    def give_back(self, taken: Iterable[T]) -> None:
        """Items taken and not settled go back in front, oldest first, within the cap."""
        items = self._items
        items.extendleft(reversed(list(taken)))
        while len(items) > self.cap:
            items.popleft()
            self.dropped += 1


class SharedStore(Generic[T]):
    """Subclasses name their chore, logger and messages, and override the hooks they need:
    `_beat` (re-register what this process holds), `_settle` (send owed work), `_closing`
    (hand back what is held at shutdown), `_log_fields`."""

    kind = "redis"
    chore: ClassVar[str]
    log: ClassVar[logging.Logger]
    degraded_message: ClassVar[str]
    recovered_message: ClassVar[str]
    owed_max: ClassVar[int] = 100_000

    def __init__(
        self,
        redis: str | RedisTarget | Client,
        *,
        timeout: float,
        tag: str,
        beat_every: float | None,
        heartbeat: bool = True,
        runner: Runner | None = None,
        on_degraded: Callable[[bool], None] | None = None,
    ) -> None:
        self._redis, self._owns_client = client_for(redis, timeout)
        self._timeout = timeout
        self._store_tag = tag  # the store's own hash tag: its probe key lives in its slot
        self._probe_key = tag + ":probe"
        self._sources: dict[str, str] = {}  # sha -> source, reloaded on NOSCRIPT
        # One pipeline to one server; on Cluster, one per hash tag (each slot has its owner).
        self._held = HeldConnection(self._redis) if isinstance(self._redis, Redis) else None
        self._one = (
            Batcher(self._held, self._sources, timeout, self._round_trip) if self._held else None
        )
        self._batchers: dict[str, Batcher] = {}
        self.owed: Owed[T] = Owed(self.owed_max)
        self._failures = 0  # round trips failed in a row
        self.degraded = False
        self.round_trips = 0  # pipelines sent (concurrent requests' commands share one)
        self._beat_every = beat_every
        self._run_heartbeat = heartbeat
        self._runner = runner  # the app's; None: one of its own once the chore starts
        self._own_runner: Runner | None = None
        self._beating = False
        self._wake = asyncio.Event()
        self._on_degraded = on_degraded
        self._closed = False

    # --- calls -----------------------------------------------------------------------------

    def _script(self, source: str) -> str:
        sha = hashlib.sha1(source.encode()).hexdigest()
        self._sources[sha] = source
        return sha

    def _batcher(self, tag: str) -> Batcher:
        batcher = self._one or self._batchers.get(tag)
        if batcher is None:
            conns = KeyConnections(self._redis, tag)
            batcher = Batcher(conns, self._sources, self._timeout, self._round_trip)
            self._batchers[tag] = batcher
        return batcher

    async def _call(self, tag: str, *command: Any) -> Any:
        """The reply to `command` on `tag`'s server within `timeout`. Failures are judged per
        round trip (by the batcher): a call that outwaits its timeout behind a slow one only
        sends its own request to local state."""
        try:
            async with asyncio.timeout(self._timeout):
                return await (self._one or self._batcher(tag)).call(*command)
        except ResponseError as exc:
            if script_failed(exc):
                raise ScriptFailed(type(exc).__name__) from exc
            raise store_unavailable(exc) from exc
        except STORE_FAILURES as exc:
            raise store_unavailable(exc) from exc

    async def _direct(self, work: Awaitable[R]) -> R:
        """`work` (calls made through the client itself) within `timeout`, as one round trip:
        judged by the same rule as a pipeline's."""
        try:
            async with asyncio.timeout(self._timeout):
                out = await work
        except ResponseError as exc:
            if script_failed(exc):  # Redis answered: the request's arguments failed
                self._round_trip(None)
                raise ScriptFailed(type(exc).__name__) from exc
            self._round_trip(exc)
            raise store_unavailable(exc) from exc
        except STORE_FAILURES as exc:
            self._round_trip(exc)
            raise store_unavailable(exc) from exc
        self._round_trip(None)
        return out

    def _post(self, tag: str, command: tuple[Any, ...], lost: Callable[[], None]) -> None:
        """`command` on the next pipeline, not waited for; `lost` runs if it does not land."""
        (self._one or self._batcher(tag)).post(command, lost)

    # --- faults ----------------------------------------------------------------------------

    def _round_trip(self, error: BaseException | None) -> None:
        self.round_trips += 1
        if error is None:
            self._failures = 0
            return
        self._failures += 1
        if not self.degraded and self._failures >= DEGRADE_AFTER:
            self._degrade(type(error).__name__)

    def _degrade(self, reason: str) -> None:
        self.degraded = True
        self.log.warning(
            self.degraded_message, extra={"fields": {"error": reason, **self._log_fields()}}
        )
        if self._on_degraded is not None:
            self._on_degraded(True)
        self._schedule()
        self._wake.set()

    def _recover(self) -> None:
        self.degraded = False
        self._failures = 0
        self.log.info(self.recovered_message, extra={"fields": self._log_fields()})
        if self._on_degraded is not None:
            self._on_degraded(False)

    def _log_fields(self) -> dict[str, Any]:
        return {}

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        # Loaded up front (one pipeline) so the first requests don't pay a NOSCRIPT round trip.
        loads = [self._call(self._store_tag, "SCRIPT", "LOAD", s) for s in self._sources.values()]
        for outcome in await asyncio.gather(*loads, return_exceptions=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, StoreUnavailable):
                raise outcome
        await self.heartbeat()
        self._schedule()

    def _schedule(self) -> None:
        if not self._run_heartbeat or self._beating or self._closed:
            return
        self._beating = True
        runner, self._own_runner = shared_or_own(self._runner)
        runner.every(self.chore, self.heartbeat, self._interval, wake=self._wake)

    def _interval(self) -> float:
        if self.degraded:
            return PROBE_EVERY
        return _IDLE if self._beat_every is None else self._beat_every

    async def heartbeat(self) -> bool:
        """One round: the store's beat and its owed work, after a probe write while degraded;
        True when Redis took all of it (and, degraded, the store is shared again)."""
        if self._closed:
            return False
        try:
            # Sentinel: learn the master now; a held connection to a former one is closed by
            # its batcher before the next pipeline (never here: one may be on the wire).
            await follow_master(self._redis, self._timeout)
            if self.degraded:
                await self._call(self._store_tag, "SET", self._probe_key, 1, "PX", _PROBE_TTL_MS)
            await self._beat()
            await self._settle()
        except ScriptFailed:
            self.log.exception(f"{self.chore}: a script failed")
            return False
        except StoreUnavailable:
            return False
        if self.degraded:
            self._recover()
        return True

    async def _beat(self) -> None:
        """Re-register what this process holds (leases, slots, its membership)."""

    async def _settle(self) -> None:
        """Send owed work; what does not land goes back to `owed`."""

    async def _closing(self) -> None:
        """Shutdown: hand back what this process still holds (queued, not awaited)."""

    async def flush(self, within: float = 5.0) -> None:
        """Wait (bounded) for the commands already queued to be answered."""
        for batcher in [b for b in (self._one,) if b] + list(self._batchers.values()):
            await batcher.drain(within)

    async def aclose(self) -> None:
        if self._closed:
            return
        if self._own_runner is not None:
            await self._own_runner.stop()
            self._own_runner = None
        within = max(1.0, self._timeout * 4)
        await self._closing()
        self._closed = True
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(within):
                await self._settle()
        await self.flush(within)
        if self._held is not None:
            await self._held.drop()
        if self._owns_client:
            await self._redis.aclose()
