"""The background reader of every engine's `/metrics`, owned by the app (one per process).

Every `engine_metrics.interval` each scrapable backend (kind vllm or sglang, `metrics_path` set)
gets one GET unless its previous one is still running, so a slow engine costs one task and one
connection, never a pile. Each scrape is bounded by `timeout`; its connection comes from a
one-connection transport of the scraper's own, so scrapes never take a pool slot from proxied
requests, made by `backend_transport` as traffic's (the same TLS context and network policy).
A good answer replaces the backend's reading; a failed one (status, timeout, refused,
malformed, NaN/negative/absurd values, more series than an engine has, a page over
`max_page_bytes`, whose reading stops there) keeps the last figures, sets `scrape_error` and
counts an error; a reading with no good scrape for `stale_after` is `stale`. Staleness is judged
from the oldest good scrape forward (the fresh readings kept in the order of their last good
scrape), and the turn order is a list made once per membership change: a tick costs the
scrapes it starts and the readings that turn stale, not a walk over every engine (at 50,000
engines that walk held the loop ~25 ms four times a second). In a fleet of more than
BATCH_ABOVE engines a scrape's new reading is published with the others that ended within a
short window (`_flush_delay`: 10 ms, longer for a larger fleet), one copy of the map for all of
them: a copy per scrape was quadratic in the fleet's size (50,000 first failures took 22 s of
copies). A smaller fleet's readings are published as each scrape ends: `least_load` pairs a
reading with the router's own count of requests in flight when it first sees it (to count what
it sent since), and a reading seen late is paired with a later count (a follow-up request then
saw its engine one request busier than it was, and moved).
A vLLM backend's LoRA adapters (router/engine/adapters.py) are asked of its `/v1/models` after a
good scrape at most every `lora_refresh` seconds, over the same connection and deadline; a failed
answer keeps the adapters last read. Nothing here ejects
a backend (health owns that) and nothing raises into a request: the request path only reads
`readings`, an immutable mapping swapped whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import httpx

from router.core.backend import Backend
from router.core.engine import EngineReading
from router.core.errors import UpstreamTlsError
from router.core.netpolicy import NetPolicy
from router.core.runner import Runner, shared_or_own
from router.core.settings import EngineMetricsConfig
from router.engine.adapters import MAX_BODY, AdaptersError, adapters_of, max_model_len_of
from router.engine.calibrate import Calibration
from router.engine.parse import FAMILIES, MetricsError, parse
from router.upstream.pools import backend_transport
from router.upstream.transport import LeanTransport

log = logging.getLogger("sluicegate.engine")

SPREAD = 10  # slices a tick's scrapes start in, across its interval
BATCH_ABOVE = 1000  # engines: past this many, readings are published in batches (~12 us a copy)


@dataclass
class _Target:
    backend: Backend
    transport: LeanTransport | None  # made at the first scrape (a large fleet fills faster)
    reading: EngineReading
    last_ok: float = float("-inf")  # monotonic time of the last good scrape
    errors: int = 0
    busy: bool = False
    calibration: Calibration = field(default_factory=Calibration)
    adapters: frozenset[str] | None = None  # from /v1/models (vLLM only)
    adapters_at: float = float("-inf")  # monotonic time of the last /v1/models question
    max_model_len: int | None = None  # from /v1/models (vLLM only)


def _reached(b: Backend) -> tuple[object, ...]:
    """What a scrape's connection depends on: a change of any of it starts a fresh one."""
    return (b.url, b.metrics_path, b.source == "file", b.ssl_context, b.server_name)


def scrapable(backend: Backend) -> bool:
    return backend.metrics_path is not None and backend.kind in FAMILIES


class EngineScraper:
    def __init__(
        self,
        cfg: EngineMetricsConfig,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_error: Callable[[str], None] | None = None,
        policy: NetPolicy | None = None,
        lora_refresh: float = 5.0,
        runner: Runner | None = None,
    ) -> None:
        self.cfg = cfg
        self._lora_refresh = lora_refresh
        self._policy = policy  # for backends not from the file, as their traffic
        self._on_error = on_error
        self._mono = monotonic
        self._wall = wall
        self._targets: dict[str, _Target] = {}
        self._ring: list[_Target] | None = None  # the turn order; None: to be made again
        # Targets whose reading is not stale, oldest good scrape first.
        self._fresh: OrderedDict[str, _Target] = OrderedDict()
        self._pending: set[str] = set()  # new readings not yet in `readings`
        self._flush: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner = runner  # the app's; None: one of its own at start
        self._own_runner: Runner | None = None
        self._started = False
        self._cursor = 0  # where the next tick's turns start (the budget)
        self._later: set[asyncio.TimerHandle] = set()  # a tick's scrapes still to start
        self.readings: Mapping[str, EngineReading] = MappingProxyType({})
        self.scrapes = 0
        # Called after new readings are published (the admission queue re-checks on it).
        self.on_change: Callable[[], None] | None = None
        # Called when an engine's adapters (its /v1/models) changed: LoRA routes follow.
        self.on_adapters: Callable[[], None] | None = None
        # This process's in-flight count on a backend, read as a scrape is sent
        # (`EngineReading.inflight_at`); None: not known.
        self.inflight: Callable[[str], int | None] | None = None

    # --- what the rest of the router reads --------------------------------------------------

    def errors(self) -> dict[str, int]:
        return {name: t.errors for name, t in self._targets.items()}

    def in_flight(self) -> int:
        return len(self._tasks)

    def refresh_adapters(self, name: str) -> None:
        """Ask `name`'s /v1/models again with its next scrape (an adapter was just loaded)."""
        t = self._targets.get(name)
        if t is not None:
            t.adapters_at = float("-inf")

    # --- membership ---------------------------------------------------------------------------

    def sync(self, backends: Iterable[Backend]) -> None:
        """Follow a registry swap: new backends are scraped from the next tick; removed ones
        are forgotten; a changed URL or path starts over with a fresh connection."""
        wanted = {b.name: b for b in backends if scrapable(b)}
        lost_adapters = False
        for name in list(self._targets):
            t = self._targets[name]
            nb = wanted.get(name)
            if nb is None or _reached(nb) != _reached(t.backend):
                _retire(t)
                lost_adapters = lost_adapters or bool(t.adapters)
                self._forget(name)
        for name, b in wanted.items():
            old = self._targets.get(name)
            if old is None:
                self._targets[name] = self._target(b)
                self._ring = None
            else:
                old.backend = b  # weight or key changes: same connection
        self._publish()
        if lost_adapters and self.on_adapters is not None:
            self.on_adapters()

    def update(self, upserted: Iterable[Backend], removed: Iterable[str]) -> None:
        """`sync` for a change alone (a discovery slice)."""
        changed: dict[str, EngineReading | None] = {}
        lost_adapters = False
        for name in removed:
            t = self._targets.get(name)
            if t is not None:
                self._forget(name)
                _retire(t)
                lost_adapters = lost_adapters or bool(t.adapters)
                changed[name] = None
        for b in upserted:
            t = self._targets.get(b.name)
            if t is not None and _reached(b) == _reached(t.backend):
                t.backend = b  # weight or key changes: same connection
                continue
            if t is not None:
                _retire(t)
                lost_adapters = lost_adapters or bool(t.adapters)
                self._forget(b.name)
                changed[b.name] = None
            if scrapable(b):
                self._targets[b.name] = self._target(b)
                self._ring = None
                changed[b.name] = self._targets[b.name].reading
        if changed:
            new = self._readings_copy()
            for name, reading in changed.items():
                if reading is None:
                    new.pop(name, None)
                else:
                    new[name] = reading
            self.readings = MappingProxyType(new)
            if self.on_change is not None:
                self.on_change()
        if lost_adapters and self.on_adapters is not None:
            self.on_adapters()

    def _forget(self, name: str) -> None:
        del self._targets[name]
        self._fresh.pop(name, None)
        self._ring = None

    def _target(self, b: Backend) -> _Target:
        return _Target(b, None, EngineReading(0.0, 0.0, 0.0, None, None, 0.0, 0, stale=True))

    def _transport(self, t: _Target) -> LeanTransport:
        if t.transport is None:
            t.transport = backend_transport(t.backend, _ONE, self._policy)
        return t.transport

    # --- the loop -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        runner, self._own_runner = shared_or_own(self._runner)

        async def tick() -> None:
            self.tick()

        runner.every("engine_scrape", tick, self.cfg.interval, immediately=True)

    def tick(self) -> None:
        """Start a scrape for each idle target, within the budget (`max_scrapes_per_second`
        times `interval` a tick, taken in turn from where the last tick stopped), then re-judge
        staleness for all."""
        targets = self._ring
        if targets is None:
            targets = self._ring = list(self._targets.values())
        budget = max(1, int(self.cfg.max_scrapes_per_second * self.cfg.interval))
        i = self._cursor
        chosen: list[_Target] = []
        for _ in range(len(targets)):
            if len(chosen) >= budget:
                break
            t = targets[i % len(targets)]
            i += 1
            if not t.busy:
                t.busy = True
                chosen.append(t)
        self._cursor = i % len(targets) if targets else 0
        # Started in SPREAD slices across the interval, not all at once: 250 connects in one
        # loop turn held it ~40 ms (measured at 50,000 engines). Stale readings first (a new
        # engine's included): routing avoids an engine while its reading is stale.
        chosen.sort(key=lambda t: not t.reading.stale)
        step = max(1, -(-len(chosen) // SPREAD))
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._later = {h for h in self._later if h.when() > now}  # those not yet fired
        for n, at in enumerate(range(0, len(chosen), step)):
            part = chosen[at : at + step]
            if n == 0:
                self._start(part)
            else:
                handle = loop.call_later(n * self.cfg.interval / SPREAD, self._start_later, part)
                self._later.add(handle)
        self._mark_stale()

    def _start(self, part: list[_Target]) -> None:
        for t in part:
            task = asyncio.create_task(self._scrape(t))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _start_later(self, part: list[_Target]) -> None:
        live = [t for t in part if self._targets.get(t.backend.name) is t]
        for t in part:
            if self._targets.get(t.backend.name) is not t:
                t.busy = False  # removed meanwhile
        self._start(live)

    def _stale_after(self) -> float:
        # Over budget, a target's turn comes every len/rate seconds: stale after three missed.
        turn = len(self._targets) / self.cfg.max_scrapes_per_second
        return max(self.cfg.stale_after, 3 * turn)

    async def _scrape(self, t: _Target) -> None:
        b = t.backend
        error: str | None = None
        parsed = None
        adapters_changed = False
        inflight_at = self.inflight(b.name) if self.inflight is not None else None
        try:
            async with asyncio.timeout(self.cfg.timeout):
                body = await self._fetch(b, self._transport(t))
            parsed = parse(body, b.kind, self.cfg.max_kv_tokens)
            if b.kind == "vllm" and self._mono() - t.adapters_at >= self._lora_refresh:
                t.adapters_at = self._mono()
                with contextlib.suppress(  # keeps the last adapters; the load reading stands
                    TimeoutError, httpx.HTTPError, MetricsError, AdaptersError, _BadStatus
                ):
                    async with asyncio.timeout(self.cfg.timeout):
                        models = await self._fetch(b, self._transport(t), "/v1/models", MAX_BODY)
                    bases = set(b.models.values())
                    found = adapters_of(models, bases)
                    t.max_model_len = max_model_len_of(models, bases)
                    adapters_changed = found != t.adapters
                    t.adapters = found
        except TimeoutError:
            error = "timeout"
        except MetricsError as exc:
            error = f"malformed: {exc}"
        except UpstreamTlsError as exc:
            error = f"unreachable: {exc}"
        except httpx.HTTPError as exc:
            error = f"unreachable: {type(exc).__name__}"
        except _BadStatus as exc:
            error = f"HTTP {exc.status}"
        except Exception as exc:  # never let one engine's oddity end its scraping
            error = f"error: {type(exc).__name__}"
        finally:
            t.busy = False
        self.scrapes += 1
        if self._targets.get(b.name) is not t:
            return  # removed or replaced while we waited
        if parsed is None:
            t.errors += 1
            if self._on_error is not None:
                self._on_error(b.name)
            failed = replace(t.reading, scrape_error=error, stale=self._is_stale(t))
            if failed == t.reading:
                # The same failure again (an engine that stays unreachable): the readings
                # are as they were, and copying them (a map of every engine) once per failed
                # scrape cost, at 50,000 engines, more than the scrapes themselves.
                if adapters_changed and self.on_adapters is not None:
                    self.on_adapters()
                return
            t.reading = failed
        else:
            t.last_ok = self._mono()
            self._fresh[b.name] = t
            self._fresh.move_to_end(b.name)
            cal = t.calibration
            cal.update(parsed.counters, parsed.running)
            lora = parsed.lora
            t.reading = EngineReading(
                parsed.waiting,
                parsed.running,
                parsed.kv_usage,
                parsed.kv_capacity_tokens,
                parsed.preemptions,
                self._wall(),
                t.reading.seq + 1,
                block_size=parsed.block_size,
                prefill_s_per_token=cal.prefill_s_per_token,
                step_s_per_seq=cal.step_s_per_seq,
                max_lora=lora[0] if lora else None,
                lora_running=lora[1] if lora else frozenset(),
                lora_waiting=lora[2] if lora else frozenset(),
                adapters=t.adapters,
                max_model_len=t.max_model_len,
                inflight_at=inflight_at,
                tokens_waiting=parsed.tokens_waiting,
            )
        self._publish_one(b.name)
        if adapters_changed and self.on_adapters is not None:
            self._publish_now()  # LoRA routes are made from `readings`: they must hold it
            self.on_adapters()

    async def _fetch(
        self, b: Backend, transport: LeanTransport, path: str | None = None, cap: int = 0
    ) -> bytes:
        accept = b"application/json" if path else b"text/plain"
        limit = cap or self.cfg.max_page_bytes
        request = httpx.Request(
            "GET",
            b.url + (path or b.metrics_path or "/metrics"),
            headers=[(b"accept", accept), *b.auth_headers],
            extensions={"timeout": {"connect": None, "read": None, "write": None, "pool": None}},
        )
        response = await transport.handle_async_request(request)
        try:
            if response.status_code != 200:
                raise _BadStatus(response.status_code)
            parts = []
            size = 0
            async for chunk in response.aiter_raw():
                size += len(chunk)
                if size > limit:
                    raise MetricsError("answer too large")
                parts.append(chunk)
            return b"".join(parts)
        finally:
            await response.aclose()

    def _is_stale(self, t: _Target) -> bool:
        return self._mono() - t.last_ok > self._stale_after()

    def _mark_stale(self) -> None:
        """The fresh readings whose last good scrape is `stale_after` old turn stale, oldest
        first; the walk stops at the first one still fresh. (One judged stale stays so until
        its next good scrape, even if a larger fleet then lengthens `stale_after`.)"""
        fresh = self._fresh
        if not fresh:
            return
        oldest = self._mono() - self._stale_after()
        turned: dict[str, EngineReading] = {}
        while fresh:
            name, t = next(iter(fresh.items()))
            if t.last_ok >= oldest:
                break
            del fresh[name]
            if not t.reading.stale:
                t.reading = replace(t.reading, stale=True)
                turned[name] = t.reading
        if turned:
            self._swap(turned)

    def _readings_copy(self) -> dict[str, EngineReading]:
        # The proxy's own copy is the dict's (memcpy-like); dict(proxy) walks it key by key.
        r = self.readings
        return r.copy() if isinstance(r, MappingProxyType) else dict(r)

    def _publish(self) -> None:
        self.readings = MappingProxyType({n: t.reading for n, t in self._targets.items()})
        if self.on_change is not None:
            self.on_change()

    def _swap(self, changed: Mapping[str, EngineReading]) -> None:
        """`readings` again, with `changed` in it (one copy of the map, swapped whole)."""
        new = self._readings_copy()
        new.update(changed)
        self.readings = MappingProxyType(new)
        if self.on_change is not None:
            self.on_change()

    def _publish_one(self, name: str) -> None:
        if len(self._targets) <= BATCH_ABOVE:
            self._swap({name: self._targets[name].reading})
            return
        self._pending.add(name)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(
                self._flush_delay(), self._publish_pending
            )

    def _flush_delay(self) -> float:
        # 10 ms, plus 1 us per engine: at most ~100 copies a second of a small map, ~16 of a
        # 50,000-engine one (0.6 ms each, measured).
        return 0.01 + len(self._targets) * 1e-6

    def _publish_now(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        self._publish_pending()

    def _publish_pending(self) -> None:
        self._flush = None
        names, self._pending = self._pending, set()
        # Those removed meanwhile are left out: their removal published itself.
        changed = {n: t.reading for n in names if (t := self._targets.get(n)) is not None}
        if changed:
            self._swap(changed)

    async def aclose(self) -> None:
        if self._own_runner is not None:
            await self._own_runner.stop()
            self._own_runner = None
        for handle in self._later:
            handle.cancel()
        self._later.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        for t in self._targets.values():
            _retire(t)
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None


_ONE = httpx.Limits(max_connections=1, max_keepalive_connections=1)


def _retire(t: _Target) -> None:
    if t.transport is not None:
        t.transport.retire()


class _BadStatus(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status
