"""The backend set: the YAML file's entries plus admin changes, as one immutable snapshot.

A request takes the snapshot once and routes within it, so a change never mutates what a
request in flight is looking at: every change rebuilds the snapshot and swaps it whole.

Admin changes are *records*, one per backend name, kept in a `RecordStore` (in-process here, or
Redis in `router/registry/sync.py`, shared by every replica and worker). The snapshot is always
the file entries with every record applied:

    no record                    the file entry as written
    {"patch": {...}}             the file entry with those fields changed (weight, models, ...)
    {"config": {...}}            an entry registered over the API (wins over a same-named file one)
    {"deleted": true}            the file entry removed; stays removed while the record exists
    any record + "draining"      true: the backend takes no new requests

LoRA adapters (`set_adapters`: adapter -> the public base model, from what engines list in
`/v1/models` and `lora.sources`) route to every backend of their base model (any vLLM backend
when the base is not known): which of those may take a request is the balancer's to judge from
the engine readings (balancers/lora.py). A configured model of the same name wins.

Discovered entries (router/discovery/) are treated like file entries: never stored, but a patch
record applies over them and survives re-lists. Discovery may mark one draining on its own
(a terminating endpoint); either flag drains it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from pydantic import ValidationError

from balancers import Balancer, balancer_class, balancer_type
from router.core.backend import Backend
from router.core.errors import Conflict, Invalid, NotFound
from router.core.settings import BackendConfig, ConfigError, Settings, describe_validation

log = logging.getLogger("sluicegate.registry")

Record = dict[str, Any]
PATCHABLE = ("weight", "models", "max_inflight", "draining")
_RECORD_KEYS = frozenset({"config", "patch", "deleted", "draining"})


@dataclass(frozen=True, slots=True)
class Discovered:
    """A backend a discovery source found: its config, the source kind, and whether the source
    wants it drained (a terminating endpoint, or one that vanished and has streams in flight).

    A source that builds its entries from one checked template passes that template as `base`
    with this entry's `(name, url)` as `own`, and the Backend already built: the entry's own
    config is then made only when something asks for it (an admin patch over it). 50,000
    endpoints must not cost 50,000 config objects to build and for the collector to walk."""

    base: BackendConfig
    source: str
    draining: bool = False
    # Built by the source from a checked template (no per-endpoint validation), or None.
    backend: Backend | None = field(default=None, compare=False)
    own: tuple[str, str] | None = None  # (name, url) over `base`, a template

    @property
    def config(self) -> BackendConfig:
        if self.own is None:
            return self.base
        name, url = self.own
        return self.base.model_copy(update={"name": name, "url": url})

    @property
    def url(self) -> str:
        return self.base.url if self.own is None else self.own[1]


@dataclass(frozen=True, slots=True)
class Change:
    """What an incremental swap changed: backends added or replaced (their new value), and the
    names removed. Consumers that follow the snapshot (health, probes, scrapes) apply just this
    instead of walking the whole fleet: a discovery change touching one slice of a 50,000
    endpoint fleet costs that slice."""

    upserted: tuple[Backend, ...]
    removed: tuple[str, ...]


_NONE_SERVING: Mapping[str, Backend] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Snapshot:
    backends: tuple[Backend, ...]
    by_name: MappingProxyType[str, Backend]
    by_model: MappingProxyType[str, tuple[Backend, ...]]
    version: int = 0
    models: tuple[str, ...] = field(default=())
    # LoRA adapter -> its base model (None: any vLLM backend), for adapters routed by base
    adapters: MappingProxyType[str, str | None] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # model -> its backends by name, made the first time a request asks (`serving`): a swap
    # of a large fleet does not pay for maps of models no request looks into.
    _serving: dict[str, Mapping[str, Backend]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def serving(self, model: str) -> Mapping[str, Backend]:
        """`model`'s backends in this snapshot by name (those of `by_model`, an adapter's by
        its base model): whether a named backend serves it, without a scan."""
        named = self._serving.get(model)
        if named is None:
            backends = self.by_model.get(model)
            if backends is None:
                return _NONE_SERVING
            named = self._serving[model] = MappingProxyType({b.name: b for b in backends})
        return named

    @classmethod
    def build(
        cls,
        backends: Iterable[Backend],
        version: int = 0,
        adapters: Mapping[str, str | None] | None = None,
    ) -> Snapshot:
        items = tuple(backends)
        by_model: dict[str, list[Backend]] = {}
        for b in items:
            for public in b.models:
                by_model.setdefault(public, []).append(b)
        routes = {m: tuple(bs) for m, bs in by_model.items()}
        routed = route_adapters(routes, items, adapters)
        return cls(
            backends=items,
            by_name=MappingProxyType({b.name: b for b in items}),
            by_model=MappingProxyType(routes),
            version=version,
            models=tuple(sorted(routes)),
            adapters=MappingProxyType(routed),
        )


def route_adapters(
    routes: dict[str, tuple[Backend, ...]],
    backends: Sequence[Backend],
    adapters: Mapping[str, str | None] | None,
) -> dict[str, str | None]:
    """Add each adapter to `routes` under its base model's backends (any vLLM backend when the
    base is None; a configured model of that name wins); returns those routed."""
    routed: dict[str, str | None] = {}
    if not adapters:
        return routed
    vllm: tuple[Backend, ...] | None = None
    for name, base in adapters.items():
        if name in routes:
            continue
        if base is None:
            if vllm is None:
                vllm = tuple(b for b in backends if b.kind == "vllm")
            under = vllm
        else:
            under = routes.get(base, ())
        if under:
            routes[name] = under
            routed[name] = base
    return routed


def check_balancers(settings: Settings) -> None:
    """Every balancer the settings name exists (built in or installed as a plugin): else a
    `ConfigError` naming the field, so a typo stops startup instead of the first request."""
    named = [("balancer", settings.balancer)]
    named += [(f"model_balancers.{m}", name) for m, name in settings.model_balancers.items()]
    for where, name in named:
        try:
            balancer_class(name)
        except KeyError as exc:
            origin = f"config file {settings.config}" if settings.config else "settings"
            raise ConfigError(f"{origin}: {where}: {exc.args[0]}") from None


class Registry:
    """Owns the current snapshot and one balancer per model (balancers keep rotation state).

    `swap` builds a snapshot from the whole backend list; `patch` derives one from the current
    snapshot and a change (Python work in the size of the change; the new snapshot's tuples and
    maps are C-level copies). Each new snapshot goes to `on_change` with its `Change` (None
    for a whole swap: its followers take the whole set)."""

    def __init__(
        self,
        backends: Iterable[Backend],
        default_balancer: str,
        model_balancers: dict[str, str] | None = None,
        on_change: Callable[[Snapshot, Change | None], None] | None = None,
    ) -> None:
        self._default = default_balancer
        self._per_model = dict(model_balancers or {})
        for name in {default_balancer, *self._per_model.values()}:
            balancer_class(name)  # fail at startup, not on the first request
        self._balancers: dict[str, Balancer] = {}
        self._on_change = on_change
        self._adapters: dict[str, str | None] = {}
        # model -> {name: backend}, in snapshot order: a patch rebuilds only touched models.
        self._members: dict[str, dict[str, Backend]] = {}
        self.snapshot = Snapshot.build(backends)
        self._index(self.snapshot)
        if on_change:
            on_change(self.snapshot, None)

    def _index(self, snap: Snapshot) -> None:
        adapters = snap.adapters
        self._members = {
            m: {b.name: b for b in bs} for m, bs in snap.by_model.items() if m not in adapters
        }

    def balancer_for(self, model: str) -> Balancer:
        bal = self._balancers.get(model)
        if bal is None:
            bal = self._balancers[model] = balancer_type(
                self._per_model.get(model, self._default)
            )()
        return bal

    def set_adapters(self, adapters: Mapping[str, str | None]) -> None:
        """Route these LoRA adapters by base model from now on (a new snapshot when changed)."""
        if dict(adapters) == self._adapters:
            return
        self._adapters = dict(adapters)
        self.patch((), ())  # the same backends: only the adapter routes are made again

    def swap(self, backends: Iterable[Backend]) -> Snapshot:
        snap = Snapshot.build(backends, self.snapshot.version + 1, self._adapters)
        self.snapshot = snap
        self._index(snap)
        if self._on_change:
            self._on_change(snap, None)
        return snap

    def patch(self, upserted: Sequence[Backend], removed: Iterable[str]) -> Snapshot:
        """The current snapshot with `removed` gone and `upserted` added or replaced (a
        replaced backend keeps its place). Same result as a full `swap` of that set, up to
        the order of backends that came or went."""
        old = self.snapshot
        # mappingproxy.copy() is the dict's own copy (memcpy-like); dict(proxy) goes key by
        # key through the mapping protocol, 5x slower: ~30 ms at 50,000 backends.
        by_name = old.by_name.copy()
        touched: set[str] = set()
        gone: list[str] = []
        for name in removed:
            b = by_name.pop(name, None)
            if b is not None:
                gone.append(name)
                for m in b.models:
                    touched.add(m)
                    self._members[m].pop(name, None)
        for b in upserted:
            prev = by_name.get(b.name)
            if prev is not None:
                for m in prev.models:
                    if m not in b.models:
                        touched.add(m)
                        self._members[m].pop(b.name, None)
            by_name[b.name] = b
            for m in b.models:
                touched.add(m)
                self._members.setdefault(m, {})[b.name] = b
        by_model = old.by_model.copy()
        for name in old.adapters:  # routed again below, over the new base model members
            by_model.pop(name, None)
        for m in touched:
            members = self._members.get(m)
            if members:
                by_model[m] = tuple(members.values())
            else:
                by_model.pop(m, None)
                self._members.pop(m, None)
        backends = tuple(by_name.values())
        routed = route_adapters(by_model, backends, self._adapters)
        models = old.models if by_model.keys() == set(old.models) else tuple(sorted(by_model))
        snap = Snapshot(
            backends=backends,
            by_name=MappingProxyType(by_name),
            by_model=MappingProxyType(by_model),
            version=old.version + 1,
            models=models,
            adapters=MappingProxyType(routed),
        )
        self.snapshot = snap
        if self._on_change is not None:
            self._on_change(snap, Change(tuple(upserted), tuple(gone)))
        return snap


class RecordStore(Protocol):
    """Where admin changes live. `change` is atomic per name across everyone sharing the store."""

    kind: str

    async def load(self) -> dict[str, Record]: ...

    async def change(
        self, name: str, edit: Callable[[Record | None], Record | None]
    ) -> dict[str, Record]:
        """Replace `name`'s record with edit(current) (None removes it; edit may raise);
        return every record afterwards."""
        ...

    async def watch(self, on_records: Callable[[dict[str, Record]], None]) -> None:
        """Call on_records with every record whenever someone else changes them, until
        cancelled or the shared store is lost (raises; the app's runner starts it again). A
        store that is not shared returns at once."""
        ...

    async def aclose(self) -> None: ...


class LocalRecords:
    """In-process records: changes reach neither other replicas nor other workers, nor a restart.

    Records pass through JSON as they would through Redis: nobody shares a nested dict, and a
    record that would not survive storage fails here too."""

    kind = "local"

    def __init__(self) -> None:
        self._records: dict[str, str] = {}

    async def load(self) -> dict[str, Record]:
        return {name: json.loads(raw) for name, raw in self._records.items()}

    async def change(
        self, name: str, edit: Callable[[Record | None], Record | None]
    ) -> dict[str, Record]:
        raw = self._records.get(name)
        new = edit(json.loads(raw) if raw is not None else None)
        if new is None:
            self._records.pop(name, None)
        else:
            self._records[name] = json.dumps(new)
        return await self.load()

    async def watch(self, on_records: Callable[[dict[str, Record]], None]) -> None:
        return None

    async def aclose(self) -> None:
        return None


def config_to_json(cfg: BackendConfig) -> dict[str, Any]:
    """The whole config as JSON, key included: records must rebuild the backend exactly."""
    data = cfg.model_dump(mode="json", exclude_none=True)
    if cfg.api_key is not None:
        data["api_key"] = cfg.api_key.get_secret_value()
    return data


def _validate(data: Mapping[str, Any]) -> BackendConfig:
    try:
        return BackendConfig.model_validate(data)
    except ValidationError as exc:
        raise Invalid(describe_validation(exc)) from None


class Fleet:
    """File entries + records -> the registry's snapshot, and the admin operations on them."""

    def __init__(
        self,
        registry: Registry,
        file_configs: Sequence[BackendConfig],
        store: RecordStore,
        clock: Callable[[], float] = time.monotonic,
        on_invalid: Callable[[str], None] | None = None,
    ) -> None:
        self._on_invalid = on_invalid  # (record name): e.g. a metric
        self.registry = registry
        self.store = store
        self._file = {c.name: c for c in file_configs}
        self._found: dict[str, dict[str, Discovered]] = {}  # discovery source id -> entries
        self._flat: dict[str, Discovered] = {}  # every source's entries merged, built once
        # name -> (the discovered entry, its Backend): an unchanged entry is not built again.
        self._built: dict[str, tuple[Discovered, Backend]] = {}
        self._records: dict[str, Record] = {}
        self._clock = clock
        # The public models file and admin-registered backends serve: `models: auto` endpoints
        # do not take these unless their source says `shadow: true`.
        self.registry_models: frozenset[str] = frozenset()
        self.registry_models_version = 0
        self.apply({}, force=True)

    # -- rebuilding ------------------------------------------------------------------------

    def apply(self, records: Mapping[str, Record], force: bool = False) -> None:
        """Rebuild and swap the snapshot, unless the records are what we already run on."""
        if not force and records == self._records:
            return
        self._records = dict(records)
        snap = self.registry.swap(self._compose())
        fixed = (b for b in snap.backends if b.source in ("file", "api"))
        served = frozenset(m for b in fixed for m in b.models)
        if served != self.registry_models:
            self.registry_models = served
            self.registry_models_version += 1
        if not force:
            log.info(
                "registry changed",
                extra={
                    "fields": {
                        "version": snap.version,
                        "backends": [b.name for b in snap.backends],
                        "draining": [b.name for b in snap.backends if b.draining],
                        "pid": os.getpid(),
                    }
                },
            )

    def set_discovered(self, source_id: str, entries: Mapping[str, Discovered]) -> None:
        """Replace one discovery source's entries; only what differs is applied."""
        found = self._found.get(source_id, {})
        upserts = {n: d for n, d in entries.items() if found.get(n) != d}
        removed = [n for n in found if n not in entries]
        self.change_discovered(source_id, upserts, removed)

    def change_discovered(
        self, source_id: str, upserts: Mapping[str, Discovered], removed: Iterable[str]
    ) -> None:
        """Add or replace some of one source's entries and remove others; the snapshot is
        patched for those names alone (file entries, API registrations and records keep
        winning as in a full rebuild)."""
        found = self._found.setdefault(source_id, {})
        names = list(upserts)
        for name, d in upserts.items():
            found[name] = d
        for name in removed:
            if found.pop(name, None) is not None:
                names.append(name)
        up: list[Backend] = []
        rm: list[str] = []
        sources = list(self._found.values())
        for name in names:
            if name in self._file:
                continue  # a file entry of the same name wins
            winner = None
            for entries in sources:  # the first source to name it wins
                winner = entries.get(name)
                if winner is not None:
                    break
            if winner is None:
                self._flat.pop(name, None)
                self._built.pop(name, None)
            else:
                self._flat[name] = winner
            rec = self._records.get(name)
            if rec is None and winner is not None:
                built = winner.backend
                if built is not None and built.draining == winner.draining:
                    # The common case, as `_build` has it: the source's Backend as it is.
                    self._built.pop(name, None)
                    up.append(built)
                    continue
            if isinstance(rec, dict) and "config" in rec:
                continue  # registered through the API: that entry wins, it is unchanged
            backend = self._one(name, rec)
            if backend is None:
                rm.append(name)
            else:
                up.append(backend)
        if up or rm:
            self.registry.patch(up, rm)

    def _discovered(self) -> dict[str, Discovered]:
        return self._flat

    def _base(self, name: str) -> Discovered | None:
        """The file or discovered entry a patch record applies over."""
        cfg = self._file.get(name)
        if cfg is not None:
            return Discovered(cfg, "file")
        return self._discovered().get(name)

    def _compose(self) -> list[Backend]:
        out: list[Backend] = []
        api = {n for n, r in self._records.items() if isinstance(r, dict) and "config" in r}
        found = self._discovered()
        names = [
            *(n for n in self._file if n not in api),
            *(n for n in found if n not in api),
            *sorted(api),
            *sorted(
                n for n in self._records if n not in api and n not in self._file and n not in found
            ),
        ]
        for name in names:
            backend = self._one(name, self._records.get(name))
            if backend is not None:
                out.append(backend)
        return out

    def _one(self, name: str, rec: Record | None) -> Backend | None:
        try:
            return self._build(name, rec)
        except (ValidationError, ValueError, TypeError) as exc:
            # One bad record (written by an older version, or by hand) must not take the
            # others, or this replica, down with it: skip it, loudly.
            problem = describe_validation(exc) if isinstance(exc, ValidationError) else str(exc)
            log.error(
                "skipping an invalid registry record",
                extra={"fields": {"name": name, "problem": problem}},
            )
            if self._on_invalid is not None:
                self._on_invalid(name)
            base = self._base(name)
            if base is None:
                return None
            # The file (or discovered) entry as written.
            return Backend.from_config(base.config, base.source, base.draining)

    def _build(self, name: str, rec: Record | None) -> Backend | None:
        """The backend `rec` makes of `name` (None: it is removed); raises when invalid."""
        base = self._base(name)
        if rec is None:
            if base is None:
                return None
            if base.source == "file":
                return Backend.from_config(base.config, base.source, base.draining)
            if base.backend is not None and base.backend.draining == base.draining:
                self._built.pop(name, None)
                return base.backend  # built by the source: nothing to build, or to keep here
            built = self._built.get(name)
            if built is None or built[0] is not base:
                backend = base.backend or Backend.from_config(
                    base.config, base.source, base.draining
                )
                if backend.draining != base.draining:  # the entry was copied with a new flag
                    backend = dataclasses.replace(backend, draining=base.draining)
                built = (base, backend)
                self._built[name] = built
            return built[1]
        if (
            not isinstance(rec, dict)
            or not rec.keys() <= _RECORD_KEYS
            or not isinstance(rec.get("draining", False), bool)
        ):
            raise ValueError("record: not a registry record")
        draining = bool(rec.get("draining"))
        if "config" in rec:
            if not isinstance(rec["config"], dict):
                raise ValueError("config: must be an object")
            cfg = BackendConfig.model_validate(rec["config"])
            if cfg.name != name:
                raise ValueError("name: differs from the record's name")
            if cfg.api_key_env and cfg.resolved_key() is None:
                log.warning(
                    "backend key variable not set here; sending no key",
                    extra={"fields": {"name": name, "api_key_env": cfg.api_key_env}},
                )
            return Backend.from_config(cfg, "api", draining)
        if base is None or rec.get("deleted"):
            return None
        patch = rec.get("patch") or {}
        if not isinstance(patch, dict):
            raise ValueError("patch: must be an object")
        patched = self._patched(name, base.config, patch)
        return Backend.from_config(patched, base.source, draining or base.draining)

    def _patched(self, name: str, cfg: BackendConfig, patch: Mapping[str, Any]) -> BackendConfig:
        if not patch:
            return cfg
        try:
            return BackendConfig.model_validate({**config_to_json(cfg), **patch})
        except ValidationError:
            # The file changed under a stored patch so they no longer fit: the file wins.
            log.error(
                "stored patch no longer fits the file entry", extra={"fields": {"name": name}}
            )
            if self._on_invalid is not None:
                self._on_invalid(name)
            return cfg

    def _live(self, name: str, rec: Record | None) -> bool:
        if rec is None:
            return self._base(name) is not None
        if "config" in rec:
            return True
        return not rec.get("deleted") and self._base(name) is not None

    async def _change(self, name: str, edit: Callable[[Record | None], Record | None]) -> None:
        def checked(cur: Record | None) -> Record | None:
            new = edit(cur)
            # Build what the new record makes before it is stored: what cannot be built is
            # refused here (400), never stored to break every replica that reads it.
            try:
                self._build(name, new)
            except ValidationError as exc:
                raise Invalid(describe_validation(exc)) from None
            except (ValueError, TypeError) as exc:
                raise Invalid(str(exc)) from None
            return new

        self.apply(await self.store.change(name, checked))

    # -- admin operations ------------------------------------------------------------------

    async def register(self, cfg: BackendConfig) -> Backend:
        def edit(cur: Record | None) -> Record:
            if self._live(cfg.name, cur):
                raise Conflict(f"A backend named `{cfg.name}` already exists.")
            return {"config": config_to_json(cfg)}

        await self._change(cfg.name, edit)
        return self.registry.snapshot.by_name[cfg.name]

    async def update(self, name: str, changes: Mapping[str, Any]) -> Backend:
        for key in changes:
            if key not in PATCHABLE:
                raise Invalid(f"{key}: cannot be changed; PATCH takes {', '.join(PATCHABLE)}")
        draining = changes.get("draining")
        if "draining" in changes and not isinstance(draining, bool):
            raise Invalid("draining: must be true or false")
        fields = {k: v for k, v in changes.items() if k != "draining"}

        def edit(cur: Record | None) -> Record:
            if not self._live(name, cur):
                raise NotFound(f"No backend named `{name}`.")
            rec = dict(cur or {})
            if "config" in rec:
                rec["config"] = config_to_json(_validate({**rec["config"], **fields}))
            elif fields:
                patch = {**(rec.get("patch") or {}), **fields}
                base = self._base(name)
                assert base is not None  # _live said so
                merged = _validate({**config_to_json(base.config), **patch})
                # Store normalised values (a models list becomes its map) for every replica.
                rec["patch"] = {k: config_to_json(merged).get(k) for k in patch}
            if "draining" in changes:
                rec["draining"] = draining
            return rec

        await self._change(name, edit)
        return self.registry.snapshot.by_name[name]

    async def remove(
        self, name: str, in_flight: Callable[[], Awaitable[int]], grace: float
    ) -> dict[str, Any]:
        """Drain (no new requests anywhere), wait up to `grace` for streams in flight, remove.

        Streams still running after `grace` are not cut: their pool is closed once they end."""
        if name in self.registry.snapshot.by_name:
            await self.update(name, {"draining": True})
        # else nothing routes to it (e.g. its stored record is invalid): remove it at once.
        deadline = self._clock() + grace
        left = await in_flight()
        while left and self._clock() < deadline:
            await asyncio.sleep(0.05)
            left = await in_flight()

        def edit(cur: Record | None) -> Record | None:
            if not self._live(name, cur):
                raise NotFound(f"No backend named `{name}`.")
            return {"deleted": True} if self._base(name) is not None else None

        await self._change(name, edit)
        return {"name": name, "deleted": True, "in_flight_at_removal": left}
