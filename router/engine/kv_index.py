"""What each engine's KV cache holds, from its own events: block keys the router computes.

A block's key is a 64-bit hash over its parent's key, its namespace and its token ids, so two
prompts share key i exactly when they share their first i+1 blocks of tokens, on any engine:
vLLM's hash algorithm, its `PYTHONHASHSEED` and its hash spelling (int or bytes) do not matter.
The hash is Python's own (SipHash, keyed per process): keys never leave this process (every
router process subscribes on its own), a client cannot aim a collision at a secret key, and it
costs a quarter of blake2b-64's per block.
The token ids are hashed as the msgpack array of the block's ids, each in its shortest form
(what msgspec, vLLM's encoder, writes): a `BlockStored` is then keyed on the bytes it came in,
with no int built (a block's bytes end where a C-level regex scan of `block_size` ids ends;
decoding the ids and encoding each block again cost 2.5x as much). msgpack
decodes one way, so equal bytes are equal tokens: an encoder that wrote longer forms could only
make keys miss, never match wrongly, and each engine's first such event is checked against a
re-encoding (`_Engine.raw_ok`; a mismatch keys that engine's events from their ints).
`BlockStored` carries the tokens; the key of its first block chains from the key the parent's
engine hash maps to (a parent this index never saw, or already forgot: the blocks are
unreachable by a prefix walk and are skipped). Each engine keeps engine hash -> key, so that
`BlockRemoved` resolves.
Namespaces keep apart what must not match a base-model prompt: a LoRA adapter's blocks
(`lora_name`) chain under `lora:<name>`, and blocks with other extra keys (multimodal inputs,
`cache_salt`, prompt embeddings) under those keys too, which no request's chain reproduces.
Only the `GPU` medium (what vLLM reports on CPU too) and KV-cache group 0 are indexed: an
offload tier's copies and a hybrid model's other groups are not a prefix hit on that engine.
Bounds: each engine's share is at most its own capacity in blocks (`max_blocks`, from
`vllm:cache_config_info`; oldest first out, as a missed removal must not grow it), capped at
MAX_BLOCKS_PER_ENGINE; nothing a client sends adds to it. A batch's work is bounded too
(MAX_BATCH_BLOCKS block hashes; the rest is not applied and `apply` says so), and so are the
adapter names an engine is known to hold (MAX_LORAS, most recently seen kept; a name longer
than MAX_LORA_NAME is not indexed). No I/O, no clock.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

import msgspec

from balancers.prefix_index import held_prefix
from router.engine.kv_wire import BlockHash, Event, Removed, Stored, token_list

MAX_BLOCKS_PER_ENGINE = 1 << 20
# Block hashes (stored and removed) applied from one batch, so that one message's work is
# bounded whatever its block size (block size 1 is the dearest per byte; bench/scenarios/kv.py): 256
# k tokens at block size 16, where a vLLM step stores a few hundred blocks.
MAX_BATCH_BLOCKS = 1 << 14
MAX_LORAS = 1024  # adapter names remembered per engine (vLLM serves a few dozen at most)
MAX_LORA_NAME = 256  # characters: a longer adapter name is no model name a request can give
BASE = b""

_encode = msgspec.msgpack.Encoder().encode


def namespace(lora_name: str | None) -> bytes:
    return BASE if not lora_name else b"lora:" + lora_name.encode("utf-8", "replace")


@lru_cache(maxsize=64)
def _header(n: int) -> bytes:
    """The msgpack array header of `n` items, as msgspec writes it."""
    return _encode([0] * n)[:-n] if n else _encode([])


def _key(data: bytes) -> bytes:
    """A block's key: the 64-bit hash of its parent's key, namespace and encoded ids."""
    return hash(data).to_bytes(8, "little", signed=True)


@lru_cache(maxsize=64)
def _block_of(n: int) -> re.Pattern[bytes]:
    """`n` msgpack unsigned ints, each in any of its forms (the scan only finds where a block
    ends; `_as_msgspec_writes` checked the forms). The commonest forms of token ids first (16-
    and 32-bit), and a possessive repeat (no backtracking state): 1.7x faster than plain."""
    return re.compile(rb"(?:\xcd..|\xce....|[\x00-\x7f]|\xcc.|\xcf.{8}){%d}+" % n, re.S)


def _raw_keys(raw: msgspec.Raw, bs: int, n: int, ns: bytes, parent: bytes) -> list[bytes] | None:
    """Keys of `n` blocks straight from their encoded ids (one msgpack array of exactly
    `n * bs` ids; else None): the same keys as `chain_keys` of the ids."""
    view = memoryview(raw)
    if not view:
        return None
    first = view[0]
    if 0x90 <= first <= 0x9F:
        count, at = first & 0x0F, 1
    elif first == 0xDC and len(view) >= 3:
        count, at = view[1] << 8 | view[2], 3
    elif first == 0xDD and len(view) >= 5:
        count, at = int.from_bytes(view[1:5], "big"), 5
    else:
        return None
    if count != n * bs:
        return None
    if n == 1:  # its bytes are the block's array as `chain_keys` encodes it, header included
        return [_key(parent + ns + raw)]
    hdr = _header(bs)
    block = _block_of(bs)
    keys: list[bytes] = []
    key = parent
    for _ in range(n - 1):
        m = block.match(raw, at)
        if m is None:
            return None
        end = m.end()
        key = _key(key + ns + hdr + view[at:end])
        keys.append(key)
        at = end
    keys.append(_key(key + ns + hdr + view[at:]))
    return keys


def _limit(max_blocks: int) -> int:
    """An engine's share of the index, in blocks."""
    return max(1, min(max_blocks, MAX_BLOCKS_PER_ENGINE))


def chain_keys(
    tokens: Sequence[int], block_size: int, ns: bytes = BASE, parent: bytes = b""
) -> list[bytes]:
    """Keys of `tokens`' full blocks of `block_size` (a partial tail block is not cached)."""
    n = len(tokens) // block_size
    out: list[bytes] = []
    key = parent
    for i in range(0, n * block_size, block_size):
        key = _key(key + ns + _encode(tokens[i : i + block_size]))
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


def _lora_only(extra: list[Any], lora: str | None) -> bool:
    """Every block's extra keys are just its LoRA name (what vLLM sends for an adapter)."""
    if not lora:
        return False
    only = [lora]
    return all(x is None or list(x) == only for x in extra)


def _as_msgspec_writes(raw: msgspec.Raw) -> bool | None:
    """Whether `raw`, a msgpack array of ints, is what `chain_keys` would hash for its ints;
    None when it is not an array of ints (that event tells nothing of the encoder)."""
    try:
        return _encode(msgspec.msgpack.decode(raw, type=list[int])) == bytes(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, OverflowError):
        return None


class _Engine:
    __slots__ = ("alone", "block_size", "by_hash", "dups", "loras", "raw_ok")

    def __init__(self, name: str) -> None:
        # The holders of a block only this engine holds (most blocks): one object shared by
        # all of them, not a set each (a set is ~200 bytes and an allocation per stored block).
        self.alone = frozenset((name,))
        # engine hash -> key, oldest first. Ordered by a linked list, not a dict's insertion
        # order: the trim past capacity takes the oldest in O(1), where a dict's first item is
        # found by scanning the slots its earlier trims emptied (quadratic over a flood).
        self.by_hash: OrderedDict[BlockHash, bytes] = OrderedDict()
        # key -> engine blocks naming it beyond the first (rare: the same tokens under two
        # engine hashes); a key in by_hash's values and not here is named once.
        self.dups: dict[bytes, int] = {}
        self.block_size: int | None = None
        # Adapter names seen in its events, least recently seen first (MAX_LORAS of them).
        self.loras: OrderedDict[str, None] = OrderedDict()
        self.raw_ok: bool | None = None  # its encoded tokens are msgspec's (None: not seen yet)


class TokenIndex:
    """Router key -> the engines holding that block, fed by their KV events."""

    def __init__(self) -> None:
        # A block one engine holds maps to that engine's `alone`; one held by several, to a set.
        self._holders: dict[bytes, set[str] | frozenset[str]] = {}
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

    def apply(
        self, backend: str, events: Sequence[Event], max_blocks: int
    ) -> tuple[int, int, int, int, bool]:
        """One batch's events on `backend`, in order: (BlockStored, BlockRemoved and
        AllBlocksCleared events, blocks added, whether all were applied: not past
        MAX_BATCH_BLOCKS). One call per batch, the engine's state looked up once: per event, a
        call and its lookups were a fifth of the ingestion's cost."""
        e = self._engine(backend)
        limit = _limit(max_blocks)
        stored = removed = cleared = blocks = work = 0
        gone: list[BlockHash] = []  # vLLM sends one BlockRemoved per block: removed together
        for ev in events:
            kind = type(ev)
            if kind is Stored:
                work += len(ev.hashes)  # type: ignore[union-attr]
                if work > MAX_BATCH_BLOCKS:
                    break
                if gone:
                    self._removed(e, backend, gone)
                    gone = []
                stored += 1
                blocks += self._stored(e, backend, ev, limit)  # type: ignore[arg-type]
            elif kind is Removed:
                work += len(ev.hashes)  # type: ignore[union-attr]
                if work > MAX_BATCH_BLOCKS:
                    break
                removed += 1
                gone += ev.hashes  # type: ignore[union-attr]
            else:
                gone = []  # cleared anyway
                cleared += 1
                self.cleared(backend)
        if gone:
            self._removed(e, backend, gone)
        return stored, removed, cleared, blocks, work <= MAX_BATCH_BLOCKS

    def stored(self, backend: str, ev: Stored, max_blocks: int) -> int:
        """Index `ev`'s blocks on `backend`; returns how many were added."""
        return self._stored(self._engine(backend), backend, ev, _limit(max_blocks))

    def _stored(self, e: _Engine, backend: str, ev: Stored, limit: int) -> int:
        hashes = ev.hashes
        bs = ev.block_size
        if ev.medium not in (None, "GPU") or ev.group not in (0, None) or bs <= 0:
            self.skipped += len(hashes)
            return 0
        e.block_size = bs
        by_hash = e.by_hash
        if ev.parent is None:
            parent = b""
        else:
            found = by_hash.get(ev.parent)
            if found is None:
                self.skipped += len(hashes)
                return 0
            parent = found
        lora = ev.lora_name
        ns = BASE
        if lora:
            if len(lora) > MAX_LORA_NAME:
                self.skipped += len(hashes)
                return 0
            ns = namespace(lora)
            loras = e.loras
            if lora in loras:
                loras.move_to_end(lora)
            else:
                loras[lora] = None
                if len(loras) > MAX_LORAS:
                    loras.popitem(last=False)
        extra = ev.extra_keys
        plain = not extra or extra.count(None) == len(extra) or _lora_only(extra, lora)
        raw = ev.token_ids
        keys: list[bytes] | None = None
        if plain and hashes and e.raw_ok is not False:
            if e.raw_ok is None:
                e.raw_ok = _as_msgspec_writes(raw)  # still None: not ids, skipped below
            if e.raw_ok:
                keys = _raw_keys(raw, bs, len(hashes), ns, parent)
        if keys is None:
            tokens = token_list(ev)
            if tokens is None:
                self.skipped += len(hashes)
                return 0
            n = min(len(hashes), len(tokens) // bs)
            if plain or extra is None:
                keys = chain_keys(
                    tokens if n * bs == len(tokens) else tokens[: n * bs], bs, ns, parent
                )
            else:
                keys = []
                key = parent
                for i in range(n):
                    block_ns = _extra_ns(ns, extra[i] if i < len(extra) else None, lora)
                    key = chain_keys(tokens[i * bs : (i + 1) * bs], bs, block_ns, key)[0]
                    keys.append(key)
        holders = self._holders
        alone = e.alone
        for h, key in zip(hashes, keys, strict=False):
            old = by_hash.pop(h, None)
            if old is not None:
                self._unref(e, old, backend)
            by_hash[h] = key
            held = holders.get(key)
            if held is None:
                holders[key] = alone
            elif backend not in held:
                if type(held) is frozenset:  # another engine's alone: now a set of two
                    holders[key] = {*held, backend}
                else:
                    held.add(backend)  # type: ignore[union-attr]
            else:  # this engine holds the key already: under another hash, or this one again
                e.dups[key] = e.dups.get(key, 0) + 1
        if len(by_hash) > limit:  # oldest first out
            oldest = by_hash.popitem
            for _ in range(len(by_hash) - limit):
                self._unref(e, oldest(last=False)[1], backend)
        return len(keys)

    def removed(self, backend: str, hashes: Sequence[BlockHash]) -> int:
        e = self._engines.get(backend)
        return 0 if e is None else self._removed(e, backend, hashes)

    def _removed(self, e: _Engine, backend: str, hashes: Sequence[BlockHash]) -> int:
        gone = 0
        pop = e.by_hash.pop
        holders = self._holders
        alone = e.alone
        for h in hashes:
            key = pop(h, None)
            if key is None:
                continue
            gone += 1
            if e.dups:
                self._unref(e, key, backend)
            elif holders.get(key) is alone:  # the usual case: the block was only here
                del holders[key]
            else:
                self._drop_holder(key, backend)
        return gone

    def cleared(self, backend: str) -> None:
        """The engine holds nothing (AllBlocksCleared, a restart, a gap without replay)."""
        e = self._engines.get(backend)
        if e is None:
            return
        for key in set(e.by_hash.values()):
            self._drop_holder(key, backend)
        e.by_hash.clear()
        e.dups.clear()
        e.raw_ok = None  # a restarted engine may be another version

    def forget(self, backend: str) -> None:
        """`backend` left the fleet."""
        self.cleared(backend)
        self._engines.pop(backend, None)

    def _engine(self, backend: str) -> _Engine:
        e = self._engines.get(backend)
        if e is None:
            e = self._engines[backend] = _Engine(backend)
        return e

    def _unref(self, e: _Engine, key: bytes, backend: str) -> None:
        dups = e.dups
        if dups:
            more = dups.get(key)
            if more is not None:
                if more > 1:
                    dups[key] = more - 1
                else:
                    del dups[key]
                return
        self._drop_holder(key, backend)

    def _drop_holder(self, key: bytes, backend: str) -> None:
        held = self._holders.get(key)
        if held is None:
            return
        if type(held) is frozenset:  # some engine's alone
            if backend in held:
                del self._holders[key]
            return
        held.discard(backend)  # type: ignore[union-attr]
        if not held:
            del self._holders[key]
