"""Cache-aware routing's part of a request: hash the prompt once, bind the balancer to what the
prefix index knows for this attempt's candidates, record the dispatch.

Only balancers offering `with_prefix()` (`cache_aware`) pay for it: ~0.15 ms CPU for a
32k-character prompt (hash, lookup and update, bench/prefix.py). The index is per process
(`balancers/prefix_index.py`); each backend's share of it is bounded by its engine's KV capacity
(`vllm:cache_config_info` through the engine readings) or `affinity.capacity_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from balancers.base import Balancer
from balancers.cache_aware import CHARS_PER_TOKEN, PrefixMatch
from balancers.inflight.base import Readings
from balancers.prefix_index import PrefixIndex
from router.core.backend import Backend
from router.core.settings import AffinityConfig
from router.request.prefix import prefix_hashes


@runtime_checkable
class PrefixAware(Protocol):
    def with_prefix(self, match: PrefixMatch, load_factor: float) -> Balancer: ...


class Affinity:
    def __init__(self, config: AffinityConfig, index: PrefixIndex | None = None) -> None:
        self.config = config
        self.index = index or PrefixIndex()

    def hashes(self, balancer: Balancer, payload: dict[str, Any]) -> list[bytes] | None:
        """The request's prefix chain when `balancer` routes on it (None: it does not)."""
        if not isinstance(balancer, PrefixAware):
            return None
        cfg = self.config
        return prefix_hashes(payload, cfg.block_chars, cfg.max_prefix_chars)

    def bind(
        self, balancer: Balancer, hashes: list[bytes], eligible: Sequence[Backend]
    ) -> Balancer:
        """This attempt's picker: `balancer` with the index's view of the eligible backends."""
        if not hashes or not isinstance(balancer, PrefixAware):
            return balancer
        held = self.index.match(hashes, [b.name for b in eligible])
        match = PrefixMatch(len(hashes), self.config.block_chars, held)
        return balancer.with_prefix(match, self.config.load_factor)

    def dispatched(self, hashes: list[bytes], backend: str, readings: Readings | None) -> None:
        """`backend` was sent this prompt: from now on it holds the prefix."""
        reading = readings.get(backend) if readings else None
        capacity = (
            reading.kv_capacity_tokens
            if reading is not None and reading.kv_capacity_tokens
            else self.config.capacity_tokens
        )
        block_tokens = max(1, self.config.block_chars // CHARS_PER_TOKEN)
        self.index.record(hashes, backend, capacity // block_tokens)
