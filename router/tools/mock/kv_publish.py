"""The mock engine's KV-cache events, in vLLM's wire format (router/engine/kv_wire.py decodes it).

`[topic, seq (8 bytes big-endian), msgpack [ts, [event, ...], 0]]` on a ZMQ PUB socket the mock
binds (as vLLM does for `ipc://` and `tcp://*:P`). Events are maps tagged by `"type"` with the
fields vLLM 0.32 writes (`encoding="map"`), or arrays, tag first, in declaration order, as vLLM
wrote them before ~0.24 (`encoding="array"`), every field written as vLLM 0.32 writes it (it
omits none of these). Block hashes are Python's own hash of the chain, written as vLLM writes
its own: the low 64 bits, unsigned. One `BlockRemoved` per evicted block, as vLLM sends them.
Token ids are the mock's (`mock_tokens`: one id per 4 characters), which its `/tokenize` also
answers. tests_engine/test_kv_conformance.py holds these shapes to a real engine's.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import zmq

VOCAB = 50_000
MASK64 = (1 << 64) - 1


def _u64(h: int) -> int:
    return h & MASK64


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
    hashes = [_u64(h) for h in hashes]
    parent = None if parent is None else _u64(parent)
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
    """One event; vLLM sends one per block (`removed_each`)."""
    hashes = [_u64(h) for h in hashes]
    if array:
        return ["BlockRemoved", list(hashes), "GPU"]
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU", "group_idx": 0}


def removed_each(hashes: Sequence[int], array: bool) -> list[Any]:
    return [removed([h], array) for h in hashes]


def cleared(array: bool) -> Any:
    return ["AllBlocksCleared"] if array else {"type": "AllBlocksCleared"}


class KvPublisher:
    """A PUB socket, and with `replay_endpoint` vLLM's replay service: a ROUTER socket that
    answers `[b"", start seq]` with every buffered `(topic, seq, payload)` from `start` on, then
    `(b"", seq -1, b"")` (vLLM's `ZmqEventPublisher._service_replay`), served by a thread of
    its own (as vLLM's publisher thread serves it), from the last `buffer_steps` batches."""

    def __init__(
        self,
        endpoint: str,
        topic: str = "kv",
        encoding: str = "map",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
    ) -> None:
        self.endpoint = endpoint
        self.topic = topic
        self.array = encoding == "array"
        self.replay_endpoint = replay_endpoint
        self.buffer_steps = buffer_steps
        import zmq  # only a mock that publishes pays its import (a sixth of a mock's start)

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.bind(endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._stop = threading.Event()
        self._replay: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self._replay = threading.Thread(target=self._serve, args=(router,), daemon=True)
            self._replay.start()
        self.seq = 0

    def publish(self, events: list[Any]) -> None:
        payload = self._enc.encode([time.time(), events, 0])
        self._sock.send_multipart([self.topic.encode(), self.seq.to_bytes(8, "big"), payload])
        if self._replay is not None:
            self._buffer.append((self.seq, payload))
        self.seq += 1

    def _serve(self, router: zmq.Socket[bytes]) -> None:
        import zmq

        topic = self.topic.encode()
        try:
            while not self._stop.is_set():
                if not router.poll(100):
                    continue
                frame = router.recv_multipart()
                if len(frame) != 3:
                    continue  # vLLM logs and ignores it
                client, _, start_bytes = frame
                start = int.from_bytes(start_bytes, "big")
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        router.send_multipart([client, b"", topic, seq.to_bytes(8, "big"), payload])
                router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        except zmq.ZMQError:
            pass  # the context is going away
        finally:
            router.close(0)

    def source(self) -> dict[str, Any]:
        """This publisher as vLLM's `GET /kv_event_sources` lists one rank's."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": self.topic,
        }

    def close(self) -> None:
        self._stop.set()
        if self._replay is not None:
            self._replay.join(2)
        self._sock.close(0)
        self._ctx.term()
