"""Which backends recently served which prompt prefix: the per-process index `cache_aware` reads.

It maps a block hash (router/request/placement/prefix.py: hash i covers blocks 0..i) to the backends
that were last sent a prompt containing that block. Each backend's blocks form an LRU bounded by
what its engine can keep (`record(..., max_blocks)`: its KV capacity in blocks), so the index
forgets roughly when the engine does. A prompt's blocks are touched tail first, so a backend's
oldest entries are prompt tails and a prefix stays matchable longest (vLLM evicts a freed request's
blocks in the same order). Memory is bounded: at most `max_blocks` entries per backend (capped
at MAX_BLOCKS_PER_BACKEND) and `max_backends` backends (the least recently recorded one goes).
No I/O, no clock: the proxy records a dispatch, the balancer receives `match()`'s result as data.
Per process: without Redis each worker and replica keeps its own (affinity then holds within
one); with Redis the index is shared (router/request/placement/affinity_store.py, same eviction
order) and this one is kept warm beside it as the fallback while Redis is down or slow.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

MAX_BLOCKS_PER_BACKEND = 1 << 20


def held_prefix(
    holders: Mapping[bytes, set[str] | frozenset[str]], keys: Sequence[bytes], alive: list[str]
) -> dict[str, int]:
    """For each of `alive`: how many leading `keys` it holds (absent where it holds none).
    Shared by this index and the KV-event index (router/engine/kv_index.py)."""
    found: dict[str, int] = {}
    for i, k in enumerate(keys):
        held = holders.get(k)
        if held is not None and held.issuperset(alive):  # the usual case: no list built
            continue
        still = [n for n in alive if n in held] if held else []
        if i:
            for n in alive:
                if n not in still:
                    found[n] = i
        if not still:
            return found
        alive = still
    for n in alive:
        found[n] = len(keys)
    return found


class PrefixIndex:
    def __init__(self, max_backends: int = 1024) -> None:
        self._holders: dict[bytes, set[str]] = {}
        # backend -> its blocks, least recently used first; backends in least recent order too
        self._lru: OrderedDict[str, OrderedDict[bytes, None]] = OrderedDict()
        self._max_backends = max_backends
        self._limits: dict[str, int] = {}  # backend -> its bound at its last record
        self.entries = 0  # (block, backend) pairs held: the index's size

    def room(self, backend: str) -> int | None:
        """Blocks `backend`'s share takes before it evicts (None: never recorded, so empty)."""
        lru = self._lru.get(backend)
        return None if lru is None else self._limits[backend] - len(lru)

    def limit(self, backend: str, default: int) -> int:
        """`backend`'s bound at its last record here (`default`: never recorded here)."""
        return self._limits.get(backend, default)

    def match(self, hashes: Sequence[bytes], names: Iterable[str]) -> dict[str, int]:
        """For each of `names` holding at least the first block: how many leading blocks."""
        lru = self._lru
        alive = [n for n in names if n in lru]
        if not alive or not hashes:
            return {}
        return held_prefix(self._holders, hashes, alive)

    def record(self, hashes: Sequence[bytes], backend: str, max_blocks: int) -> None:
        """`backend` was sent this prompt: it now holds every block of it, most recently."""
        if not hashes:
            return
        lru = self._lru.get(backend)
        if lru is None:
            if len(self._lru) >= self._max_backends:
                self.forget(next(iter(self._lru)))
            lru = self._lru[backend] = OrderedDict()
        else:
            self._lru.move_to_end(backend)
        holders = self._holders
        for h in reversed(hashes):  # tail first: the prefix's head ends most recent
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                held = holders.get(h)
                if held is None:
                    holders[h] = {backend}
                else:
                    held.add(backend)
                self.entries += 1
        limit = self._limits[backend] = max(1, min(max_blocks, MAX_BLOCKS_PER_BACKEND))
        while len(lru) > limit:
            self._drop(lru.popitem(last=False)[0], backend)

    def forget(self, backend: str) -> None:
        """Drop everything `backend` held (it left the fleet, or room is needed)."""
        lru = self._lru.pop(backend, None)
        self._limits.pop(backend, None)
        for h in lru or ():
            self._drop(h, backend)

    def _drop(self, h: bytes, backend: str) -> None:
        held = self._holders.get(h)
        if held is not None:
            held.discard(backend)
            if not held:
                del self._holders[h]
        self.entries -= 1
