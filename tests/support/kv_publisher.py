"""vLLM's KV-event wire format, written as vLLM 0.32 writes it (`vllm/distributed/kv_events.py`):
msgspec structs tagged by class name, maps with defaults omitted, or arrays (vLLM before ~0.24),
sent as `[topic, seq, payload]` on a real ZMQ PUB socket. Tests publish with it; the real
engine's events are checked against the same shapes in the engine tier."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _Map(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(_Map):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    some_future_field: int | None = None  # unknown to the router: must be ignored


class BlockRemoved(_Map):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Map):
    pass


class FutureEvent(_Map):  # a type the router does not know
    what: int = 1


class _Arr(msgspec.Struct, array_like=True, tag=True):
    pass


class BlockStoredArr(_Arr, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = "full_attention"
    trailing: int = 7  # an item from a later version: the router must skip it


class BlockRemovedArr(_Arr, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksClearedArr(_Arr, tag="AllBlocksCleared"):
    pass


def stored(
    hashes: list[int | bytes],
    parent: int | bytes | None,
    tokens: list[int],
    block_size: int,
    array: bool = False,
    lora: str | None = None,
    medium: str = "GPU",
) -> Any:
    if array:
        return BlockStoredArr(hashes, parent, tokens, block_size, None, medium, lora)
    extra = [[lora]] * len(hashes) if lora else [None] * len(hashes)
    return BlockStored(
        hashes, parent, tokens, block_size, None, medium, lora, extra, 0, "full_attention", 3
    )


def removed(hashes: list[int | bytes], array: bool = False) -> Any:
    return BlockRemovedArr(hashes, "GPU") if array else BlockRemoved(hashes, "GPU", 0)


def cleared(array: bool = False) -> Any:
    return AllBlocksClearedArr() if array else AllBlocksCleared()


_ENC = msgspec.msgpack.Encoder()


def frames(seq: int, events: list[Any], topic: bytes = b"kv", ts: float = 0.0) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), _ENC.encode(EventBatch(ts, events, 0))]


class Publisher:
    """A PUB socket that binds (as vLLM does with `ipc://` or `tcp://*:P`) or connects. It is an
    XPUB (same wire for the subscriber), so a test can wait for the subscription to arrive
    instead of sleeping past ZMQ's slow-joiner window."""

    def __init__(self, endpoint: str, bind: bool = True, topic: bytes = b"kv") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)
        self.topic = topic
        self.seq = 0
        self.sent: list[tuple[int, bytes]] = []

    async def subscribed(self) -> None:
        import asyncio

        async with asyncio.timeout(5.0):
            while not self.sock.poll(0):  # noqa: ASYNC110 (a ZMQ socket, no asyncio event)
                await asyncio.sleep(0.01)
        msg = self.sock.recv()
        assert msg[:1] == b"\x01", msg  # a subscribe message

    def publish(self, events: list[Any], ts: float = 0.0, seq: int | None = None) -> int:
        s = self.seq if seq is None else seq
        f = frames(s, events, self.topic, ts)
        self.sock.send_multipart(f)
        self.sent.append((s, f[2]))
        self.seq = s + 1
        return s

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
