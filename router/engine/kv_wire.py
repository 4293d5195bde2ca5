"""vLLM's KV-cache event messages, decoded: `[topic, seq, payload]` frames into a `Batch`.

The payload is msgpack: `[ts, [event, ...], data_parallel_rank]` (the rank may be missing). Each
event is tagged by its class name, either as a map with a `"type"` key and defaults omitted
(vLLM since about 0.24) or as an array, tag first, fields in declaration order (before). Both
decode here; unknown fields (map) and trailing items (array) are ignored, an event of a type we
do not know is counted and skipped, never an error. Block hashes are ints (unsigned 64-bit by
default; a signed one is taken modulo 2^64, so either spelling names the same block) or bytes
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).

msgspec, not msgpack-python: it is what vLLM encodes with, and it decodes straight into typed
structs in C. Token ids stay encoded (`msgspec.Raw`, a view of the payload): building a Python
int per token was most of the decoding's cost, and the index keys a block on the encoded bytes.
A map-encoded batch of known types and unsigned int hashes (what vLLM 0.32 sends) is one
decoder call into the very `Stored`/`Removed`/`Cleared` structs the index reads, already in the
one spelling per block, with no per-event Python objects besides those and no pass over them
after; an array-encoded batch, one holding a type we do not know or a signed hash, falls back
to one decode per event (bench/scenarios/kv.py measures the ingestion budget). The structs are not
tracked by the garbage collector (they hold no cycle), so a busy feed triggers fewer
collections.
"""

from __future__ import annotations

from math import isfinite
from typing import Annotated, Any

import msgspec

MASK64 = (1 << 64) - 1
BlockHash = int | bytes
# What the fast decoder accepts: vLLM's own spelling. A signed hash fails it (and takes the
# per-event path, which spells it unsigned), so a decoded batch needs no second pass.
_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack has no int above 2^64 - 1


class WireError(ValueError):
    """A message that is not a vLLM KV event batch; str() is a short reason."""


_NO_TOKENS = msgspec.Raw(b"\x90")  # an empty msgpack array


class Stored(msgspec.Struct, tag="BlockStored", tag_field="type", gc=False):
    """`BlockStored`: `hashes` are consecutive blocks, `token_ids` all their tokens, left
    encoded (the msgpack array as it came): the index keys a block on these bytes, so most
    events never become Python ints (`token_list` decodes them when needed)."""

    hashes: list[_U64 | bytes] = msgspec.field(name="block_hashes")
    parent: _U64 | bytes | None = msgspec.field(default=None, name="parent_block_hash")
    token_ids: msgspec.Raw = _NO_TOKENS
    block_size: int = 0
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    medium: str | None = None
    group: int | None = msgspec.field(default=0, name="group_idx")


class Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type", gc=False):
    hashes: list[_U64 | bytes] = msgspec.field(name="block_hashes")
    medium: str | None = None
    group: int | None = msgspec.field(default=0, name="group_idx")


class Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type", gc=False):
    pass


Event = Stored | Removed | Cleared


# The map encoding as the per-event path reads it: any int hash (normalized after).
class _StoredMap(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: msgspec.Raw = _NO_TOKENS
    block_size: int = 0
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    medium: str | None = None
    group_idx: int | None = 0


class _RemovedMap(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = 0


# The array encoding: vLLM's declaration order (lora_id sits between block_size and medium).
class _StoredArr(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: msgspec.Raw = _NO_TOKENS
    block_size: int = 0
    lora_id: Any = None
    medium: str | None = None
    lora_name: Any = None
    extra_keys: Any = None
    group_idx: Any = None


class _RemovedArr(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: Any = None


class _ClearedArr(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


class _MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_FAST = msgspec.msgpack.Decoder(_MapBatch)
_RAW = msgspec.msgpack.Decoder(_RawBatch)
_MAP = msgspec.msgpack.Decoder(_StoredMap | _RemovedMap | Cleared)
_ARR = msgspec.msgpack.Decoder(_StoredArr | _RemovedArr | _ClearedArr)
_TOKENS = msgspec.msgpack.Decoder(list[int])


def token_list(ev: Stored) -> list[int] | None:
    """`ev`'s token ids as ints; None when they are not a list of ints (the event is skipped)."""
    try:
        return _TOKENS.decode(ev.token_ids)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class Batch(msgspec.Struct, frozen=True, gc=False):
    """One message. A struct, not a frozen dataclass: its __init__ is C, not a setattr each."""

    seq: int
    ts: float  # the engine's wall clock when it built the batch (finite: 0.0 if not)
    events: list[Event]
    rank: int | None
    unknown: int  # events of a type this router does not know, skipped
    size: int = 0  # its payload's bytes (what holding it and a loop turn's budget count)


def norm(h: int | bytes) -> BlockHash:
    """One spelling per block: ints as unsigned 64-bit (vLLM takes the low 64 bits)."""
    return h & MASK64 if isinstance(h, int) else h


def _norm_all(hashes: list[BlockHash]) -> list[BlockHash]:
    # vLLM sends unsigned ints: the common case costs one pass and no new list.
    for h in hashes:
        if not isinstance(h, int) or h < 0:
            return [norm(x) for x in hashes]
    return hashes


def _group(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _normalized(ev: Any) -> Event:
    """A per-event decode (either encoding) as the index reads it, hashes spelled unsigned."""
    if isinstance(ev, _StoredArr | _StoredMap):
        lora, extra = ev.lora_name, ev.extra_keys
        parent = ev.parent_block_hash
        return Stored(
            _norm_all(ev.block_hashes),
            None if parent is None else norm(parent),
            ev.token_ids,
            ev.block_size,
            lora if isinstance(lora, str) else None,
            extra if isinstance(extra, list) else None,
            ev.medium,
            _group(ev.group_idx),
        )
    if isinstance(ev, _RemovedArr | _RemovedMap):
        return Removed(_norm_all(ev.block_hashes), ev.medium, _group(ev.group_idx))
    return Cleared()


def _event(raw: msgspec.Raw) -> Event | None:
    data = bytes(raw)
    first = data[0] if data else 0
    # msgpack: fixmap 0x80-0x8f, map16/32 0xde/0xdf; fixarray 0x90-0x9f, array16/32 0xdc/0xdd
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return _normalized(_MAP.decode(data))
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return _normalized(_ARR.decode(data))
    return None


def decode(frames: list[bytes]) -> Batch:
    """`[topic, seq (8 bytes big-endian), payload]` -> a Batch; WireError when it is not one."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise WireError(f"expected [topic, seq, payload], got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big", signed=True)
    payload = frames[2]
    unknown = 0
    try:
        fast = _FAST.decode(payload)
        events: list[Event] = fast.events
        ts, rank = fast.ts, fast.data_parallel_rank
    except (msgspec.DecodeError, msgspec.ValidationError):
        # An array-encoded batch, a type we do not know, a signed hash, or not a batch at all.
        try:
            raw = _RAW.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireError(f"not an event batch: {str(exc)[:80]}") from None
        events = []
        for item in raw.events:
            try:
                ev = _event(item)
            except (msgspec.DecodeError, msgspec.ValidationError):
                ev = None
            if ev is None:
                unknown += 1
            else:
                events.append(ev)
        ts, rank = raw.ts, raw.data_parallel_rank
    if not isfinite(ts):  # msgpack floats include them: an infinite lag breaks the admin JSON
        ts = 0.0  # as a publisher with no clock: long ago
    return Batch(seq, ts, events, rank, unknown, len(payload))
