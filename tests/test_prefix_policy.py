"""Cache-aware routing's pure parts: the prompt's block-hash chain, the prefix index, and the
`cache_aware` policy's choice between cached prefix and load (bounded loads, spill)."""

from __future__ import annotations

import random
from types import MappingProxyType

from balancers.base import Candidate
from balancers.cache_aware import CacheAware, PrefixMatch, PrefixPick
from balancers.inflight.local import LocalInflight
from balancers.prefix_index import PrefixIndex
from router.core.backend import Backend
from router.core.engine import EngineReading
from router.core.settings import AffinityConfig
from router.request.affinity import Affinity
from router.request.prefix import block_hashes, prefix_hashes, prompt_text

SYSTEM = "You are a careful assistant. " * 40  # 1160 characters


def chat(*turns: str, **extra: object) -> dict[str, object]:
    roles = ("user", "assistant")
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return {"model": "m", "messages": messages, **extra}


def test_a_follow_up_turn_extends_the_first_turns_chain() -> None:
    first = prefix_hashes(chat("What is a KV cache? " * 20), 64, 1 << 20)
    second = prefix_hashes(chat("What is a KV cache? " * 20, "It is..." * 30, "And?"), 64, 1 << 20)
    assert len(first) >= 20 and len(second) > len(first)
    assert second[: len(first)] == first
    # Another system prompt shares nothing, not even later blocks equal in text.
    other = prefix_hashes({"messages": [{"role": "system", "content": "x" + SYSTEM}]}, 64, 1 << 20)
    assert not set(other) & set(first)


def test_roles_tools_and_content_parts_are_part_of_the_prefix() -> None:
    as_user = {"messages": [{"role": "user", "content": SYSTEM}]}
    as_system = {"messages": [{"role": "system", "content": SYSTEM}]}
    assert prefix_hashes(as_user, 64, 4096)[0] != prefix_hashes(as_system, 64, 4096)[0]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert prefix_hashes(chat(tools=tools), 64, 4096)[0] != prefix_hashes(chat(), 64, 4096)[0]
    parts = [{"type": "text", "text": SYSTEM}, {"type": "image_url", "image_url": {"url": "u"}}]
    text = prompt_text({"messages": [{"role": "user", "content": parts}]}, 1 << 20)
    assert '"image_url"' in text and SYSTEM in text.replace("\\n", "\n")
    # Key order in a part does not change the hash (canonical JSON).
    flipped = [{"text": SYSTEM, "type": "text"}, {"image_url": {"url": "u"}, "type": "image_url"}]
    assert prefix_hashes({"messages": [{"role": "user", "content": parts}]}, 64, 4096) == (
        prefix_hashes({"messages": [{"role": "user", "content": flipped}]}, 64, 4096)
    )


def test_bad_shapes_give_no_hashes_or_capped_ones_never_an_error() -> None:
    assert prefix_hashes({"model": "m", "input": "embed me " * 100}, 64, 4096) == []
    assert prefix_hashes({"messages": "not a list", "prompt": None}, 64, 4096) == []
    assert len(prefix_hashes({"messages": [None, 3, {"role": 7, "content": None}]}, 8, 4096)) == 1
    assert len(prefix_hashes({"prompt": [1, 2, 3] * 1000}, 64, 4096)) == 4096 // 64
    assert len(prefix_hashes({"prompt": "x" * 10_000_000}, 256, 128 * 1024)) == 512
    assert prefix_hashes({"prompt": "short"}, 256, 4096) == []
    # Non-ASCII: blocks are characters, not bytes; a lone surrogate does not raise.
    assert len(block_hashes("é" * 640 + "\udc80", 64)) == 10


def test_index_matches_true_prefixes_and_forgets_the_tail_first() -> None:
    idx = PrefixIndex()
    chain = [bytes([i]) * 8 for i in range(10)]
    idx.record(chain, "a", 100)
    idx.record(chain[:4], "b", 100)
    assert idx.match(chain, ["a", "b", "c"]) == {"a": 10, "b": 4}
    assert idx.match([b"z" * 8, *chain[1:]], ["a", "b"]) == {}
    # Bounded: room for 6 blocks keeps the head of the prompt, not its tail.
    idx.record(chain, "c", 6)
    assert idx.match(chain, ["c"]) == {"c": 6}
    assert idx.entries == 10 + 4 + 6
    idx.forget("a")
    assert idx.match(chain, ["a", "b"]) == {"b": 4} and idx.entries == 10
    small = PrefixIndex(max_backends=2)
    for name in ("x", "y", "z"):
        small.record(chain, name, 100)
    assert small.match(chain, ["x", "y", "z"]) == {"y": 10, "z": 10}


def reading(running: float, kv: float = 0.0) -> EngineReading:
    return EngineReading(0.0, running, kv, 65536, None, 1.0, 1)


def test_the_prefix_outweighs_a_little_load_but_not_the_bound() -> None:
    bal = CacheAware(random.Random(1))
    # 8000 characters = 2000 tokens: worth two requests of queueing.
    match = PrefixMatch(blocks=32, block_chars=256, held={"a": 32})
    a, b, c = (Candidate(n, 1.0, 0, reading(r)) for n, r in (("a", 3), ("b", 2), ("c", 2)))
    pick = bal.with_prefix(match, 1.25)
    assert pick.pick([a, b, c]) == a and (pick.reason, pick.held) == ("prefix", 32)
    # Far above the mean (cap = ceil(1.25 x (10 + 1) / 3) = 5): it spills to the least loaded.
    a = Candidate("a", 1.0, 0, reading(8))
    b, c = Candidate("b", 1.0, 0, reading(2)), Candidate("c", 1.0, 0, reading(0))
    pick = bal.with_prefix(match, 1.25)
    assert pick.pick([a, b, c]) == c and (pick.reason, pick.held) == ("spill", 0)
    # A looser bound keeps it on the holder only while the cache is worth the queue.
    pick = bal.with_prefix(match, 4.0)
    assert pick.pick([a, b, c]) == c and pick.reason == "load"
    # The holder excluded (its attempt failed) or absent: plain least_load, reason load.
    pick = bal.with_prefix(match, 1.25)
    assert pick.pick([a, b, c], exclude={"a"}) == c and pick.reason == "load"
    assert bal.with_prefix(PrefixMatch(0, 256, {}), 1.25).pick([b, c]) == c


def _backends(*names: str) -> list[Backend]:
    return [Backend(n, "http://127.0.0.1:1", "vllm", MappingProxyType({"m": "m"})) for n in names]


def test_a_hot_prefix_spreads_over_holders_and_never_melts_one() -> None:
    """Requests in flight through the store: the first holder fills to the bound, the spill
    target joins the holders, and the burst ends spread while every one still hits a holder."""
    affinity = Affinity(AffinityConfig(block_chars=64, capacity_tokens=65536))
    store, bal = LocalInflight(), CacheAware(random.Random(3))
    backends = _backends("a", "b", "c", "d")
    hashes = affinity.hashes(bal, chat("Summarise our contract. " * 400))
    assert hashes
    affinity.dispatched(hashes, "a", None)
    picked, reasons = [], []
    for _ in range(16):
        picker = affinity.bind(bal, hashes, backends)
        lease = store.acquire_now(backends, picker, set())
        assert lease is not None
        affinity.dispatched(hashes, lease.backend, None)
        picked.append(lease.backend)
        assert isinstance(picker, PrefixPick)
        reasons.append(picker.reason)
    counts = {n: picked.count(n) for n in "abcd"}
    assert max(counts.values()) <= 5, counts  # 16 over 4 with bounded loads
    assert "spill" in reasons and reasons[0] == "prefix"
    assert reasons.count("prefix") >= 12  # once joined, the holders share the burst
