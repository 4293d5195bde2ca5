"""vLLM's KV-cache event messages, decoded: `[topic, seq, payload]` frames into a `Batch`.

The payload is msgpack: `[ts, [event, ...], data_parallel_rank]` (the rank may be missing). Each
event is tagged by its class name, either as a map with a `"type"` key and defaults omitted
(vLLM since about 0.24) or as an array, tag first, fields in declaration order (before). Both
decode here; unknown fields (map) and trailing items (array) are ignored, an event of a type we
do not know is counted and skipped, never an error. Block hashes are ints (unsigned 64-bit by
default; a signed one is taken modulo 2^64, so either spelling names the same block) or bytes
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).

msgspec, not msgpack-python: it is what vLLM encodes with, and it decodes straight into typed
structs in C (one map-or-array peek per event, then one call), ~2x faster than building dicts
and reading them back in Python (bench/kv.py measures the ingestion budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

MASK64 = (1 << 64) - 1
BlockHash = int | bytes


class WireError(ValueError):
    """A message that is not a vLLM KV event batch; str() is a short reason."""


class _StoredMap(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _StoredArr(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: Any = None
    medium: str | None = None
    lora_name: Any = None
    extra_keys: Any = None
    group_idx: Any = None


class _RemovedArr(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: Any = None


class _ClearedArr(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_MAP = msgspec.msgpack.Decoder(_StoredMap | _RemovedMap | _ClearedMap)
_ARR = msgspec.msgpack.Decoder(_StoredArr | _RemovedArr | _ClearedArr)
_BATCH = msgspec.msgpack.Decoder(_Batch)


@dataclass(frozen=True, slots=True)
class Stored:
    hashes: list[BlockHash]
    parent: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    extra_keys: list[Any] | None
    medium: str | None
    group: int


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: list[BlockHash]
    medium: str | None
    group: int


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ts: float  # the engine's wall clock when it built the batch
    events: list[Event]
    rank: int | None
    unknown: int  # events of a type this router does not know, skipped


def norm(h: int | bytes) -> BlockHash:
    """One spelling per block: ints as unsigned 64-bit (vLLM takes the low 64 bits)."""
    return h & MASK64 if isinstance(h, int) else h


def _group(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _event(raw: msgspec.Raw) -> Event | None:
    data = bytes(raw)
    first = data[0] if data else 0
    # msgpack: fixmap 0x80-0x8f, map16/32 0xde/0xdf; fixarray 0x90-0x9f, array16/32 0xdc/0xdd
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        ev: Any = _MAP.decode(data)
    elif 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        ev = _ARR.decode(data)
    else:
        return None
    if isinstance(ev, _StoredMap | _StoredArr):
        parent = ev.parent_block_hash
        lora = ev.lora_name
        extra = ev.extra_keys
        return Stored(
            [norm(h) for h in ev.block_hashes],
            None if parent is None else norm(parent),
            ev.token_ids,
            ev.block_size,
            lora if isinstance(lora, str) else None,
            extra if isinstance(extra, list) else None,
            ev.medium,
            _group(ev.group_idx),
        )
    if isinstance(ev, _RemovedMap | _RemovedArr):
        return Removed([norm(h) for h in ev.block_hashes], ev.medium, _group(ev.group_idx))
    return Cleared()


def decode(frames: list[bytes]) -> Batch:
    """`[topic, seq (8 bytes big-endian), payload]` -> a Batch; WireError when it is not one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise WireError(f"expected [topic, seq, payload], got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big", signed=True)
    try:
        batch = _BATCH.decode(frames[2])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"not an event batch: {str(exc)[:80]}") from None
    events: list[Event] = []
    unknown = 0
    for raw in batch.events:
        try:
            ev = _event(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            ev = None
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    return Batch(seq, batch.ts, events, batch.data_parallel_rank, unknown)
