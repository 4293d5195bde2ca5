"""A declared model's demand as the scaler and the metrics read it: this process's own.

`LocalDemand` follows the process's `Holding` (router/request/admit/holding.py): `total(model)` is
its requests held plus in flight, and every change is passed on at once to the listeners (the
KEDA scaler's streams). With Redis, `SharedDemand` (demand_shared.py) sums every replica's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from router.request.admit.holding import Holding

Listener = Callable[[str], None]


class DemandBook(Protocol):
    """What the scaler and /metrics read; `follow` is told the process's holding once."""

    def follow(self, holding: Holding) -> None: ...
    def listen(self, listener: Listener) -> None: ...
    def declared(self, model: str) -> bool: ...
    def total(self, model: str) -> int: ...
    def held(self) -> dict[str, int]: ...
    def totals(self) -> dict[str, int]: ...
    async def start(self) -> None: ...
    async def aclose(self) -> None: ...


class LocalDemand:
    def __init__(self) -> None:
        self._holding: Holding | None = None
        self._listeners: list[Listener] = []

    def follow(self, holding: Holding) -> None:
        self._holding = holding
        holding.listen(self._changed)

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _changed(self, model: str) -> None:
        for listener in self._listeners:
            listener(model)

    def declared(self, model: str) -> bool:
        return self._holding is not None and model in self._holding.models

    def mine(self, model: str) -> int:
        """This process's part of `model`'s demand."""
        if self._holding is None:
            return 0
        return self._holding.demand(model) or 0

    def total(self, model: str) -> int:
        return self.mine(model)

    def held(self) -> dict[str, int]:
        h = self._holding
        return {m: d.held for m, d in h.models.items()} if h is not None else {}

    def totals(self) -> dict[str, int]:
        h = self._holding
        return {m: self.total(m) for m in h.models} if h is not None else {}

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None
