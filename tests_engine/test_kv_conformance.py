"""The mock's KV-cache events held to a real vLLM's, and the router's calibration read from one.

The same prompts go into engine 0 of the session's fleet and into a mock engine (64 blocks of 32
of its own tokens: it counts 4 characters a token, the real tokenizer nearer 1.5, so the same
prompts span a similar number of blocks), each watched by a plain ZMQ subscriber. Both streams must
have vLLM's shape: three frames `[topic, seq, payload]`, seq counting up by one, the payload
`[ts, events, rank]`, the same fields per event type, hashes as unsigned 64-bit ints, only full
blocks of the block size that `vllm:cache_config_info` reports, a prompt's first block without
parent and a longer prompt's new blocks chained on the shorter one's last, nothing new for a
repeated prompt, one `BlockRemoved` per evicted block, tail first, before the store that needed
the room. Where they differ, vLLM is right. The real engine's replay socket answers as the
router's subscriber expects. Calibration: the prefill cost per token and the decode-step cost
per sequence that router/engine/calibrate.py learns from the engine's own histograms are in
seconds and below what the client measured around them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from router.engine.calibrate import Calibration
from router.engine.kv_wire import Stored, decode
from router.engine.parse import parse
from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster
from tests_engine.support import cache_config

MASK64 = (1 << 64) - 1
QUIET_S = 0.5  # no message for this long after an answer: its step's batch has been seen
FILL_MAX = 24  # prompts sent at most to make the engine evict


@dataclass
class Side:
    """One engine, real or mock, and what its publisher sent while we listened."""

    name: str
    url: str
    model: str
    endpoint: str
    topic: bytes
    block_size: int
    sock: zmq.Socket[bytes]
    messages: list[list[bytes]] = field(default_factory=list)

    def drain(self) -> list[list[bytes]]:
        """Messages until the publisher has been quiet for QUIET_S (bounded)."""
        got: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.sock.poll(int(QUIET_S * 1000)):
            got.append(self.sock.recv_multipart())
        self.messages += got
        return got

    def complete(self, prompt: str) -> tuple[int, list[Any]]:
        """(prompt tokens, the events its step published)."""
        r = httpx.post(
            self.url + "/v1/completions",
            json={"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0},
            timeout=60,
        )
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens"]), _events(self.drain())


def _events(messages: list[list[bytes]]) -> list[Any]:
    return [ev for m in messages for ev in msgspec.msgpack.decode(m[2])[1]]


@pytest.fixture(scope="module")
def mock_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str]]:
    """(url, endpoint, replay endpoint) of a mock engine configured like the fleet's."""
    run = Path(tmp_path_factory.mktemp("kvc"))
    endpoint = f"ipc://{run}/mock.sock"
    replay = f"ipc://{run}/mock-replay.sock"
    c = Cluster()
    try:
        m = c.mock(
            "kv-mock",
            engine_args=[
                "--engine",
                "--block-size",
                "32",
                "--kv-tokens",
                str(64 * 32),
                "--decode-ms",
                "2",
                "--kv-events",
                endpoint,
                "--kv-events-replay",
                replay,
            ],
        )
        yield m.url, endpoint, replay
    finally:
        c.close()


def _sides(fleet: Fleet, mock_engine: tuple[str, str, str]) -> Iterator[Side]:
    ctx = zmq.Context.instance()
    e = fleet.engines[0]
    real_bs = int(cache_config(e)["block_size"])
    mock_url, mock_endpoint, _ = mock_engine
    mock_bs = _mock_block_size(mock_url)
    for name, url, model, endpoint, topic, bs in (
        ("vllm", e.url, e.model, e.kv_events_endpoint, e.kv_topic, real_bs),
        ("mock", mock_url, "mock-model", mock_endpoint, "kv", mock_bs),
    ):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
        yield Side(name, url, model, endpoint, topic.encode(), bs, sock)


def _mock_block_size(url: str) -> int:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return int(line.split('block_size="', 1)[1].split('"', 1)[0])
    raise AssertionError("the mock exports no vllm:cache_config_info")


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def _stored(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("type") == "BlockStored"]


def _observe(side: Side) -> dict[str, Any]:
    """Drive one engine through store, repeat, extend and evict; the stream's shape."""
    salt = f"{side.name[0]}{time.monotonic_ns() % 1000}"
    side.drain()  # whatever earlier traffic left
    # ~600 and ~1100 tokens on the real engine (5 and 9 blocks), ~230 and ~420 on the mock
    # (7 and 13 blocks of 32): both well under max_model_len.
    base = _words(salt, 120)
    n1, ev1 = side.complete(base)
    n1b, ev1b = side.complete(base)
    n2, ev2 = side.complete(base + " " + _words(salt + "x", 80))
    first, again, ext = _stored(ev1), _stored(ev1b), _stored(ev2)
    assert len(first) == 1 and not again and len(ext) == 1, (side.name, first, again, ext)
    bs = side.block_size
    assert len(first[0]["block_hashes"]) == n1 // bs and n1 == n1b
    assert first[0]["parent_block_hash"] is None
    assert len(ext[0]["block_hashes"]) == n2 // bs - n1 // bs
    assert ext[0]["parent_block_hash"] == first[0]["block_hashes"][-1]
    tail = ext[0]["block_hashes"][-1]
    # Fill the cache with other prompts until the extended prompt's blocks are evicted.
    mine = set(first[0]["block_hashes"]) | set(ext[0]["block_hashes"])
    removed: list[int] = []
    for j in range(FILL_MAX):
        _, ev = side.complete(_words(f"{salt}f{j}", 200))
        removed += [h for e in ev if e.get("type") == "BlockRemoved" for h in e["block_hashes"]]
        if tail in removed:
            break
    ours = [h for h in removed if h in mine]
    assert ours and ours[0] == tail, f"{side.name}: the extension's tail is evicted first"

    shape: dict[str, set[Any]] = {"frames": set(), "topic": set(), "batch": set(), "keys": set()}
    seqs = []
    for m in side.messages:
        shape["frames"].add(len(m))
        shape["topic"].add(m[0])
        seqs.append(int.from_bytes(m[1], "big", signed=True))
        payload = msgspec.msgpack.decode(m[2])
        shape["batch"].add((len(payload), type(payload[0]).__name__, type(payload[-1]).__name__))
        for got in decode(m).events:  # and the router reads it
            if isinstance(got, Stored):
                # The router keys a block on its ids as they came (router/engine/kv_index.py):
                # vLLM must write them as msgspec does, shortest forms.
                ids = msgspec.msgpack.decode(got.token_ids)
                assert bytes(got.token_ids) == msgspec.msgpack.encode(ids)
        kinds = [e["type"] for e in payload[1]]
        if "BlockStored" in kinds and "BlockRemoved" in kinds:
            # eviction makes room first, then the new blocks are stored
            assert kinds.index("BlockStored") > max(
                i for i, k in enumerate(kinds) if k == "BlockRemoved"
            )
        for e in payload[1]:
            shape["keys"].add((e["type"], tuple(sorted(e))))
            if e["type"] == "BlockRemoved":
                assert len(e["block_hashes"]) == 1, "one BlockRemoved per block"
            if e["type"] in ("BlockStored", "BlockRemoved"):
                assert e["medium"] == "GPU" and e["group_idx"] == 0
                for h in e["block_hashes"]:
                    assert isinstance(h, int) and 0 <= h <= MASK64
            if e["type"] == "BlockStored":
                n = len(e["block_hashes"])
                assert e["block_size"] == bs and len(e["token_ids"]) == n * bs
                assert e["lora_name"] is None and e["lora_id"] is None
                assert e["extra_keys"] == [None] * n
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"{side.name}: seq counts up by 1"
    return shape


def test_mock_kv_events_have_vllms_shape(fleet: Fleet, mock_engine: tuple[str, str, str]) -> None:
    sides = list(_sides(fleet, mock_engine))
    try:
        real, mock = (_observe(s) for s in sides)
    finally:
        for s in sides:
            s.sock.close(0)
    assert real["frames"] == mock["frames"] == {3}
    assert real["topic"] == mock["topic"] == {b"kv"}
    assert real["batch"] == mock["batch"]
    assert real["keys"] == mock["keys"], {"vllm": real["keys"], "mock": mock["keys"]}


def test_event_sources_match_and_replay_answers_as_the_router_expects(
    fleet: Fleet, mock_engine: tuple[str, str, str]
) -> None:
    e = fleet.engines[0]
    real = httpx.get(e.url + "/kv_event_sources", timeout=5).json()
    mock = httpx.get(mock_engine[0] + "/kv_event_sources", timeout=5).json()
    assert set(real) == set(mock) == {"0"}
    assert set(real["0"]) == set(mock["0"]), (real, mock)
    assert real["0"]["endpoint"] == e.kv_events_endpoint
    assert mock["0"]["endpoint"] == mock_engine[1]
    assert mock["0"]["replay_endpoint"] == mock_engine[2]

    for url, model, replay in (
        (e.url, e.model, e.kv_replay_endpoint),
        (mock_engine[0], "mock-model", mock_engine[2]),
    ):
        assert _replayed(url, model, replay), url


def _replayed(url: str, model: str, replay: str) -> list[int]:
    """Ask the replay socket for everything after a new store: consecutive seqs, then -1."""
    httpx.post(
        url + "/v1/completions",
        json={
            "model": model,
            "prompt": _words(f"r{time.monotonic_ns() % 1000}", 100),
            "max_tokens": 1,
        },
        timeout=60,
    ).raise_for_status()
    time.sleep(QUIET_S)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert sock.poll(5000), "the replay socket answered and ended"
            frames = sock.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq < 0:
                assert frames[1] == b"" and frames[3] == b""
                break
            assert decode(frames[1:]).seq == seq
            seqs.append(seq)
    finally:
        sock.close(0)
    assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    return seqs


def test_calibration_reads_the_engines_own_costs(fleet: Fleet) -> None:
    e = fleet.engines[0]
    cal = Calibration()

    def scrape() -> None:
        p = parse(httpx.get(e.metrics_url, timeout=10).content, "vllm")
        cal.update(p.counters, p.running)

    scrape()
    ttfts: list[tuple[float, int]] = []
    itls: list[float] = []
    salt = f"c{time.monotonic_ns() % 1000}"
    for i in range(4):  # uncached prompts, one at a time: prefill alone decides their TTFT
        body = {
            "model": e.model,
            "prompt": _words(f"{salt}p{i}", 200),  # ~1.4k tokens
            "max_tokens": 24,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        t0 = time.monotonic()
        stamps: list[float] = []
        prompt = 0
        with httpx.stream("POST", e.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices"):
                    stamps.append(time.monotonic())
                if event.get("usage"):
                    prompt = int(event["usage"]["prompt_tokens"])
        ttfts.append((stamps[0] - t0, prompt))
        itls.append((stamps[-1] - stamps[0]) / max(1, len(stamps) - 1))
    time.sleep(0.3)  # the last request's histograms are in
    scrape()
    assert cal.prefill_s_per_token is not None and cal.step_s_per_seq is not None
    # Prefill is part of TTFT: the learned cost of a prompt is positive and below what the
    # client waited for its first token (seconds per token, not ms, not per request).
    waited = sum(t for t, _ in ttfts)
    assert 0 < cal.prefill_s_per_token * sum(n for _, n in ttfts) <= waited
    # One sequence running: a decode step is what the client saw between tokens.
    mean_itl = sum(itls) / len(itls)
    assert 0.2 * mean_itl <= cal.step_s_per_seq <= 5 * mean_itl, (cal.step_s_per_seq, mean_itl)
