"""Turns a source's current endpoint set into discovered backends in the Fleet.

A source reports its whole current set (`update`) or a failure (`failed`); this module owns what
that means for routing:

    ready endpoint                  routable backend (`source: kubernetes|dns`)
    serving + terminating endpoint  draining: no new requests, streams in flight finish
    endpoint gone from the set      draining until its in-flight count is 0 (or `grace` passed),
                                    then removed
    a failed list/lookup            the last set stays; the source is marked stale

`models: auto` asks each new endpoint's `GET /v1/models`; an endpoint whose answer fails is
left out (warned and counted) and asked again a little later.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from router.core.backend import Backend
from router.core.netpolicy import NetPolicy
from router.core.settings import NAME_PATTERN, BackendConfig, DnsDiscovery, KubernetesDiscovery
from router.registry.fleet import Discovered, Fleet

log = logging.getLogger("sluicegate.discovery")

SourceConfig = KubernetesDiscovery | DnsDiscovery
InFlight = Callable[[Sequence[str]], Awaitable[dict[str, int]]]

_MODELS_RETRY = 2.0  # seconds before asking a failing endpoint's /v1/models again
_MAX_NAME = 63
_LOG_LINES = 20  # per-backend change lines per window; the rest only in the summary line
_LOG_WINDOW = 10.0
_MAX_MODELS = 64  # ids one endpoint may claim (models: auto)
_MAX_MODELS_BODY = 1024 * 1024
_MODELS_CONCURRENCY = 8  # models: auto questions in flight per source
_MODELS_DEADLINE = 5.0  # seconds for the whole /v1/models answer, body included
_MODEL_ID = re.compile(r"^[\x21-\x7e]{1,256}$")  # visible ASCII, no space or control chars


class DiscoveryMetrics(Protocol):
    def discovery_event(self, source: str, event: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    ready: bool  # False: serving but terminating (drain)


def backend_name(prefix: str, host: str, port: int) -> str:
    name = f"{prefix}-{host.replace(':', '-').strip('-[]')}-{port}"
    if len(name) > _MAX_NAME:  # long IPv6 addresses or FQDNs: a stable short digest instead
        digest = hashlib.sha256(f"{host}:{port}".encode()).hexdigest()[:16]
        name = f"{prefix}-{digest}"
    return name


def endpoint_url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


class Reconciler:
    def __init__(
        self,
        source_id: str,
        cfg: SourceConfig,
        fleet: Fleet,
        in_flight: InFlight,
        metrics: DiscoveryMetrics,
        grace: float,
        http: httpx.AsyncClient,
        clock: Callable[[], float] = time.monotonic,
        policy: NetPolicy | None = None,
    ) -> None:
        self._policy = policy
        self.source_id = source_id
        self.kind = cfg.kind
        self.cfg = cfg
        self._fleet = fleet
        self._in_flight = in_flight
        self._metrics = metrics
        self._grace = grace
        self._http = http
        self._clock = clock
        self._lock = asyncio.Lock()
        self._current: dict[str, tuple[str, Endpoint]] = {}  # name -> (url, endpoint)
        self._known: dict[str, Discovered] = {}
        self._gone_since: dict[str, float] = {}
        self._auto: dict[str, tuple[str, dict[str, str]]] = {}  # name -> (url, models)
        self._auto_retry: dict[str, float] = {}
        self.last_sync: float | None = None
        self.refused = 0  # endpoints over `max_endpoints` in the last set
        self.denied = 0  # endpoints the backend-network policy refuses, in the last set
        self._changes: dict[str, int] = {}
        self._hidden = 0
        self._judged: dict[tuple[str, int], str | None] = {}
        self._template: tuple[dict[str, str], BackendConfig, Backend] | None = None
        self._asking: dict[str, asyncio.Task[None]] = {}  # models: auto questions in flight
        self._ask_slots = asyncio.Semaphore(_MODELS_CONCURRENCY)
        self._dirty = False  # an answer came in: the next tick reconciles
        self._log_budget = _LOG_LINES
        self._log_refill = clock()
        self.stale = False
        self.error: str | None = None

    @property
    def backends(self) -> int:
        return len(self._known)

    def event(self, event: str, n: int = 1) -> None:
        for _ in range(n):
            self._metrics.discovery_event(self.kind, event)

    async def update(self, endpoints: Iterable[Endpoint]) -> None:
        """The source's whole current set; duplicates (one address in two slices) merge, ready
        winning."""
        current: dict[str, tuple[str, Endpoint]] = {}
        bad = denied = 0
        seen: dict[tuple[str, int], str | None] = {}
        for ep in endpoints:
            key = (ep.host, ep.port)
            if key in self._judged:
                verdict = self._judged[key]
            else:
                verdict = self._judge(ep)
            seen[key] = verdict
            if verdict is None or verdict == "":
                bad += verdict is None
                denied += verdict == ""
                continue
            name = verdict
            prev = current.get(name)
            if prev is None or (ep.ready and not prev[1].ready):
                current[name] = (endpoint_url(self.cfg.scheme, ep.host, ep.port), ep)
        self._judged = seen  # remembered for the next set: only new endpoints are judged
        if bad:
            self.event("bad_endpoint", bad)
        if denied != self.denied:
            self.warn(
                "network_refused",
                "refusing endpoints outside the allowed backend networks",
                refused=str(denied),
            )
        self.denied = denied
        # The cap: backends already known keep their place, then new ones in the source's order.
        cap = self.cfg.max_endpoints
        if len(current) > cap:
            keep = [n for n in current if n in self._known][:cap]
            keep += [n for n in current if n not in self._known][: cap - len(keep)]
            kept = set(keep)
            refused = [n for n in current if n not in kept]
            current = {n: current[n] for n in current if n in kept}
            if len(refused) != self.refused:
                self.warn(
                    "refused",
                    "more endpoints than max_endpoints; refusing the excess",
                    max_endpoints=str(cap),
                    refused=str(len(refused)),
                )
            self.refused = len(refused)
        else:
            self.refused = 0
        async with self._lock:
            self._current = current
            self.synced()
            await self._reconcile()

    def _judge(self, ep: Endpoint) -> str | None:
        """The endpoint's backend name; None when unusable, "" when the policy refuses it."""
        name = backend_name(self.cfg.names_prefix, ep.host, ep.port)
        if not _valid_name(name) or not 1 <= ep.port <= 65535:
            return None
        # The backend-network policy of the admin API holds for discovered addresses too:
        # a hostile slice must not point the router at the metadata service.
        if self._policy is not None and self._policy.refusal(ep.host) is not None:
            return ""
        return name

    def synced(self) -> None:
        """The source heard from its server (a list, a watch event or bookmark, an answer)."""
        self.last_sync = self._clock()
        self.stale = False
        self.error = None

    def failed(self, event: str, error: str) -> None:
        """A list, watch or lookup failed: keep the last set, say so."""
        if not self.stale:
            log.warning(
                "discovery source unreachable; keeping the last known backends",
                extra={"fields": {"source": self.source_id, "error": error}},
            )
        self.stale = True
        self.error = error
        self.event(event)

    def warn(self, event: str, message: str, **fields: Any) -> None:
        log.warning(message, extra={"fields": {"source": self.source_id, **fields}})
        self.event(event)

    async def tick(self) -> None:
        """Finish what waits on time: vanished backends whose streams ended, models to re-ask."""
        now = self._clock()
        due = any(t <= now for t in self._auto_retry.values())
        if self._gone_since or self._dirty or due:
            self._dirty = False
            async with self._lock:
                await self._reconcile()

    async def _reconcile(self) -> None:
        self._changes = {}
        self._hidden = 0
        await self._reconcile_set()
        if self._changes:
            log.info(
                "discovered backends changed",
                extra={
                    "fields": {
                        "source": self.source_id,
                        **self._changes,
                        "backends": len(self._known),
                        "lines_not_shown": self._hidden,
                    }
                },
            )

    async def _reconcile_set(self) -> None:
        now = self._clock()
        entries: dict[str, Discovered] = {}
        items = list(self._current.items())
        for name in set(self._auto_retry) - set(self._current):
            self._auto_retry.pop(name, None)
        for i, (name, (url, ep)) in enumerate(items):
            if i % 2000 == 1999:
                await asyncio.sleep(0)  # a large set: let requests through between chunks
            models = await self._models(name, url, now)  # never waits: questions run aside
            if models is None:
                continue
            old = self._known.get(name)
            if old is not None and old.config.url == url and old.config.models == models:
                # Known: the same value (or only its drain flag changed), nothing validated again.
                same = old.draining == (not ep.ready)
                entries[name] = old if same else replace(old, draining=not ep.ready)
                if not same:
                    self._changed("draining" if not ep.ready else "ready", name, url)
                continue
            try:
                entries[name] = self._entry(name, url, models, not ep.ready)
            except (ValidationError, ValueError):
                self.event("bad_endpoint")  # skipped and counted; the others still apply
                continue
            if old is None:
                self._changed("added", name, url)
            elif old.draining != entries[name].draining:
                self._changed("draining" if entries[name].draining else "ready", name, url)
        gone = [n for n in self._known if n not in entries]
        counts = await self._in_flight(gone) if gone else {}
        for name in gone:
            since = self._gone_since.setdefault(name, now)
            if counts.get(name, 0) and now - since < self._grace:
                if not self._known[name].draining:
                    self._changed("draining", name, self._known[name].config.url)
                entries[name] = replace(self._known[name], draining=True)
                continue
            self._gone_since.pop(name, None)
            self._auto.pop(name, None)
            self._changed("removed", name, self._known[name].config.url)
        for name in entries:
            if name in self._current:
                self._gone_since.pop(name, None)
        self._known = entries
        self._fleet.set_discovered(self.source_id, entries)

    def _entry(self, name: str, url: str, models: dict[str, str], draining: bool) -> Discovered:
        """A new endpoint's entry, copied from the source's template (checked once): the name
        matched NAME_PATTERN and the URL is an IP literal and a port, so nothing per endpoint
        needs validating again. 50,000 endpoints must apply in well under a second."""
        if self._template is None or self._template[0] is not models:
            cfg = self.cfg.backend_config("template", "http://127.0.0.1:1", models)
            self._template = (models, cfg, Backend.from_config(cfg, self.kind))
        _, tcfg, tb = self._template
        cfg = tcfg.model_copy(update={"name": name, "url": url})
        backend = replace(tb, name=name, url=url, draining=draining)
        return Discovered(cfg, self.kind, draining=draining, backend=backend)

    def _changed(self, event: str, name: str, url: str) -> None:
        # One line per backend, within a budget (`_LOG_LINES` per `_LOG_WINDOW` s); the change
        # set's summary line says the rest: a DNS flap must not flood the logs.
        now = self._clock()
        if now - self._log_refill >= _LOG_WINDOW:
            self._log_budget, self._log_refill = _LOG_LINES, now
        if self._log_budget > 0:
            self._log_budget -= 1
            log.info(
                f"discovered backend {event}",
                extra={"fields": {"source": self.source_id, "backend": name, "url": url}},
            )
        else:
            self._hidden += 1
        self._changes[event] = self._changes.get(event, 0) + 1
        self.event(event)

    async def _models(self, name: str, url: str, now: float) -> dict[str, str] | None:
        """The endpoint's models, or None while unknown. `models: auto` questions run in their
        own tasks, outside the lock, a few at a time per source: a slow endpoint delays only
        itself; its answer is applied on the next tick."""
        if self.cfg.models != "auto":
            return self.cfg.models
        cached = self._auto.get(name)
        if cached is not None and cached[0] == url:
            return cached[1]
        if self._auto_retry.get(name, 0.0) > now or name in self._asking:
            return None
        self._auto_retry.pop(name, None)
        task = asyncio.create_task(self._ask(name, url))
        self._asking[name] = task
        task.add_done_callback(lambda _t: self._forget_question(name))
        return None

    async def _ask(self, name: str, url: str) -> None:
        async with self._ask_slots:
            models = await self._ask_models(name, url)
        if name not in self._current:
            return
        if models is None:
            self._auto_retry[name] = self._clock() + _MODELS_RETRY
            return
        self._auto[name] = (url, models)
        self._dirty = True
        await self.tick()  # in this task, outside any other source's way

    def _forget_question(self, name: str) -> None:
        self._asking.pop(name, None)

    def forget_questions(self) -> None:
        for task in list(self._asking.values()):
            task.cancel()
        self._asking.clear()

    async def _ask_models(self, name: str, url: str) -> dict[str, str] | None:
        # The template's key and headers go with the question, as with every request.
        probe = Backend.from_config(self.cfg.backend_config(name, url, {"probe": "probe"}))
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in probe.auth_headers]
        try:
            # One deadline for the whole answer (a dripping body must not hold for ever) and a
            # size cap (an endless one must not grow memory).
            async with asyncio.timeout(_MODELS_DEADLINE):
                async with self._http.stream(
                    "GET", url + "/v1/models", headers=headers, params=dict(probe.query)
                ) as r:
                    r.raise_for_status()
                    body = bytearray()
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        if len(body) > _MAX_MODELS_BODY:
                            raise ValueError("answer too large")
            ids = [m["id"] for m in json.loads(body)["data"] if m.get("id")]
        except (
            TimeoutError,
            httpx.HTTPError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
        ) as exc:
            self.warn(
                "models_failed",
                "models: auto: the endpoint's /v1/models failed; not routing to it yet",
                backend=name,
                error=type(exc).__name__,
            )
            return None
        good = [m for m in ids if isinstance(m, str) and _MODEL_ID.match(m)][:_MAX_MODELS]
        if len(good) < len(ids):
            self.warn(
                "models_refused",
                "models: auto: refusing model ids that are not plain ids, or past the cap",
                backend=name,
                refused=str(len(ids) - len(good)),
            )
        if not good:
            self.warn("models_failed", "models: auto: the endpoint serves no model", backend=name)
            return None
        return {m: m for m in good}


def _valid_name(name: str) -> bool:
    return re.match(NAME_PATTERN, name) is not None
