"""The background reader of every engine's `/metrics`, owned by the app (one per process).

Every `engine_metrics.interval` each scrapable backend (kind vllm or sglang, `metrics_path` set)
gets one GET unless its previous one is still running, so a slow engine costs one task and one
connection, never a pile. Each scrape is bounded by `timeout`; its connection comes from a
one-connection transport of the scraper's own, so scrapes never take a pool slot from proxied
requests. A good answer replaces the backend's reading; a failed one (status, timeout, refused,
malformed, NaN/negative/absurd values, more series than an engine has, a page over
`max_page_bytes`, whose reading stops there) keeps the last figures, sets `scrape_error` and
counts an error; a reading with no good scrape for `stale_after` is `stale`. Nothing here ejects
a backend (health owns that) and nothing raises into a request: the request path only reads
`readings`, an immutable mapping swapped whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import httpx

from router.core.backend import Backend
from router.core.engine import EngineReading
from router.core.netpolicy import NetPolicy
from router.core.settings import EngineMetricsConfig
from router.engine.calibrate import Calibration
from router.engine.parse import FAMILIES, MetricsError, parse
from router.upstream.transport import LeanTransport

log = logging.getLogger("sluicegate.engine")


@dataclass
class _Target:
    backend: Backend
    transport: LeanTransport
    reading: EngineReading
    last_ok: float = float("-inf")  # monotonic time of the last good scrape
    errors: int = 0
    busy: bool = False
    calibration: Calibration = field(default_factory=Calibration)


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
    ) -> None:
        self.cfg = cfg
        self._policy = policy  # for backends not from the file, as their traffic
        self._on_error = on_error
        self._mono = monotonic
        self._wall = wall
        self._targets: dict[str, _Target] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.readings: Mapping[str, EngineReading] = MappingProxyType({})
        self.scrapes = 0
        # Called after new readings are published (the admission queue re-checks on it).
        self.on_change: Callable[[], None] | None = None

    # --- what the rest of the router reads --------------------------------------------------

    def errors(self) -> dict[str, int]:
        return {name: t.errors for name, t in self._targets.items()}

    def in_flight(self) -> int:
        return len(self._tasks)

    # --- membership ---------------------------------------------------------------------------

    def sync(self, backends: Iterable[Backend]) -> None:
        """Follow a registry swap: new backends are scraped from the next tick; removed ones
        are forgotten; a changed URL or path starts over with a fresh connection."""
        wanted = {b.name: b for b in backends if scrapable(b)}
        for name in list(self._targets):
            t = self._targets[name]
            nb = wanted.get(name)
            if nb is None or (nb.url, nb.metrics_path, nb.source == "file") != (
                t.backend.url,
                t.backend.metrics_path,
                t.backend.source == "file",
            ):
                t.transport.retire()
                del self._targets[name]
        for name, b in wanted.items():
            old = self._targets.get(name)
            if old is None:
                self._targets[name] = _Target(
                    b,
                    LeanTransport(
                        httpx.Limits(max_connections=1, max_keepalive_connections=1),
                        policy=self._policy if b.source != "file" else None,
                    ),
                    EngineReading(0.0, 0.0, 0.0, None, None, 0.0, 0, stale=True),
                )
            else:
                old.backend = b  # weight or key changes: same connection
        self._publish()

    # --- the loop -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception as exc:  # a bug here must not end scraping for good
                log.warning("engine scrape round failed", extra={"fields": {"error": repr(exc)}})
            await asyncio.sleep(self.cfg.interval)

    def tick(self) -> None:
        """Start a scrape for each idle target, then re-judge staleness for all."""
        for t in self._targets.values():
            if not t.busy:
                t.busy = True
                task = asyncio.create_task(self._scrape(t))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self._mark_stale()

    async def _scrape(self, t: _Target) -> None:
        b = t.backend
        error: str | None = None
        parsed = None
        try:
            async with asyncio.timeout(self.cfg.timeout):
                body = await self._fetch(b, t.transport)
            parsed = parse(body, b.kind, self.cfg.max_kv_tokens)
        except TimeoutError:
            error = "timeout"
        except MetricsError as exc:
            error = f"malformed: {exc}"
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
            t.reading = replace(t.reading, scrape_error=error, stale=self._is_stale(t))
        else:
            t.last_ok = self._mono()
            cal = t.calibration
            cal.update(parsed.counters, parsed.running)
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
            )
        self._publish_one(b.name, t.reading)

    async def _fetch(self, b: Backend, transport: LeanTransport) -> bytes:
        request = httpx.Request(
            "GET",
            b.url + (b.metrics_path or "/metrics"),
            headers=[(b"accept", b"text/plain"), *b.auth_headers],
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
                if size > self.cfg.max_page_bytes:
                    raise MetricsError("answer too large")
                parts.append(chunk)
            return b"".join(parts)
        finally:
            await response.aclose()

    def _is_stale(self, t: _Target) -> bool:
        return self._mono() - t.last_ok > self.cfg.stale_after

    def _mark_stale(self) -> None:
        changed = False
        for t in self._targets.values():
            stale = self._is_stale(t)
            if stale != t.reading.stale:
                t.reading = replace(t.reading, stale=stale)
                changed = True
        if changed:
            self._publish()

    def _publish(self) -> None:
        self.readings = MappingProxyType({n: t.reading for n, t in self._targets.items()})
        if self.on_change is not None:
            self.on_change()

    def _publish_one(self, name: str, reading: EngineReading) -> None:
        new = dict(self.readings)
        new[name] = reading
        self.readings = MappingProxyType(new)
        if self.on_change is not None:
            self.on_change()

    async def aclose(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        for t in self._targets.values():
            t.transport.retire()


class _BadStatus(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status
