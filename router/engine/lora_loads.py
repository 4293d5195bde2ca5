"""LoRA adapters loaded on demand (`lora.load_on_demand`), and unloaded again once idle.

`ensure(backend, adapter)` loads an adapter of `lora.sources` on one engine through vLLM's
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}`. One load per (engine, adapter) is in
flight at a time: concurrent requests await the same task, shielded, so a request that leaves
(client gone) stops waiting without cancelling the load the others wait for; each wait, and the
load itself, is bounded by `lora.load_timeout`. A failed load (an error status, a timeout, no
connection) raises `LoadFailed` and marks that engine as failed for that adapter only, for
`lora.failure_cooldown` seconds (`want()` hands that to the balancer, which then loads it
elsewhere); the engine's health is not touched. "Already loaded" (vLLM's 400 when another replica
loaded it first) counts as loaded.
`using()` / `done()` bracket each request sent for an adapter this router loaded; `sweep()`
(every second, from the app) unloads through `POST /v1/unload_lora_adapter` what has had no
request in flight for `lora.idle_unload` seconds, and forgets a load the engine's own
`/v1/models` no longer lists (it restarted). Adapters the engine was started with are never
unloaded. Loads and unloads are logged and counted (`sluicegate_lora_loads_total{backend,
adapter,result}`: loaded, failed, unloaded, unload_failed). State is bounded by the sources
times the backends. Per process: replicas each load what they need (vLLM's answer to a second
load of the same name is taken as success).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import httpx

from balancers.context import AdapterWant
from router.core.backend import Backend
from router.core.engine import EngineReading
from router.core.settings import LoraConfig
from router.upstream.pools import Pools

log = logging.getLogger("sluicegate.lora")

# (backend, path, JSON body) -> (status, the answer's first bytes)
Send = Callable[[Backend, str, bytes], Awaitable[tuple[int, bytes]]]
Count = Callable[[str, str, str], None]  # backend, adapter, result
_ALREADY = b"has already been loaded"


class LoadFailed(Exception):
    """The adapter could not be loaded on that engine; str() says why (no secrets)."""


@dataclass(slots=True)
class _Mine:
    """An adapter this router loaded on one engine."""

    loaded_at: float
    last_used: float
    in_use: int = 0


class LoraLoads:
    def __init__(
        self,
        cfg: LoraConfig,
        send: Send,
        count: Count | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self._send = send
        self._count = count or (lambda _b, _a, _r: None)
        self._mono = monotonic
        self._loading: dict[tuple[str, str], asyncio.Task[str | None]] = {}
        self._mine: dict[str, dict[str, _Mine]] = {}  # adapter -> backend -> state
        self._failed: dict[str, dict[str, float]] = {}  # adapter -> backend -> until
        # adapter -> backend -> until: unloaded, while the engine's reading may still list it
        self._unloaded: dict[str, dict[str, float]] = {}
        self._unloading: set[asyncio.Task[None]] = set()
        self.on_loaded: Callable[[str], None] | None = None  # backend: re-read its adapters

    # --- what the request path reads --------------------------------------------------------

    def want(self, adapter: str) -> AdapterWant:
        now = self._mono()
        failed = self._failed.get(adapter)
        if failed:
            for name in [n for n, until in failed.items() if until <= now]:
                del failed[name]
        # Loaded, or being loaded: requests arriving meanwhile go there and wait for that load.
        held = set(self._mine.get(adapter, ()))
        if self._loading:
            held.update(b for b, a in self._loading if a == adapter)
        unloaded = self._unloaded.get(adapter)
        if unloaded:
            for name in [n for n, until in unloaded.items() if until <= now]:
                del unloaded[name]
        return AdapterWant(
            adapter,
            self.cfg.load_on_demand and adapter in self.cfg.sources,
            frozenset(failed) if failed else frozenset(),
            frozenset(held),
            frozenset(unloaded) if unloaded else frozenset(),
        )

    def pending(self, backend: str, adapter: str) -> bool:
        """A load of `adapter` on `backend` is in flight: a request sent there waits for it."""
        return (backend, adapter) in self._loading

    def loaded(self) -> dict[str, list[str]]:
        """backend -> adapters this router loaded there (for /admin/backends)."""
        out: dict[str, list[str]] = {}
        for adapter, on in self._mine.items():
            for backend in on:
                out.setdefault(backend, []).append(adapter)
        return {b: sorted(a) for b, a in out.items()}

    def using(self, backend: str, adapter: str) -> None:
        m = self._mine.get(adapter, {}).get(backend)
        if m is not None:
            m.in_use += 1
            m.last_used = self._mono()

    def done(self, backend: str, adapter: str) -> None:
        m = self._mine.get(adapter, {}).get(backend)
        if m is not None:
            m.in_use = max(0, m.in_use - 1)
            m.last_used = self._mono()

    # --- loading ------------------------------------------------------------------------------

    async def ensure(self, backend: Backend, adapter: str) -> None:
        """Return once `adapter` is loaded on `backend`; raise LoadFailed if it cannot be."""
        if backend.name in self._mine.get(adapter, {}):
            return
        key = (backend.name, adapter)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.create_task(self._load(backend, adapter))
            self._loading[key] = task
            task.add_done_callback(lambda t: self._loaded(key, t))
        try:
            async with asyncio.timeout(self.cfg.load_timeout):
                error = await asyncio.shield(task)
        except TimeoutError:
            raise LoadFailed("the load did not finish in time") from None
        if error is not None:
            raise LoadFailed(error)

    def _loaded(self, key: tuple[str, str], task: asyncio.Task[str | None]) -> None:
        if self._loading.get(key) is task:
            del self._loading[key]

    async def _load(self, backend: Backend, adapter: str) -> str | None:
        """None when loaded, else why not; never raises (nobody may be left to see it)."""
        path = self.cfg.sources.get(adapter)
        if path is None:
            return "not in lora.sources"
        body = json.dumps({"lora_name": adapter, "lora_path": path}).encode()
        started = self._mono()
        error: str | None = None
        try:
            async with asyncio.timeout(self.cfg.load_timeout):
                status, answer = await self._send(backend, "/v1/load_lora_adapter", body)
            if status != 200 and not (status == 400 and _ALREADY in answer):
                error = f"the engine answered {status}"
        except TimeoutError:
            error = "timed out"
        except httpx.HTTPError as exc:
            error = f"unreachable: {type(exc).__name__}"
        fields = {"backend": backend.name, "adapter": adapter}
        now = self._mono()
        if error is not None:
            self._failed.setdefault(adapter, {})[backend.name] = now + self.cfg.failure_cooldown
            self._count(backend.name, adapter, "failed")
            log.warning("LoRA adapter load failed", extra={"fields": {**fields, "error": error}})
            return error
        self._failed.get(adapter, {}).pop(backend.name, None)
        self._unloaded.get(adapter, {}).pop(backend.name, None)
        self._mine.setdefault(adapter, {})[backend.name] = _Mine(now, now)
        self._count(backend.name, adapter, "loaded")
        log.info(
            "LoRA adapter loaded",
            extra={"fields": {**fields, "seconds": round(now - started, 3)}},
        )
        if self.on_loaded is not None:
            self.on_loaded(backend.name)
        return None

    # --- unloading ----------------------------------------------------------------------------

    def sweep(self, backends: Mapping[str, Backend], readings: Mapping[str, EngineReading]) -> None:
        """Unload what sat idle for `idle_unload`; forget loads on engines gone or restarted."""
        now = self._mono()
        grace = 2 * self.cfg.refresh + self.cfg.load_timeout
        for adapter, on in list(self._mine.items()):
            for name, m in list(on.items()):
                backend = backends.get(name)
                r = readings.get(name)
                listed = r is None or r.adapters is None or adapter in r.adapters
                if backend is None or (not listed and now - m.loaded_at > grace):
                    del on[name]  # the engine left, or lost it (restarted): nothing to unload
                elif m.in_use == 0 and now - m.last_used >= self.cfg.idle_unload:
                    del on[name]
                    # Until the engine's /v1/models is read again, its reading still lists it.
                    self._unloaded.setdefault(adapter, {})[name] = now + 3 * self.cfg.refresh + 1
                    task = asyncio.create_task(self._unload(backend, adapter))
                    self._unloading.add(task)
                    task.add_done_callback(self._unloading.discard)
            if not on:
                del self._mine[adapter]

    async def _unload(self, backend: Backend, adapter: str) -> None:
        body = json.dumps({"lora_name": adapter}).encode()
        result = "unloaded"
        try:
            async with asyncio.timeout(self.cfg.load_timeout):
                status, _ = await self._send(backend, "/v1/unload_lora_adapter", body)
            if status not in (200, 404):  # 404: it was not loaded (any more)
                result = "unload_failed"
        except (TimeoutError, httpx.HTTPError):
            result = "unload_failed"
        self._count(backend.name, adapter, result)
        if self.on_loaded is not None:
            self.on_loaded(backend.name)  # read its adapters again soon
        log.info(
            "LoRA adapter unloaded" if result == "unloaded" else "LoRA adapter unload failed",
            extra={"fields": {"backend": backend.name, "adapter": adapter}},
        )

    async def aclose(self) -> None:
        tasks = [*self._loading.values(), *self._unloading]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def pool_sender(pools: Pools) -> Send:
    """A `Send` over the backends' own pools (`Pools.request`): TLS, keys and limits as traffic."""

    async def send(backend: Backend, path: str, body: bytes) -> tuple[int, bytes]:
        headers = [(b"content-type", b"application/json"), *backend.auth_headers]
        transport, req = pools.request(backend, path, headers, body, "POST", False)
        response = await transport.send(req)
        try:
            answer = b""
            async for chunk in response.aiter_raw():
                answer += chunk
                if len(answer) > 65536:
                    break
            return int(response.status_code), answer
        finally:
            await response.aclose()

    return send
