"""The mock engine's KV-cache events, in vLLM's wire format (router/engine/kv_wire.py decodes it).

`[topic, seq (8 bytes big-endian), msgpack [ts, [event, ...], 0]]` on a ZMQ PUB socket the mock
binds (as vLLM does for `ipc://` and `tcp://*:P`). Events are maps tagged by `"type"` with the
fields vLLM 0.32 writes (`encoding="map"`), or arrays, tag first, in declaration order, as vLLM
wrote them before ~0.24 (`encoding="array"`). The mock's block hashes are Python's own hash of
the chain: signed 64-bit ints, a spelling the router must accept. Token ids are the mock's
(`mock_tokens`: one id per 4 characters), which its `/tokenize` also answers.
The engine tier's conformance test holds these shapes to a real engine's.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

VOCAB = 50_000


def mock_tokens(text: str) -> list[int]:
    """The mock's tokenization: one id per 4 characters (what `prompt_tokens` counts)."""
    data = text.encode("utf-8", "surrogatepass")
    chars = len(text) // 4 * 4
    if len(data) == len(text):
        return [zlib.crc32(data[i : i + 4]) % VOCAB for i in range(0, chars, 4)]
    return [
        zlib.crc32(text[i : i + 4].encode("utf-8", "replace")) % VOCAB for i in range(0, chars, 4)
    ]


def stored(
    hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int, array: bool
) -> Any:
    if array:
        return ["BlockStored", list(hashes), parent, list(tokens), block_size, None, "GPU"]
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def removed(hashes: Sequence[int], array: bool) -> Any:
    if array:
        return ["BlockRemoved", list(hashes), "GPU"]
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU", "group_idx": 0}


def cleared(array: bool) -> Any:
    return ["AllBlocksCleared"] if array else {"type": "AllBlocksCleared"}


class KvPublisher:
    def __init__(self, endpoint: str, topic: str = "kv", encoding: str = "map") -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.array = encoding == "array"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.bind(endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self.seq = 0

    def publish(self, events: list[Any]) -> None:
        payload = self._enc.encode([time.time(), events, 0])
        self._sock.send_multipart([self.topic.encode(), self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def source(self) -> dict[str, Any]:
        """This publisher as vLLM's `GET /kv_event_sources` lists one rank's."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": None,
            "buffer_steps": 10000,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": self.topic,
        }

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
