"""Turns a source's current endpoint set into discovered backends in the Fleet.

A source reports its whole current set (`update`) or a failure (`failed`); this module owns what
that means for routing:

    ready endpoint                  routable backend (`source: kubernetes|inferencepool|dns`)
    serving + terminating endpoint  draining: no new requests, streams in flight finish
    endpoint gone from the set      draining until its in-flight count is 0 (or `grace` passed),
                                    then removed
    a failed list/lookup            the last set stays; the source is marked stale

`models: auto` asks each new endpoint's `GET /v1/models`; an endpoint whose answer fails is
left out (warned and counted) and asked again a little later. Its LoRA adapters (entries whose
`parent` is a listed model) are not taken as models: the engine scraper learns them and keeps
them current (router/engine/adapters.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlencode

import httpx
from pydantic import ValidationError

from router.core.backend import Backend
from router.core.netpolicy import NetPolicy
from router.core.settings import (
    NAME_PATTERN,
    BackendConfig,
    DnsDiscovery,
    InferencePoolDiscovery,
    KubernetesDiscovery,
)
from router.engine.adapters import base_models
from router.registry.fleet import Discovered, Fleet
from router.upstream.pools import ask, join_url

log = logging.getLogger("sluicegate.discovery")

SourceConfig = KubernetesDiscovery | InferencePoolDiscovery | DnsDiscovery
InFlight = Callable[[Sequence[str]], Awaitable[dict[str, int]]]

_MODELS_RETRY = 2.0  # seconds before asking a failing endpoint's /v1/models again
_MAX_NAME = 63
_LOG_LINES = 20  # per-backend change lines per window; the rest only in the summary line
_LOG_WINDOW = 10.0
_MAX_MODELS = 64  # ids one endpoint may claim (models: auto)
_MAX_MODELS_BODY = 1024 * 1024
_MODELS_CONCURRENCY = 8  # models: auto questions in flight per source
_MODELS_DEADLINE = 5.0  # seconds for the whole /v1/models answer, body included
_CHUNK = 250  # names handled between yields to the loop (a few ms of work)
# Changed names per snapshot published. Each publication copies the fleet-sized maps once (C
# copies, ~1-2 ms at 50,000) and hands the change to health, probes, scrapes and KV events
# (~10 µs a name): a few hundred publications for one large fill cost more than the fill.
_PUBLISH = 1000
_MODEL_ID = re.compile(r"^[\x21-\x7e]{1,256}$")  # visible ASCII, no space or control chars


class DiscoveryMetrics(Protocol):
    def discovery_event(self, source: str, event: str, n: int = 1) -> None: ...


class Endpoint(NamedTuple):
    host: str
    port: int
    ready: bool  # False: serving but terminating (drain)
    # prefill | decode | both, from the source (its role label); None: the template's.
    role: str | None = None


# What the reconciler keeps per name: (url, ready, role). A plain tuple of plain values, which the
# collector stops tracking (it does not untrack a NamedTuple, nor a tuple holding one), so
# 50,000 endpoints add nothing to a full collection's walk.
Wanted = tuple[str, bool, str | None]


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
        self._clock = clock
        self._lock = asyncio.Lock()
        # group (an EndpointSlice, a pod; "" for DNS) -> name -> (url, endpoint)
        self._groups: dict[str, dict[str, Wanted]] = {}
        self._owners: dict[str, tuple[str, ...]] = {}  # name -> the groups holding it
        self._denied_by: dict[str, int] = {}  # group -> endpoints the network policy refused
        self._current: dict[str, Wanted] = {}  # admitted (within the cap)
        self._waiting: dict[str, Wanted] = {}  # over the cap, in order
        self._todo: set[str] = set()  # names whose wanted state changed since the last pass
        self._known: dict[str, Discovered] = {}
        self._gone_since: dict[str, float] = {}
        self._auto: dict[str, tuple[str, dict[str, str]]] = {}  # name -> (url, models)
        self._auto_retry: dict[str, float] = {}
        self.last_sync: float | None = None
        self.refused = 0  # endpoints over `max_endpoints` in the last set
        self.denied = 0  # endpoints the backend-network policy refuses, in the last set
        self._changes: dict[str, int] = {}
        self._hidden = 0
        self._judged: dict[tuple[str, int], str | None] = {}  # (host, port) -> _judge()
        # role label (None: the template's own) -> (models, template config, its Backend)
        self._templates: dict[str | None, tuple[dict[str, str], BackendConfig, Backend]] = {}
        self._asking: dict[str, asyncio.Task[None]] = {}  # models: auto questions in flight
        self._shadowed: dict[str, frozenset[str]] = {}  # name -> models refused as shadowing
        self._shadow_version = fleet.registry_models_version
        self._ask_slots = asyncio.Semaphore(_MODELS_CONCURRENCY)
        self._log_budget = _LOG_LINES
        self._log_refill = clock()
        self.stale = False
        self.error: str | None = None

    @property
    def backends(self) -> int:
        return len(self._known)

    def event(self, event: str, n: int = 1) -> None:
        self._metrics.discovery_event(self.kind, event, n)

    async def update(self, endpoints: Iterable[Endpoint]) -> None:
        """The source's whole current set (DNS); duplicates merge, ready winning."""
        await self.replace({"": endpoints})

    async def replace(self, groups: Mapping[str, Iterable[Endpoint]]) -> None:
        """The source's whole current set, by group (a Kubernetes re-list: one group per
        EndpointSlice); groups not named are gone. Each group is compared with what it held, so
        a re-list that changes one slice applies that slice; the walk yields to the loop
        between groups (a 50,000 endpoint re-list must not stall requests)."""
        async with self._lock:
            names: set[str] = set()
            walked = 0
            for group in [g for g in self._groups if g not in groups]:
                names |= self._set_group(group, ())
            for group, endpoints in groups.items():
                eps = list(endpoints)
                names |= self._set_group(group, eps)
                walked += len(eps)
                if walked >= _CHUNK:
                    walked = 0
                    await asyncio.sleep(0)
            await self._merge(names)
            self.synced()
            await self._reconcile()

    async def update_group(self, group: str, endpoints: Iterable[Endpoint] | None) -> None:
        """One group's new endpoints (None: the group is gone); only its names are touched."""
        async with self._lock:
            await self._merge(self._set_group(group, endpoints or ()))
            self.synced()
            await self._reconcile()

    def _set_group(self, group: str, endpoints: Iterable[Endpoint]) -> set[str]:
        """Replace one group's endpoints; the names whose entry in it changed."""
        old = self._groups.get(group, {})
        new: dict[str, Wanted] = {}
        bad = denied = 0
        if len(self._judged) > 4 * self.cfg.max_endpoints + 10_000:
            self._judged.clear()  # a bound on what churn can leave here
        for ep in endpoints:
            key = (ep.host, ep.port)
            if key in self._judged:
                verdict = self._judged[key]
            else:
                verdict = self._judged[key] = self._judge(ep)
            if verdict is None:
                bad += 1
                continue
            if verdict == "":
                denied += 1
                continue
            prev = new.get(verdict)
            if prev is None or (ep.ready and not prev[1]):
                new[verdict] = (
                    endpoint_url(self.cfg.scheme, ep.host, ep.port),
                    bool(ep.ready),
                    ep.role,
                )
        if bad:
            self.event("bad_endpoint", bad)
        if new:
            self._groups[group] = new
        else:
            self._groups.pop(group, None)
        if denied:
            self._denied_by[group] = denied
        else:
            self._denied_by.pop(group, None)
        changed = {n for n, v in new.items() if old.get(n) != v}
        # Tuples of names: untracked by the collector, unlike a list per name.
        for n in new:
            if n not in old:
                self._owners[n] = (*self._owners.get(n, ()), group)
        for n in old:
            if n not in new:
                changed.add(n)
                owners = tuple(g for g in self._owners.get(n, ()) if g != group)
                if owners:
                    self._owners[n] = owners
                else:
                    self._owners.pop(n, None)
        denied_total = sum(self._denied_by.values())
        if denied_total != self.denied and denied_total:
            self.warn(
                "network_refused",
                "refusing endpoints outside the allowed backend networks",
                refused=str(denied_total),
            )
        self.denied = denied_total
        return changed

    async def _merge(self, names: Iterable[str]) -> None:
        """The merged view (an address in two groups: ready wins) and the `max_endpoints` cap
        for `names`: backends already admitted keep their place, the excess waits in the
        source's order and is admitted as room frees up."""
        cap = self.cfg.max_endpoints
        for i, n in enumerate(names):
            if i % _CHUNK == _CHUNK - 1:
                await asyncio.sleep(0)
            best: Wanted | None = None
            for g in self._owners.get(n, ()):
                cand = self._groups[g][n]
                if best is None or (cand[1] and not best[1]):
                    best = cand
            if best is None:
                self._waiting.pop(n, None)
                if self._current.pop(n, None) is not None:
                    self._todo.add(n)
            elif n in self._current:
                if self._current[n] != best:
                    self._current[n] = best
                    self._todo.add(n)
            elif len(self._current) < cap:
                self._waiting.pop(n, None)
                self._current[n] = best
                self._todo.add(n)
            else:
                self._waiting[n] = best
        while self._waiting and len(self._current) < cap:
            n = next(iter(self._waiting))
            self._current[n] = self._waiting.pop(n)
            self._todo.add(n)
        if len(self._waiting) != self.refused and self._waiting:
            self.warn(
                "refused",
                "more endpoints than max_endpoints; refusing the excess",
                max_endpoints=str(cap),
                refused=str(len(self._waiting)),
            )
        self.refused = len(self._waiting)

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
        """Finish what waits on time: vanished backends whose streams ended, models to re-ask,
        answers that came in."""
        now = self._clock()
        due = any(t <= now for t in self._auto_retry.values())
        if self._shadow_version != self._fleet.registry_models_version:
            # The file or admin backends serve other models now: every claim is judged again.
            self._shadow_version = self._fleet.registry_models_version
            self._todo.update(self._auto)
        if self._gone_since or self._todo or due:
            async with self._lock:
                await self._reconcile()

    async def _reconcile(self) -> None:
        self._changes = {}
        self._hidden = 0
        try:
            await self._reconcile_names()
        finally:
            for event, n in self._changes.items():  # counted once per change set, not per name
                self.event(event, n)
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

    async def _reconcile_names(self) -> None:
        """Bring the Fleet in line with `_current` for the names that changed (`_todo`), the
        vanished ones still draining and the models answers due: work in the size of the
        change, not of the fleet. The work yields to the loop every `_CHUNK` names; the Fleet
        is patched every `_PUBLISH` changed names (and once at the end)."""
        now = self._clock()
        todo, self._todo = self._todo, set()
        for name, t in list(self._auto_retry.items()):
            if name not in self._current:
                del self._auto_retry[name]
            elif t <= now:
                todo.add(name)
        todo |= self._gone_since.keys()
        upserts: dict[str, Discovered] = {}
        gone: list[str] = []
        for i, name in enumerate(todo):
            if i % _CHUNK == _CHUNK - 1:
                if len(upserts) >= _PUBLISH:
                    self._apply(upserts, ())
                    upserts = {}
                await asyncio.sleep(0)  # a large change: let requests through between chunks
            cur = self._current.get(name)
            models = None if cur is None else self._models(name, cur[0], now)
            if cur is None or models is None:  # models unknown yet: not routed to
                if name in self._known:
                    gone.append(name)
                continue
            url, ready, role = cur
            self._gone_since.pop(name, None)
            old = self._known.get(name)
            if (
                old is not None
                and old.url == url
                and old.base.models == models
                and (role is None or old.base.role == role)
            ):
                # Known: the same value (or only its drain flag changed), nothing validated again.
                if old.draining != (not ready):
                    upserts[name] = replace(old, draining=not ready)
                    self._changed("draining" if not ready else "ready", name, url)
                continue
            try:
                entry = self._entry(name, url, models, not ready, role)
            except (ValidationError, ValueError):
                self.event("bad_endpoint")  # skipped and counted; the others still apply
                continue
            upserts[name] = entry
            if old is None:
                self._changed("added", name, url)
            elif old.draining != entry.draining:
                self._changed("draining" if entry.draining else "ready", name, url)
        counts = await self._in_flight(gone) if gone else {}
        removed: list[str] = []
        for name in gone:
            since = self._gone_since.setdefault(name, now)
            known = self._known[name]
            if counts.get(name, 0) and now - since < self._grace:
                if not known.draining:
                    self._changed("draining", name, known.url)
                    upserts[name] = replace(known, draining=True)
                continue
            self._gone_since.pop(name, None)
            self._auto.pop(name, None)
            self._shadowed.pop(name, None)
            self._changed("removed", name, known.url)
            removed.append(name)
            if len(removed) + len(upserts) >= _PUBLISH:
                self._apply(upserts, removed)
                upserts, removed = {}, []
                await asyncio.sleep(0)
        self._apply(upserts, removed)

    def _apply(self, upserts: dict[str, Discovered], removed: Sequence[str]) -> None:
        if not upserts and not removed:
            return
        self._known.update(upserts)
        for name in removed:
            self._known.pop(name, None)
        self._fleet.change_discovered(self.source_id, upserts, removed)

    def _entry(
        self, name: str, url: str, models: dict[str, str], draining: bool, role: str | None = None
    ) -> Discovered:
        """A new endpoint's entry, copied from the source's template (checked once; one per
        role its endpoints' role label names): the name matched NAME_PATTERN and the URL is an
        IP literal and a port, so nothing per endpoint needs validating again. 50,000 endpoints
        must apply in well under a second."""
        held = self._templates.get(role)
        if held is None or held[0] is not models:
            cfg = self.cfg.backend_config("template", "http://127.0.0.1:1", models)
            if role is not None and role != cfg.role:
                cfg = cfg.model_copy(update={"role": role})
            held = self._templates[role] = (models, cfg, Backend.from_config(cfg, self.kind))
        _, tcfg, tb = held
        backend = _copied(tb, name=name, url=url, draining=draining)
        return Discovered(tcfg, self.kind, draining=draining, backend=backend, own=(name, url))

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

    def _models(self, name: str, url: str, now: float) -> dict[str, str] | None:
        """The endpoint's models, or None while unknown. `models: auto` questions run in their
        own tasks, outside the lock, a few at a time per source: a slow endpoint delays only
        itself; its answer is applied on the next tick."""
        if self.cfg.models != "auto":
            return self.cfg.models
        cached = self._auto.get(name)
        if cached is not None and cached[0] == url:
            return self._unshadowed(name, cached[1])
        if self._auto_retry.get(name, 0.0) > now or name in self._asking:
            return None
        self._auto_retry.pop(name, None)
        task = asyncio.create_task(self._ask(name, url))
        self._asking[name] = task
        task.add_done_callback(lambda _t: self._forget_question(name))
        return None

    def _unshadowed(self, name: str, models: dict[str, str]) -> dict[str, str] | None:
        """The claimed models less those a file or admin backend serves (unless `shadow`);
        None when nothing is left. A change of what is refused is logged and counted once."""
        served = self._fleet.registry_models
        if self.cfg.shadow or not served:
            kept, taken = models, frozenset[str]()
        else:
            kept = {m: t for m, t in models.items() if m not in served}
            taken = frozenset(m for m in models if m in served)
        if self._shadowed.get(name, frozenset()) != taken:
            if taken:
                self.warn(
                    "models_shadowing",
                    "models: auto: refusing models that file or admin backends serve "
                    "(set shadow: true to allow)",
                    backend=name,
                    models=",".join(sorted(taken)[:10]),
                )
                self._shadowed[name] = taken
            else:
                self._shadowed.pop(name, None)
        return kept or None

    async def _ask(self, name: str, url: str) -> None:
        async with self._ask_slots:
            models = await self._ask_models(name, url)
        if name not in self._current:
            return
        if models is None:
            self._auto_retry[name] = self._clock() + _MODELS_RETRY
            return
        self._auto[name] = (url, models)
        self._todo.add(name)
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
        # Through a transport made as its traffic's: the template's TLS policy and the
        # network policy, as its traffic, probes and scrapes will have.
        target = join_url(
            httpx.URL(url + "/"), urlencode(probe.query).encode("ascii"), "/v1/models"
        )
        try:
            # One deadline for the whole answer (a dripping body must not hold for ever) and a
            # size cap (an endless one must not grow memory).
            async with asyncio.timeout(_MODELS_DEADLINE):
                status, body = await ask(probe, target, _MAX_MODELS_BODY, self._policy)
            if not 200 <= status < 300:
                raise ValueError(f"status {status}")
            # LoRA adapters (`parent` a listed model) route by their base model instead
            # (router/engine/adapters.py): the engine scraper reads them as they come and go.
            ids = [m["id"] for m in base_models(json.loads(body)["data"]) if m.get("id")]
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
        valid = [m for m in ids if isinstance(m, str) and _MODEL_ID.match(m)]
        allowed = [m for m in valid if self.cfg.model_allowed(m)]
        good = allowed[:_MAX_MODELS]
        if len(allowed) < len(valid):
            self.warn(
                "models_not_allowed",
                "models: auto: refusing model ids outside models_allow",
                backend=name,
                refused=str(len(valid) - len(allowed)),
            )
        if len(valid) < len(ids) or len(good) < len(allowed):
            self.warn(
                "models_refused",
                "models: auto: refusing model ids that are not plain ids, or past the cap",
                backend=name,
                refused=str(len(ids) - len(valid) + len(allowed) - len(good)),
            )
        if not good:
            self.warn("models_failed", "models: auto: the endpoint serves no model", backend=name)
            return None
        return {m: m for m in good}


_BACKEND_FIELDS = tuple(f.name for f in fields(Backend))
_NAME_AT, _URL_AT, _DRAINING_AT = (_BACKEND_FIELDS.index(f) for f in ("name", "url", "draining"))


def _copied(tb: Backend, *, name: str, url: str, draining: bool) -> Backend:
    """`dataclasses.replace` without its per-field checks and keyword call (a quarter of a
    large apply's time): the template was validated once, only these values differ."""
    values = [getattr(tb, f) for f in _BACKEND_FIELDS]
    values[_NAME_AT], values[_URL_AT], values[_DRAINING_AT] = name, url, draining
    return Backend(*values)


_NAME = re.compile(NAME_PATTERN)


def _valid_name(name: str) -> bool:
    return _NAME.match(name) is not None
