"""What each engine's KV cache holds, from its own events: block keys the router computes.

A block's key is blake2b-64 over its parent's key, its namespace and its token ids (4 bytes
each), so two prompts share key i exactly when they share their first i+1 blocks of tokens, on
any engine: vLLM's hash algorithm, its `PYTHONHASHSEED` and its hash spelling (int or bytes) do
not matter. `BlockStored` carries the tokens; the key of its first block chains from the key the
parent's engine hash maps to (a parent this index never saw, or already forgot: the blocks are
unreachable by a prefix walk and are skipped). Each engine keeps engine hash -> key, so that
`BlockRemoved` resolves.
Namespaces keep apart what must not match a base-model prompt: a LoRA adapter's blocks
(`lora_name`) chain under `lora:<name>`, and blocks with other extra keys (multimodal inputs,
`cache_salt`, prompt embeddings) under those keys too, which no request's chain reproduces.
Only the `GPU` medium (what vLLM reports on CPU too) and KV-cache group 0 are indexed: an
offload tier's copies and a hybrid model's other groups are not a prefix hit on that engine.
Bounds: each engine's share is at most its own capacity in blocks (`max_blocks`, from
`vllm:cache_config_info`; oldest first out, as a missed removal must not grow it), capped at
MAX_BLOCKS_PER_ENGINE; nothing a client sends adds to it. No I/O, no clock.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from hashlib import blake2b
from typing import Any

from balancers.prefix_index import held_prefix
from router.engine.kv_wire import BlockHash, Stored

MAX_BLOCKS_PER_ENGINE = 1 << 20
BASE = b""


def namespace(lora_name: str | None) -> bytes:
    return BASE if not lora_name else b"lora:" + lora_name.encode("utf-8", "replace")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        return array("I", tokens).tobytes()
    except OverflowError:  # ids past 2^32 (none seen): still one spelling per token list
        return array("Q", [t & ((1 << 64) - 1) for t in tokens]).tobytes()


def chain_keys(
    tokens: Sequence[int], block_size: int, ns: bytes = BASE, parent: bytes = b""
) -> list[bytes]:
    """Keys of `tokens`' full blocks of `block_size` (a partial tail block is not cached)."""
    n = len(tokens) // block_size
    if n <= 0:
        return []
    data = _token_bytes(tokens[: n * block_size])
    step = 4 * block_size if len(data) == 4 * n * block_size else 8 * block_size
    out: list[bytes] = []
    key = parent
    for i in range(0, n * step, step):
        key = blake2b(key + ns + data[i : i + step], digest_size=8).digest()
        out.append(key)
    return out


def _extra_ns(ns: bytes, extra: Any, lora_name: str | None) -> bytes:
    """A block's namespace with its extra keys beyond the LoRA name (which vLLM lists first)."""
    if not extra:
        return ns
    items = list(extra) if isinstance(extra, list | tuple) else [extra]
    if lora_name and items and items[0] == lora_name:
        items = items[1:]
    return ns + b"|x:" + repr(items).encode() if items else ns


class _Engine:
    __slots__ = ("block_size", "by_hash", "loras", "refs")

    def __init__(self) -> None:
        self.by_hash: dict[BlockHash, bytes] = {}  # engine hash -> key, oldest first
        self.refs: dict[bytes, int] = {}  # key -> engine blocks naming it
        self.block_size: int | None = None
        self.loras: set[str] = set()


class TokenIndex:
    """Router key -> the engines holding that block, fed by their KV events."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._engines: dict[str, _Engine] = {}
        self.skipped = 0  # stored blocks not indexed: unknown parent, other medium or group

    # --- what routing reads -----------------------------------------------------------------

    def blocks(self, backend: str) -> int:
        e = self._engines.get(backend)
        return len(e.by_hash) if e is not None else 0

    def block_size(self, backend: str) -> int | None:
        e = self._engines.get(backend)
        return e.block_size if e is not None else None

    def has_lora(self, backend: str, name: str) -> bool:
        e = self._engines.get(backend)
        return e is not None and name in e.loras

    def match(self, keys: Sequence[bytes], names: Iterable[str]) -> dict[str, int]:
        """For each of `names` holding at least the first block: how many leading blocks."""
        alive = [n for n in names if n in self._engines]
        if not alive or not keys:
            return {}
        return held_prefix(self._holders, keys, alive)

    # --- what the events say ----------------------------------------------------------------

    def stored(self, backend: str, ev: Stored, max_blocks: int) -> int:
        """Index `ev`'s blocks on `backend`; returns how many were added."""
        e = self._engine(backend)
        n = len(ev.hashes)
        if ev.medium not in (None, "GPU") or ev.group != 0 or ev.block_size <= 0:
            self.skipped += n
            return 0
        e.block_size = ev.block_size
        if ev.parent is None:
            parent = b""
        else:
            found = e.by_hash.get(ev.parent)
            if found is None:
                self.skipped += n
                return 0
            parent = found
        bs = ev.block_size
        n = min(n, len(ev.token_ids) // bs)
        ns = namespace(ev.lora_name)
        if ev.lora_name:
            e.loras.add(ev.lora_name)
        extra = ev.extra_keys
        lora_only = [ev.lora_name] if ev.lora_name else None
        if not extra or all(x is None or list(x) == lora_only for x in extra):
            keys = chain_keys(ev.token_ids[: n * bs], bs, ns, parent)
        else:
            keys = []
            key = parent
            for i in range(n):
                block_ns = _extra_ns(ns, extra[i] if i < len(extra) else None, ev.lora_name)
                key = chain_keys(ev.token_ids[i * bs : (i + 1) * bs], bs, block_ns, key)[0]
                keys.append(key)
        holders = self._holders
        for h, key in zip(ev.hashes, keys, strict=False):
            old = e.by_hash.pop(h, None)
            if old is not None:
                self._unref(e, old, backend)
            e.by_hash[h] = key
            refs = e.refs.get(key, 0)
            e.refs[key] = refs + 1
            if not refs:
                held = holders.get(key)
                if held is None:
                    holders[key] = {backend}
                else:
                    held.add(backend)
        limit = max(1, min(max_blocks, MAX_BLOCKS_PER_ENGINE))
        by_hash = e.by_hash
        while len(by_hash) > limit:
            oldest = next(iter(by_hash))
            self._unref(e, by_hash.pop(oldest), backend)
        return len(keys)

    def removed(self, backend: str, hashes: Sequence[BlockHash]) -> int:
        e = self._engines.get(backend)
        if e is None:
            return 0
        gone = 0
        for h in hashes:
            key = e.by_hash.pop(h, None)
            if key is not None:
                self._unref(e, key, backend)
                gone += 1
        return gone

    def cleared(self, backend: str) -> None:
        """The engine holds nothing (AllBlocksCleared, a restart, a gap without replay)."""
        e = self._engines.get(backend)
        if e is None:
            return
        for key in e.refs:
            self._drop_holder(key, backend)
        e.by_hash.clear()
        e.refs.clear()

    def forget(self, backend: str) -> None:
        """`backend` left the fleet."""
        self.cleared(backend)
        self._engines.pop(backend, None)

    def _engine(self, backend: str) -> _Engine:
        e = self._engines.get(backend)
        if e is None:
            e = self._engines[backend] = _Engine()
        return e

    def _unref(self, e: _Engine, key: bytes, backend: str) -> None:
        refs = e.refs.get(key, 0) - 1
        if refs > 0:
            e.refs[key] = refs
            return
        e.refs.pop(key, None)
        self._drop_holder(key, backend)

    def _drop_holder(self, key: bytes, backend: str) -> None:
        held = self._holders.get(key)
        if held is not None:
            held.discard(backend)
            if not held:
                del self._holders[key]
