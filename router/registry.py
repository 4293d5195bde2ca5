"""The backend set: an immutable snapshot swapped whole when the set changes.

A request takes the snapshot once and routes within it, so a change never mutates what a
request in flight is looking at.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

from balancers import Balancer, balancer_class
from router.upstreams import Backend


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
