"""Cache-aware routing's pure parts: the prompt's block-hash chain, the prefix index, and the
`cache_aware` policy's choice between cached prefix and load (bounded loads, spill)."""

from __future__ import annotations

import random
from types import MappingProxyType

from balancers.base import Candidate, Choice
from balancers.cache_aware import CacheAware, Hints
from balancers.context import PickContext
from balancers.inflight.local import LocalInflight
from balancers.prefix_index import PrefixIndex
from balancers.session_ring import Ring, point
from router.core.backend import Backend
from router.core.engine import EngineReading
from router.core.settings import AffinityConfig
from router.request.placement.affinity import MAX_SESSION_KEY_CHARS, Affinity
from router.request.placement.prefix import block_hashes, prefix_hashes, prompt_text
from tests.support.picking import Bound

SYSTEM = "You are a careful assistant. " * 40  # 1160 characters


def chose(choice: Choice | None) -> tuple[Candidate | None, str, int]:
    """A pick as (candidate, reason, prefix blocks held); (None, "", 0) when none was left."""
    return (choice.candidate, choice.reason, choice.held) if choice else (None, "", 0)


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


def test_the_cap_cuts_the_canonical_prompt_wherever_it_falls() -> None:
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    long_turn = {"role": "assistant", "content": "long " * 2000, "tool_calls": calls}
    payload = chat("short", tools=[{"type": "function"}])
    payload["messages"].append(long_turn)  # type: ignore[attr-defined]
    whole = prompt_text(payload, 1 << 24)
    assert whole.endswith('"type":"function"}]')  # the tool calls follow the long content
    for limit in (0, 1, 50, len(SYSTEM), len(whole) - 5, len(whole), len(whole) + 5):
        assert prompt_text(payload, limit) == whole[:limit]
    prompt = {"prompt": "p" * 10_000}
    assert prompt_text(prompt, 4096) == "p" * 4096


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


def reading(
    running: float,
    kv: float = 0.0,
    waiting: float = 0.0,
    seq: int = 1,
    capacity: int | None = 65536,
) -> EngineReading:
    return EngineReading(waiting, running, kv, capacity, None, 1.0, seq)


def test_the_prefix_outweighs_a_little_load_but_not_the_bound() -> None:
    bal = CacheAware(random.Random(1))
    # 8192 characters = 2048 tokens: worth 8 requests in flight elsewhere. No engine readings
    # here: the score is the in-flight count, like the bound.
    match = Hints(blocks=32, block_chars=256, held={"a": 32})
    a, b, c = Candidate("a", 1.0, 3), Candidate("b", 1.0, 2), Candidate("c", 1.0, 2)
    pick = Bound(bal, PickContext(hints=match, load_factor=1.25))
    assert chose(pick.pick([a, b, c])) == (a, "prefix", 32)
    # Far above the mean (cap = ceil(1.25 x (10 + 1) / 3) = 5): it spills to the least loaded.
    a, b, c = Candidate("a", 1.0, 8), Candidate("b", 1.0, 2), Candidate("c", 1.0, 0)
    pick = Bound(bal, PickContext(hints=match, load_factor=1.25))
    assert chose(pick.pick([a, b, c])) == (c, "spill", 0)
    # A looser bound keeps it on the holder only while the cache is worth the queue.
    pick = Bound(bal, PickContext(hints=match, load_factor=4.0))
    assert chose(pick.pick([a, b, c]))[:2] == (a, "prefix")
    a = Candidate("a", 1.0, 12)
    assert chose(pick.pick([a, b, c]))[:2] == (c, "spill")
    # The holder excluded (its attempt failed) or absent: plain least_load, reason load.
    pick = Bound(bal, PickContext(hints=match, load_factor=1.25))
    assert chose(pick.pick([a, b, c], exclude={"a"}))[:2] == (c, "load")
    assert (
        Bound(bal, PickContext(hints=Hints(0, 256, {}), load_factor=1.25)).pick([b, c]).candidate
        == c
    )
    # With engine readings the cost is time: a busy batch and a half-full KV cache do not cost
    # our first token a prefill, a queue does. A holder whose engine queues hidden load loses,
    # one that only runs a big batch keeps the prompt.
    busy = Candidate("a", 1.0, 0, reading(running=12, kv=0.6))
    cool = Candidate("b", 1.0, 0, reading(running=1, kv=0.1))
    pick = Bound(bal, PickContext(hints=match, load_factor=1.25))
    assert chose(pick.pick([busy, cool]))[:2] == (busy, "prefix")
    # A queue costs the holder its prefills; a copy on `cool` costs its own prefill and, its
    # cache evicting as much, that prefill once more later: (1 + 1) x (1 + 1 running) = 4.
    queuing = Candidate("a", 1.0, 0, reading(running=16, kv=0.6, waiting=3))
    assert chose(pick.pick([queuing, cool]))[:2] == (queuing, "prefix")  # 3 ahead < 4
    queuing = Candidate("a", 1.0, 0, reading(running=16, kv=0.6, waiting=5))
    assert chose(pick.pick([queuing, cool]))[:2] == (cool, "spill")  # 5 ahead > 4
    # Among equal costs (no holder, no queue) the least loaded wins, as with least_load.
    other = Candidate("c", 1.0, 0, reading(running=3, kv=0.1))
    assert (
        Bound(bal, PickContext(hints=Hints(32, 256, {}), load_factor=1.25))
        .pick([other, busy, cool])
        .candidate
        == cool
    )


def test_a_follow_up_is_not_turned_away_by_its_own_finished_first_turn() -> None:
    """The holder's reading was scraped while the first turn waited there and is first seen at
    the follow-up's pick, that turn long ended: with the count at the scrape it is an idle
    holder, not a queue worth a prefill elsewhere."""
    match = Hints(blocks=32, block_chars=256, held={"a": 31})
    caught = EngineReading(1.0, 0.0, 0.01, 65536, None, 1.0, 2, inflight_at=1)
    idle = Candidate("c", 1.0, 0, reading(running=0))
    pick = Bound(CacheAware(random.Random(1)), PickContext(hints=match, load_factor=1.25))
    choice = pick.pick([Candidate("a", 1.0, 0, caught), idle])
    assert choice is not None and (choice.candidate.name, choice.reason) == ("a", "prefix")
    # Not knowing the count at the scrape, the queued requests could be anyone's: past what a
    # copy on c costs (its prefill, and as much evicted there: 2 prefills), it moves.
    blind = EngineReading(3.0, 0.0, 0.01, 65536, None, 1.0, 2)
    pick = Bound(CacheAware(random.Random(1)), PickContext(hints=match, load_factor=1.25))
    assert pick.pick([Candidate("a", 1.0, 0, blind), idle]).candidate.name == "c"


def test_a_holder_keeps_its_prompt_until_its_queue_costs_more_than_a_copy() -> None:
    """With engine readings the count bound is not what moves a prompt (under KV pressure it
    moved prefixes back and forth, issue 52): the holder keeps it while the work queued there
    costs less than a copy elsewhere, the copy's prefill and as much evicted there, prefilled
    again later (docs/balancers.md#cache_aware)."""
    match = Hints(blocks=32, block_chars=256, held={"a": 32})  # 2048 tokens
    others = [Candidate("b", 1.0, 3, reading(3, 0.3)), Candidate("c", 1.0, 2, reading(2, 0.2))]

    def pick(a: Candidate) -> tuple[str, str]:
        p = Bound(CacheAware(random.Random(1)), PickContext(hints=match, load_factor=1.25))
        chosen = p.pick([a, *others])
        assert chosen is not None
        return chosen.candidate.name, chosen.reason

    # 6 in flight against 3 and 2 (past the count bound): the engine absorbs it, it stays.
    assert pick(Candidate("a", 1.0, 6, reading(6, 0.4))) == ("a", "prefix")
    # A copy on c costs (1 + 1) prefills x (1 + its 2 running) = 6 prefills of the prompt.
    assert pick(Candidate("a", 1.0, 6, reading(6, 0.4, waiting=5))) == ("a", "prefix")
    assert pick(Candidate("a", 1.0, 6, reading(6, 0.4, waiting=7))) == ("c", "spill")
    # Its free KV no longer holds this prompt: one more ahead, still cheaper than a copy.
    assert pick(Candidate("a", 1.0, 6, reading(6, 0.98))) == ("a", "prefix")
    # Without a reading the count bound alone decides (as in the test above).
    assert pick(Candidate("a", 1.0, 6)) == ("c", "spill")


def test_a_prefix_evicted_everywhere_goes_back_to_its_home() -> None:
    """Nobody holds the prompt any more (evicted under pressure): it goes to its home, not to
    the least loaded, unless the home's queue costs more than the copy elsewhere would; a home
    not among the candidates (gone, draining, excluded) leaves it to load."""
    bal = CacheAware(random.Random(1))
    home = Hints(blocks=32, block_chars=256, held={}, home="a", home_blocks=30)
    busier = Candidate("a", 1.0, 2, reading(2, 0.2))
    idle = Candidate("b", 1.0, 1, reading(1, 0.1))
    pick = Bound(bal, PickContext(hints=home))
    # The index no longer guesses it there, but its home is taken to hold its homed blocks
    # (the index's LRU guess forgets what the engine keeps): home (2/32) x (1 + 2 running)
    # = 0.19; b: (1 + 30/32) x (1 + 1) = 3.9. A queue of 3 is still cheaper than the copy.
    assert chose(pick.pick([busier, idle]))[:2] == (busier, "home")
    queuing = Candidate("a", 1.0, 2, reading(2, 0.2, waiting=3))
    assert chose(pick.pick([queuing, idle]))[:2] == (queuing, "home")  # 3.19 < 3.9
    queuing = Candidate("a", 1.0, 2, reading(2, 0.2, waiting=4))
    assert chose(pick.pick([queuing, idle]))[:2] == (idle, "spill")  # 4.19 > 3.9
    assert chose(pick.pick([busier, idle], exclude={"a"}))[:2] == (idle, "load")
    # A copy cached off its home (a guest) pays for the room it takes there: with b busier
    # it goes home (1 x 2 = 2 against 30/32 x 3 = 2.8).
    guest = Hints(blocks=32, block_chars=256, held={"b": 32}, home="a", home_blocks=30)
    pick = Bound(bal, PickContext(hints=guest))
    home_idle = Candidate("a", 1.0, 1, reading(1, 0.1))
    guest_busy = Candidate("b", 1.0, 2, reading(2, 0.2))
    assert chose(pick.pick([home_idle, guest_busy]))[:2] == (home_idle, "home")
    # A new group's proposed home yields to whoever holds it (a prefix filled behind our back).
    hidden = Hints(32, 256, {"b": 32}, home="a", home_blocks=32, home_new=True)
    pick = Bound(bal, PickContext(hints=hidden))
    assert chose(pick.pick([home_idle, guest_busy]))[:2] == (guest_busy, "prefix")


def _backends(*names: str) -> list[Backend]:
    return [Backend(n, "http://127.0.0.1:1", "vllm", MappingProxyType({"m": "m"})) for n in names]


def test_a_hot_prefix_spreads_over_holders_and_never_melts_one() -> None:
    """Requests in flight through the store: the first holder fills to the bound, the spill
    target joins the holders, and the burst ends spread while every one still hits a holder."""
    affinity = Affinity(AffinityConfig(block_chars=64, capacity_tokens=65536))
    store, bal = LocalInflight(), CacheAware(random.Random(3))
    backends = _backends("a", "b", "c", "d")
    request = affinity.prepare(bal, [], chat("Summarise our contract. " * 400))
    assert request is not None and request.hashes and request.session is None
    affinity.dispatched(request.hashes, "a", None)
    picked, reasons = [], []
    for _ in range(16):
        ctx = PickContext(hints=affinity.hints(request, backends))
        lease = store.acquire_now(backends, bal, ctx)
        assert lease is not None and lease.choice is not None
        affinity.dispatched(request.hashes, lease.backend, None)
        picked.append(lease.backend)
        reasons.append(lease.choice.reason)
    counts = {n: picked.count(n) for n in "abcd"}
    assert max(counts.values()) <= 5, counts  # 16 over 4 with bounded loads
    assert "spill" in reasons and reasons[0] == "prefix"
    assert reasons.count("prefix") >= 12  # once joined, the holders share the burst


def test_the_session_key_comes_from_header_then_prompt_cache_key_then_user() -> None:
    cfg = AffinityConfig(session_headers=["X-Session-Id", "x-conversation"])
    aff = Affinity(cfg)
    body = {"prompt_cache_key": "pck", "user": "u"}
    assert aff.session_key([(b"x-conversation", b"conv")], body) == "conv"
    assert aff.session_key([(b"x-session-id", b"s"), (b"x-conversation", b"c")], body) == "s"
    assert aff.session_key([], body) == "pck"
    assert aff.session_key([], {"user": "u", "prompt_cache_key": 5}) == "u"
    assert aff.session_key([], {"user": ["not", "a", "string"]}) is None
    # A 10 MB key is ignored (served without session affinity), never hashed whole.
    assert aff.session_key([], {"user": "k" * 10_000_000}) is None
    assert aff.session_key([], {"user": "k" * MAX_SESSION_KEY_CHARS}) is not None
    assert aff.prepare(CacheAware(), [], {"user": "k" * 10_000_000}) is None


def test_the_ring_moves_only_the_new_backends_share() -> None:
    keys = [point(f"session-{i}") for i in range(4000)]
    three, four = Ring(["a", "b", "c"]), Ring(["a", "b", "c", "d"])
    before = [next(three.walk(k)) for k in keys]
    after = [next(four.walk(k)) for k in keys]
    moved = [(x, y) for x, y in zip(before, after, strict=True) if x != y]
    assert all(y == "d" for _, y in moved)  # nobody moves between the old three
    assert 0.15 < len(moved) / len(keys) < 0.35  # about 1/4
    assert sorted(set(before)) == ["a", "b", "c"]
    assert len(list(four.walk(keys[0]))) == 4  # the walk meets every backend once


def test_a_session_sticks_under_the_bound_and_walks_the_ring_past_it() -> None:
    bal = CacheAware(random.Random(1))
    session = point("user-42")
    home = next(Ring(["a", "b", "c"]).walk(session))
    idle = [Candidate(n, 1.0, 0, reading(0)) for n in ("a", "b", "c")]
    by_name = {c.name: c for c in idle}
    pick = Bound(bal, PickContext(hints=Hints(0, 256, {}, session), load_factor=1.25))
    assert all(chose(pick.pick(idle))[:2] == (by_name[home], "session") for _ in range(20))
    busy = [Candidate(n, 1.0, 9 if n == home else 1, reading(1)) for n in ("a", "b", "c")]
    second = list(Ring(["a", "b", "c"]).walk(session))[1]
    pick = Bound(bal, PickContext(hints=Hints(0, 256, {}, session), load_factor=1.25))
    choice = pick.pick(busy)
    assert choice is not None and (choice.candidate.name, choice.reason) == (second, "spill")
    # Its home excluded (a failed attempt): the next one on the ring, never the excluded.
    assert pick.pick(idle, exclude={home}).candidate.name == second


def test_a_stale_or_unread_engine_reading_moves_no_session() -> None:
    """Just after start every reading is unread (stale); later one engine's scrape may lag.
    Neither moves a session off its home: only the in-flight counts bound it."""
    bal = CacheAware(random.Random(3))
    names = ("a", "b", "c")
    keys = [point(f"user-{i}") for i in range(40)]
    ring = Ring(list(names))
    homes = [next(ring.walk(k)) for k in keys]
    assert set(homes) == set(names)
    unread = EngineReading(0.0, 0.0, 0.0, None, None, 0.0, 0, stale=True)
    for stale in (set(names), {"a"}):
        pool = [Candidate(n, 1.0, 0, unread if n in stale else reading(0)) for n in names]
        for k, home in zip(keys, homes, strict=True):
            pick = Bound(bal, PickContext(hints=Hints(0, 256, {}, k), load_factor=1.25))
            assert chose(pick.pick(pool))[:2] == (pool[names.index(home)], "session")


def test_the_redis_store_picks_with_the_hints() -> None:
    """Through the shared store the hinted choice and reason hold, and the lease counts."""
    import asyncio

    from balancers.inflight.redis import RedisInflight
    from tests.support.harness import Cluster

    c = Cluster()
    try:
        redis = c.redis()

        async def run() -> tuple[str, str, dict[str, int]]:
            store = RedisInflight(redis.url, timeout=1.0, heartbeat=False)
            await store.start()
            try:
                readings = {n: reading(1) for n in ("a", "b", "c")}
                hints = Hints(blocks=32, block_chars=256, held={"b": 32})
                bal = CacheAware(random.Random(2))
                ctx = PickContext(hints=hints, load_factor=1.25)
                lease = await store.acquire(_backends("a", "b", "c"), bal, ctx, readings)
                assert lease is not None and lease.choice is not None
                return lease.backend, lease.choice.reason, await store.counts(["a", "b", "c"])
            finally:
                await store.aclose()

        assert asyncio.run(run()) == ("b", "prefix", {"a": 0, "b": 1, "c": 0})
    finally:
        c.close()
