"""Which LoRA adapters this process has requests in flight for, per engine: exact and instant.

The engine's own `vllm:lora_requests_info` arrives a scrape late and, on vLLM 0.32, cannot tell
a running adapter from one that only waits; what the router itself sent is neither. The proxy
calls `start()` when an adapter request is dispatched and `end()` in its `finally` (also on
cancel and error), so nothing stays counted; the balancer reads `on()`'s frozen sets as data
(balancers/lora.py). Bounded by the requests in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

EMPTY: Mapping[str, frozenset[str]] = MappingProxyType({})


class AdapterFlights:
    def __init__(self) -> None:
        self._counts: dict[str, dict[str, int]] = {}  # backend -> adapter -> requests
        self._view: Mapping[str, frozenset[str]] = EMPTY

    def on(self) -> Mapping[str, frozenset[str]]:
        """backend -> adapters with requests in flight there (a snapshot: never changes)."""
        return self._view

    def start(self, backend: str, adapter: str) -> None:
        there = self._counts.setdefault(backend, {})
        n = there.get(adapter, 0)
        there[adapter] = n + 1
        if n == 0:
            self._publish(backend)

    def end(self, backend: str, adapter: str) -> None:
        there = self._counts.get(backend)
        if there is None or adapter not in there:
            return
        there[adapter] -= 1
        if there[adapter] <= 0:
            del there[adapter]
            if not there:
                del self._counts[backend]
            self._publish(backend)

    def _publish(self, backend: str) -> None:
        view = dict(self._view)
        adapters = self._counts.get(backend)
        if adapters:
            view[backend] = frozenset(adapters)
        else:
            view.pop(backend, None)
        self._view = MappingProxyType(view)
