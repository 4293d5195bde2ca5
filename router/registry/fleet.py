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

from balancers import Balancer, balancer_class
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
    wants it drained (a terminating endpoint, or one that vanished and has streams in flight)."""

    config: BackendConfig
    source: str
    draining: bool = False
    # Built by the source from a checked template (no per-endpoint validation), or None.
    backend: Backend | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class Snapshot:
    backends: tuple[Backend, ...]
    by_name: MappingProxyType[str, Backend]
    by_model: MappingProxyType[str, tuple[Backend, ...]]
    version: int = 0
    models: tuple[str, ...] = field(default=())

    @classmethod
    def build(cls, backends: Iterable[Backend], version: int = 0) -> Snapshot:
        items = tuple(backends)
        by_model: dict[str, list[Backend]] = {}
        for b in items:
            for public in b.models:
                by_model.setdefault(public, []).append(b)
        return cls(
            backends=items,
            by_name=MappingProxyType({b.name: b for b in items}),
            by_model=MappingProxyType({m: tuple(bs) for m, bs in by_model.items()}),
            version=version,
            models=tuple(sorted(by_model)),
        )


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
    """Owns the current snapshot and one balancer per model (balancers keep rotation state)."""

    def __init__(
        self,
        backends: Iterable[Backend],
        default_balancer: str,
        model_balancers: dict[str, str] | None = None,
        on_swap: Callable[[Snapshot], None] | None = None,
    ) -> None:
        self._default = default_balancer
        self._per_model = dict(model_balancers or {})
        for name in {default_balancer, *self._per_model.values()}:
            balancer_class(name)  # fail at startup, not on the first request
        self._balancers: dict[str, Balancer] = {}
        self._on_swap = on_swap
        self.snapshot = Snapshot.build(backends)
        if on_swap:
            on_swap(self.snapshot)

    def balancer_for(self, model: str) -> Balancer:
        bal = self._balancers.get(model)
        if bal is None:
            bal = self._balancers[model] = balancer_class(
                self._per_model.get(model, self._default)
            )()
        return bal

    def swap(self, backends: Iterable[Backend]) -> Snapshot:
        snap = Snapshot.build(backends, self.snapshot.version + 1)
        self.snapshot = snap
        if self._on_swap:
            self._on_swap(snap)
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
        """Call on_records with every record whenever someone else changes them; runs until
        cancelled."""
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
        self.apply({}, force=True)

    # -- rebuilding ------------------------------------------------------------------------

    def apply(self, records: Mapping[str, Record], force: bool = False) -> None:
        """Rebuild and swap the snapshot, unless the records are what we already run on."""
        if not force and records == self._records:
            return
        self._records = dict(records)
        snap = self.registry.swap(self._compose())
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
        """Replace one discovery source's entries and swap the snapshot if anything changed."""
        if self._found.get(source_id) == entries:
            return
        self._found[source_id] = dict(entries)
        # Merged once per change, never once per name: the rebuild stays linear in the fleet.
        out: dict[str, Discovered] = {}
        for found in self._found.values():
            for name, d in found.items():
                if name not in self._file:  # a file entry of the same name wins
                    out.setdefault(name, d)
        self._flat = out
        self._built = {n: b for n, b in self._built.items() if n in out}
        self.apply(self._records, force=True)

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
            try:
                backend = self._build(name, self._records.get(name))
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
                    continue
                # The file (or discovered) entry as written.
                backend = Backend.from_config(base.config, base.source, base.draining)
            if backend is not None:
                out.append(backend)
        return out

    def _build(self, name: str, rec: Record | None) -> Backend | None:
        """The backend `rec` makes of `name` (None: it is removed); raises when invalid."""
        base = self._base(name)
        if rec is None:
            if base is None:
                return None
            if base.source == "file":
                return Backend.from_config(base.config, base.source, base.draining)
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
