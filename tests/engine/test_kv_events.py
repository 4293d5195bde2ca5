"""KV-cache events: vLLM's wire format decoded, the token-level index, and the subscriber on real
ZMQ sockets (ipc paths under the test's own directory; tcp on loopback for the bind case)."""

from __future__ import annotations

import asyncio
import functools
import math
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from router.core.backend import Backend
from router.core.runner import Runner
from router.core.settings import BackendConfig
from router.engine.kv_events import CHURN_TAU, RETRY, Feed, KvEvents, _feeds_from, resolve
from router.engine.kv_index import TokenIndex, chain_keys, namespace
from router.engine.kv_wire import (
    MASK64,
    Cleared,
    Removed,
    Stored,
    WireError,
    decode,
    token_list,
)
from tests.support.clock import ManualClock, settle, until
from tests.support.kv_publisher import Publisher, cleared, frames, removed, stored
from tests.support.wait import wait_for_async

BS = 4


def run(fn: Callable[..., Any]) -> Callable[..., None]:
    """The async test's body on its own event loop (the suite runs no asyncio plugin)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return wrapper


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("array", [False, True])
def test_both_encodings_decode_to_the_same_events(array: bool) -> None:
    big = (1 << 64) - 5  # above 2^63, as vLLM's unsigned low 64 bits often are
    batch = decode(
        frames(
            7,
            [
                stored([big, 2], None, toks(8), BS, array=array),
                removed([big], array=array),
                cleared(array=array),
            ],
            ts=12.5,
        )
    )
    assert batch.seq == 7 and batch.ts == 12.5 and batch.unknown == 0
    s, r, c = batch.events
    assert isinstance(s, Stored) and s.hashes == [big, 2] and s.parent is None
    assert token_list(s) == toks(8) and s.block_size == BS and s.medium == "GPU"
    assert isinstance(r, Removed) and r.hashes == [big]
    assert isinstance(c, Cleared)


def test_signed_and_bytes_hashes_and_unknown_types() -> None:
    from tests.support.kv_publisher import FutureEvent

    batch = decode(
        frames(0, [stored([-3, b"\x01\x02"], -4, toks(8), BS), FutureEvent(), removed([-3])])
    )
    s, r = batch.events
    assert isinstance(s, Stored) and isinstance(r, Removed)
    assert s.hashes == [(-3) & MASK64, b"\x01\x02"] and s.parent == (-4) & MASK64
    assert r.hashes == [(-3) & MASK64]  # the same block, whichever spelling
    assert batch.unknown == 1


def test_a_batch_without_rank_and_garbage() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "AllBlocksCleared"}]])
    assert isinstance(decode([b"", (3).to_bytes(8, "big"), payload]).events[0], Cleared)
    with pytest.raises(WireError):
        decode([b"kv", b"\x00" * 8, b"\xc1junk"])
    with pytest.raises(WireError):
        decode([b"kv", b"short", payload])


def _ev(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> Stored:
    raw = msgspec.Raw(msgspec.msgpack.encode(tokens))
    return Stored(hashes, parent, raw, BS, kw.get("lora"), kw.get("extra"), "GPU", 0)  # type: ignore[arg-type]


def test_index_chains_over_tokens_and_resolves_removals() -> None:
    idx = TokenIndex()
    prompt = toks(12)
    # Engine hashes are opaque to the router: two engines, two hash spellings, one key chain.
    assert idx.stored("a", _ev([11, 12], None, prompt[:8]), 100) == 2
    assert idx.stored("a", _ev([13], 12, prompt[8:12]), 100) == 1
    assert idx.stored("b", _ev([901, 902], None, prompt[:8]), 100) == 2
    keys = chain_keys([*prompt, 99, 98], BS)  # a partial tail block is not a key
    assert len(keys) == 3
    assert idx.match(keys, ["a", "b", "c"]) == {"a": 3, "b": 2}
    other = chain_keys(toks(12, start=1), BS)
    assert idx.match(other, ["a", "b"]) == {}
    idx.removed("a", [12])  # the middle block: a prefix walk stops before it
    assert idx.match(keys, ["a", "b"]) == {"a": 1, "b": 2}
    assert idx.blocks("a") == 2
    idx.cleared("b")
    assert idx.match(keys, ["a", "b"]) == {"a": 1}


def test_keys_agree_however_the_blocks_and_their_ids_came(monkeypatch: pytest.MonkeyPatch) -> None:
    # Ids of every msgpack width (1, 2, 3, 5 and 9 bytes): one block per event, or several
    # (split where a scan of their bytes finds each block's end), is keyed on the bytes as they
    # came; a count of ids that is not whole blocks, from their ints. All are the request's keys.
    prompt = [5, 200, 3000, 70_000, 127, 128, 65_535, 65_536, 2**40, 2**32 - 1, 255, 256]
    keys = chain_keys(prompt, BS)
    one, many, ragged = TokenIndex(), TokenIndex(), TokenIndex()
    with monkeypatch.context() as m:  # whole blocks in msgspec's forms: no id decoded
        m.setattr("router.engine.kv_index.token_list", lambda _ev: pytest.fail("decoded"))
        for i, h in enumerate((1, 2, 3)):
            one.stored("a", _ev([h], h - 1 if i else None, prompt[i * BS : (i + 1) * BS]), 100)
        many.stored("a", _ev([1, 2, 3], None, prompt), 100)
    assert ragged.stored("a", _ev([1, 2], None, prompt[: 2 * BS + 1]), 100) == 2
    assert one.match(keys, ["a"]) == many.match(keys, ["a"]) == {"a": 3}
    assert ragged.match(keys, ["a"]) == {"a": 2}

    # An encoder that writes ids in longer forms than msgspec (uint32 for all that fit):
    # still found.
    def wide(ids: list[int]) -> msgspec.Raw:
        return msgspec.Raw(
            bytes([0x90 + len(ids)])
            + b"".join(
                b"\xce" + t.to_bytes(4, "big") if t < 2**32 else b"\xcf" + t.to_bytes(8, "big")
                for t in ids
            )
        )

    other = TokenIndex()
    for i, h in enumerate((1, 2, 3)):
        ev = _ev([h], h - 1 if i else None, [])
        ev.token_ids = wide(prompt[i * BS : (i + 1) * BS])
        assert other.stored("a", ev, 100) == 1
    assert other.match(keys, ["a"]) == {"a": 3}

    # Ids that are not ints: the event is skipped, the next ones are keyed as ever.
    odd = TokenIndex()
    ev = _ev([9], None, [])
    ev.token_ids = msgspec.Raw(msgspec.msgpack.encode(["a", "b", "c", "d"]))
    assert odd.stored("a", ev, 100) == 0 and odd.skipped == 1
    odd.stored("a", _ev([1], None, prompt[:BS]), 100)
    assert odd.match(keys, ["a"]) == {"a": 1}


def test_a_block_under_two_engine_hashes_is_held_until_both_are_removed() -> None:
    idx = TokenIndex()
    keys = chain_keys(toks(4), BS)
    idx.stored("a", _ev([1], None, toks(4)), 100)
    idx.stored("a", _ev([2], None, toks(4)), 100)  # the same tokens, another engine hash
    idx.removed("a", [1])
    assert idx.match(keys, ["a"]) == {"a": 1}
    idx.removed("a", [2])
    assert idx.match(keys, ["a"]) == {}


def test_unknown_parent_is_skipped_and_capacity_bounds_each_engine() -> None:
    idx = TokenIndex()
    assert idx.stored("a", _ev([5], 4, toks(4)), 100) == 0  # parent never seen
    assert idx.skipped == 1
    for i in range(10):
        idx.stored("a", _ev([100 + i], None, toks(4, start=10 * i)), 3)
    assert idx.blocks("a") == 3  # the engine's own capacity, oldest first out
    assert idx.match(chain_keys(toks(4, start=90), BS), ["a"]) == {"a": 1}
    assert idx.match(chain_keys(toks(4, start=0), BS), ["a"]) == {}


def test_lora_and_extra_keys_stay_apart_from_base_blocks() -> None:
    idx = TokenIndex()
    prompt = toks(8)
    idx.stored("a", _ev([1, 2], None, prompt, lora="ad", extra=[["ad"], ["ad"]]), 100)
    idx.stored("a", _ev([3, 4], None, prompt, extra=[["salt"], ["salt"]]), 100)
    assert idx.match(chain_keys(prompt, BS), ["a"]) == {}
    assert idx.match(chain_keys(prompt, BS, namespace("ad")), ["a"]) == {"a": 2}
    assert idx.has_lora("a", "ad") and not idx.has_lora("a", "other")


def test_endpoints_follow_vllms_bind_rule() -> None:
    url = "http://10.1.2.3:8000"
    assert resolve("tcp://*:5557", url) == ("tcp://10.1.2.3:5557", False)
    assert resolve("tcp://[::]:5557", "http://[fd00::1]:8000") == ("tcp://[fd00::1]:5557", False)
    assert resolve("ipc:///run/kv.sock", url) == ("ipc:///run/kv.sock", False)
    assert resolve("tcp://10.9.9.9:5557", url) == ("tcp://10.9.9.9:5557", True)  # vLLM connects
    assert resolve("tcp://*:5557", url, bind=True) == ("tcp://*:5557", True)


def _backend(name: str, kv: dict[str, object], url: str = "http://127.0.0.1:9") -> Backend:
    return Backend.from_config(
        BackendConfig(name=name, url=url, models=["m"], kv_events=kv)  # type: ignore[arg-type]
    )


@pytest.fixture
def ipc(tmp_path: Path) -> Callable[[str], str]:
    return lambda name: f"ipc://{tmp_path}/{name}"


async def _subscribe(kv: KvEvents, pub: Publisher, probe_seq: int = 0) -> None:
    """Once the router's subscription reached the publisher, one message with `probe_seq`."""
    await pub.subscribed()
    pub.publish([], seq=probe_seq)
    await wait_for_async(lambda: kv.batches > 0, "first message")


@run
async def test_subscriber_follows_stores_removals_gaps_and_restarts(
    ipc: Callable[[str], str],
) -> None:
    seen: list[tuple[str, str, int]] = []
    kv = KvEvents(capacity=lambda _n: 100, on_events=lambda b, t, n: seen.append((b, t, n)))
    pub = Publisher(ipc("e1"))
    try:
        kv.sync([_backend("a", {"endpoint": ipc("e1"), "topic": "kv"})])
        assert kv.state("a") == "waiting" and not kv.live("a")
        await kv.start()
        await _subscribe(kv, pub)  # seq 0: a fresh engine, nothing missed
        assert kv.live("a")
        prompt = toks(8)
        pub.publish([stored([1, 2], None, prompt, BS)], ts=0.0)
        await wait_for_async(lambda: kv.index.blocks("a") == 2, "stored")
        keys = chain_keys(prompt, BS)
        assert kv.index.match(keys, ["a"]) == {"a": 2}
        st = kv.status("a")
        assert st is not None and st["state"] == "live" and st["events"]["BlockStored"] == 1
        # The counters get the counts within FLUSH_INTERVAL (the pump's timer), not per batch.
        await wait_for_async(lambda: ("a", "BlockStored", 1) in seen, "counts flushed")
        assert st["lag_seconds"] is not None and st["lag_seconds"] > 0  # ts 0: long ago

        pub.publish([removed([2])])
        await wait_for_async(lambda: kv.index.blocks("a") == 1, "removed")
        assert kv.index.match(keys, ["a"]) == {"a": 1}

        pub.publish([], seq=pub.seq + 3)  # a gap, no replay endpoint: unsure
        await wait_for_async(lambda: kv.state("a") == "unsure", "gap")
        assert not kv.live("a")
        pub.publish([cleared()])  # nothing held: exact again
        await wait_for_async(lambda: kv.live("a"), "cleared")

        pub.publish([stored([7], None, prompt[:4], BS)])
        await wait_for_async(lambda: kv.index.blocks("a") == 1, "stored again")
        pub.publish([], seq=0)  # the engine restarted: its cache is empty
        await wait_for_async(lambda: kv.index.blocks("a") == 0, "restart")
        assert kv.live("a") and kv.status("a")["restarts"] == 1  # type: ignore[index]
    finally:
        await kv.aclose()
        pub.close()


@run
async def test_messages_of_other_shapes_are_counted_and_the_next_batch_still_applies(
    ipc: Callable[[str], str],
) -> None:
    """A publisher that is not vLLM (or a later vLLM) sends messages of 1, 2 and 4 frames: each
    is one malformed message, read whole, and the batch after them is applied."""
    kv = KvEvents(capacity=lambda _n: 100)
    pub = Publisher(ipc("odd"))
    try:
        kv.sync([_backend("a", {"endpoint": ipc("odd"), "topic": "kv"})])
        await kv.start()
        await _subscribe(kv, pub)
        good = frames(1, [stored([1, 2], None, toks(8), BS)])
        for odd in (good[:1], good[:2], [*good, b"more"], [good[0], good[1], b"\xc1"]):
            pub.sock.send_multipart(odd)
        pub.sock.send_multipart(good)
        await wait_for_async(lambda: kv.index.blocks("a") == 2, "the batch after them")
        assert kv.malformed == 4 and kv.live("a")
        assert kv.index.match(chain_keys(toks(8), BS), ["a"]) == {"a": 2}
    finally:
        await kv.aclose()
        pub.close()


@run
async def test_a_restart_whose_first_batches_were_missed_drops_the_index(
    ipc: Callable[[str], str],
) -> None:
    """The restarted engine published before the router's socket reconnected, so seq 0 never
    arrived: its next batch is numbered at or below the last one applied but built after it,
    and the old index goes. A replay overlap (the same batch again, as old) is still ignored."""
    kv = KvEvents(capacity=lambda _n: 100)
    pub = Publisher(ipc("e5"))
    try:
        kv.sync([_backend("a", {"endpoint": ipc("e5")})])
        await kv.start()
        await _subscribe(kv, pub)
        old = toks(8)
        pub.publish([stored([1, 2], None, old, BS)], ts=10.0)  # seq 1
        pub.publish([], ts=11.0)  # seq 2
        await wait_for_async(lambda: kv.batches == 3, "before the restart")
        assert kv.index.match(chain_keys(old, BS), ["a"]) == {"a": 2}

        pub.publish([removed([2])], ts=10.0, seq=1)  # seq 1 again, as old: an overlap
        await wait_for_async(lambda: kv.batches == 4, "overlap")
        assert kv.index.blocks("a") == 2 and kv.status("a")["restarts"] == 0  # type: ignore[index]

        new = toks(4, start=100)
        pub.publish([stored([7], None, new, BS)], ts=20.0, seq=1)  # the new engine's second
        await wait_for_async(lambda: kv.status("a")["restarts"] == 1, "restart")  # type: ignore[index]
        assert kv.index.match(chain_keys(old, BS), ["a"]) == {}
        assert kv.index.match(chain_keys(new, BS), ["a"]) == {"a": 1}
        assert kv.state("a") == "unsure"  # its seq 0 was missed and there is no replay socket
    finally:
        await kv.aclose()
        pub.close()


@run
async def test_late_join_replays_from_the_engines_buffer(ipc: Callable[[str], str]) -> None:
    """The router starts after the engine stored blocks: the replay socket fills the hole."""
    pub = Publisher(ipc("e2"))
    replay = pub.ctx.socket(zmq.ROUTER)
    replay.bind(ipc("e2-replay"))
    prompt = toks(8)
    pub.publish([stored([1, 2], None, prompt, BS)])  # seq 0, before anyone listens
    kv = KvEvents(capacity=lambda _n: 100)

    async def serve_replay() -> None:
        while True:
            if replay.poll(0):
                client, _, start = replay.recv_multipart()
                for seq, payload in pub.sent:
                    if seq >= int.from_bytes(start, "big"):
                        replay.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
                end = (-1).to_bytes(8, "big", signed=True)
                replay.send_multipart([client, b"", b"", end, b""])
            await asyncio.sleep(0.01)

    server = asyncio.create_task(serve_replay())
    try:
        kv.sync([_backend("a", {"endpoint": ipc("e2"), "replay_endpoint": ipc("e2-replay")})])
        await kv.start()
        await _subscribe(kv, pub, probe_seq=1)  # first heard: seq 1, so 0 was missed
        await wait_for_async(lambda: kv.live("a"), "replayed")
        assert kv.index.match(chain_keys(prompt, BS), ["a"]) == {"a": 2}
        # Health saw the engine stop: the index goes, and the replay rebuilds it (still running).
        kv.reset("a")
        assert kv.index.blocks("a") == 0 and not kv.live("a")
        await wait_for_async(lambda: kv.live("a") and kv.index.blocks("a") == 2, "rebuilt")
    finally:
        server.cancel()
        await kv.aclose()
        replay.close(0)
        pub.close()


@run
async def test_router_binds_where_vllm_connects() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    kv = KvEvents(capacity=lambda _n: 100)
    kv.sync([_backend("a", {"endpoint": endpoint})])
    await kv.start()
    pub = Publisher(endpoint, bind=False)
    try:
        status = kv.status("a")
        assert status is not None and status["publishers"][0]["bind"] is True
        await _subscribe(kv, pub)
        pub.publish([stored([1], None, toks(4), BS)])
        await wait_for_async(lambda: kv.index.blocks("a") == 1, "stored over tcp")
    finally:
        await kv.aclose()
        pub.close()


def test_discovered_endpoints_follow_vllms_rule_and_the_backends_bind() -> None:
    """`/kv_event_sources` endpoints get vLLM's rule (a wildcard: vLLM binds, the router
    connects to the backend's host; `0.0.0.0` named: vLLM connects, the router binds), and the
    backend's own `kv_events.bind` overrides it as for a configured endpoint."""

    def src(endpoint: str) -> dict[str, object]:
        return {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}}

    url = "http://10.1.2.3:8000"
    plain = _backend("a", {}, url=url)
    [wild] = _feeds_from("a", plain, src("tcp://*:5557"))
    assert (wild.endpoint, wild.bind) == ("tcp://10.1.2.3:5557", False)
    [named] = _feeds_from("a", plain, src("tcp://0.0.0.0:5557"))
    assert (named.endpoint, named.bind) == ("tcp://0.0.0.0:5557", True)
    [forced] = _feeds_from("a", _backend("a", {"bind": True}, url=url), src("tcp://*:5557"))
    assert forced.bind is True
    [kept] = _feeds_from("a", _backend("a", {"bind": False}, url=url), src("tcp://0.0.0.0:5557"))
    assert (kept.endpoint, kept.bind) == ("tcp://10.1.2.3:5557", False)


@run
async def test_discovery_from_kv_event_sources(ipc: Callable[[str], str]) -> None:
    """Without `endpoint` the engine's `GET /kv_event_sources` says where it publishes."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    src = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": ipc("e3"),
            "replay_endpoint": None,
            "topic": "kv",
        }
    }

    async def sources(_request: object) -> JSONResponse:
        return JSONResponse(src)

    app = Starlette(routes=[Route("/kv_event_sources", sources)])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    serving = asyncio.create_task(server.serve())
    pub = Publisher(ipc("e3"))
    kv = KvEvents(capacity=lambda _n: 100)
    try:
        await wait_for_async(lambda: server.started, "mock engine up")
        kv.sync([_backend("a", {}, url=f"http://127.0.0.1:{port}")])
        await kv.start()
        await wait_for_async(lambda: bool(kv.status("a")["publishers"]), "discovered")  # type: ignore[index]
        await _subscribe(kv, pub)
        assert kv.live("a")
    finally:
        await kv.aclose()
        pub.close()
        server.should_exit = True
        await serving


@run
async def test_an_engine_is_asked_where_it_publishes_again_every_retry_of_the_clock(
    ipc: Callable[[str], str],
) -> None:
    """Until the engine answers `/kv_event_sources` (it may still be starting), it is asked
    again every RETRY seconds of the injected clock, by the runner's `kv_events_retry` chore;
    a router with no events configured runs no chore at all."""
    clock = ManualClock()
    runner = Runner(sleep=clock.sleep, clock=clock.now)
    runner.start()
    kv = KvEvents(capacity=lambda _n: 100, monotonic=clock.now, runner=runner)
    await kv.start()
    assert runner.stats() == []
    asked: list[float] = []
    answer: dict[str, Any] | None = None

    async def sources(_b: Backend) -> Any:
        asked.append(clock.now())
        return answer

    kv._ask_sources = sources  # type: ignore[method-assign]
    pub = Publisher(ipc("late"))
    try:
        kv.sync([_backend("a", {})])
        await until(lambda: len(asked) == 1, "asked at once")
        clock.advance(RETRY - 0.1)
        await settle()
        assert len(asked) == 1 and kv.state("a") == "waiting"
        clock.advance(0.1)
        await until(lambda: len(asked) == 2, "asked again")
        answer = {
            "0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": ipc("late")}
        }
        clock.advance(RETRY)
        await until(lambda: bool(kv.status("a")["publishers"]), "its feed")  # type: ignore[index]
        assert asked == [1000.0, 1000.0 + RETRY, 1000.0 + 2 * RETRY]
        assert {s.name for s in runner.stats()} == {
            "kv_events_retry",
            "kv_events_pump",
            "kv_events_flush",
        }
    finally:
        await kv.aclose()
        await runner.stop()
        pub.close()


@run
async def test_the_mocks_replay_socket_answers_a_late_router(ipc: Callable[[str], str]) -> None:
    """router/tools/mock/kv_publish.py serves vLLM's replay protocol: a router that joins after the
    engine stored blocks (and sees nothing new) is exact at once."""
    from router.tools.mock.kv_publish import KvPublisher
    from router.tools.mock.kv_publish import stored as mock_stored

    pub = KvPublisher(ipc("m1"), replay_endpoint=ipc("m1-replay"))
    prompt = toks(8)
    pub.publish([mock_stored([-1, 2], None, prompt, BS, False)])  # before anyone listens
    kv = KvEvents(capacity=lambda _n: 100)
    try:
        kv.sync([_backend("a", {"endpoint": ipc("m1"), "replay_endpoint": ipc("m1-replay")})])
        await kv.start()
        await wait_for_async(lambda: kv.live("a"), "replayed")
        assert kv.index.match(chain_keys(prompt, BS), ["a"]) == {"a": 2}
        assert kv.status("a")["publishers"][0]["seq"] == 0  # type: ignore[index]
    finally:
        await kv.aclose()
        pub.close()


def test_a_flight_is_pending_until_answered_and_held_until_it_ends() -> None:
    """What the router sent an engine: its uncached tokens pending until the answer begins (or
    `pending_ttl`), its prompt's blocks held there until the attempt ends; nothing left after."""
    now = [100.0]
    kv = KvEvents(monotonic=lambda: now[0], pending_ttl=2.0)
    kv.sync([_backend("a", {"endpoint": "ipc:///nonexistent/a.sock"})])
    prompt = chain_keys(toks(16), BS)  # 4 blocks
    other = chain_keys(toks(16, start=1000), BS)
    sibling = chain_keys(toks(4) + toks(12, start=500), BS)  # the same first block only
    first = kv.dispatched("a", 16, prompt)
    now[0] += 0.5
    second = kv.dispatched("a", 4, prompt[:1])
    assert first is not None and second is not None
    assert kv.pending("a") == (20, 0.5)
    assert kv.flying_blocks("a", prompt) == 4
    assert kv.flying_blocks("a", sibling) == 1
    assert kv.flying_blocks("a", other) == 0
    assert kv.flying_blocks("b", prompt) == 0 and kv.dispatched("b", 16, prompt) is None
    first.prefilled()
    assert kv.pending("a") == (4, 0.0)
    now[0] += 2.5  # past pending_ttl: no longer pending, still running, so still held
    assert kv.pending("a") == (0, 0.0)
    assert kv.flying_blocks("a", prompt) == 4
    kv.ended(first)
    kv.ended(first)  # once only
    assert kv.flying_blocks("a", prompt) == 1
    kv.ended(second)
    assert kv.flying_blocks("a", prompt) == 0
    assert not kv._engines["a"].flying and not kv._engines["a"].pending


def test_a_prompt_in_flight_counts_as_held_where_it_was_sent() -> None:
    """Before the engine's events say so, a second request of a prompt sees it held where the
    first went (it is prefilling or running there), and the hint is gone once the first ends."""
    from router.core.settings import AffinityConfig
    from router.request.placement.affinity import Affinity, RequestAffinity

    kv = KvEvents()
    backends = [_backend(n, {"endpoint": f"ipc:///nonexistent/{n}.sock"}) for n in "ab"]
    kv.sync(backends)
    for n in "ab":  # live (as a socket would make them), with the block size a store taught
        kv._engines[n].feeds = [Feed(n, f"ipc:///nonexistent/{n}.sock", False, b"", None, 0)]
        kv._engines[n].feeds[0].state = "live"
        kv.index.stored(n, _ev([1], None, toks(BS, start=7000)), 100)
    affinity = Affinity(AffinityConfig(), kv=kv)
    prompt = toks(40)

    def hints() -> dict[str, int]:
        request = RequestAffinity([], None, tokens=prompt, model="m")
        affinity.hints(request, backends)
        return dict(affinity._kv_hints(request, backends, {}).cached)

    assert hints() == {}
    request = RequestAffinity([], None, tokens=prompt, model="m")
    affinity.hints(request, backends)
    flight = affinity.kv_dispatched(request, "b", 0)
    assert flight is not None and hints() == {"b": 40}
    kv.ended(flight)
    assert hints() == {}


def test_churn_is_each_engines_recent_eviction_rate() -> None:
    """Blocks an engine's events removed, per second over about CHURN_TAU, decaying after: what
    tells `cache_aware` where a new prompt would stay longest once every cache is full."""
    now = [100.0]
    kv = KvEvents(capacity=lambda _n: 100, monotonic=lambda: now[0])
    kv.sync([_backend("a", {"endpoint": "ipc:///nonexistent/a.sock"})])
    feed = Feed("a", "ipc:///nonexistent/a.sock", False, b"", None, 0)
    kv._engines["a"].feeds = [feed]
    kv._message(feed, frames(0, [stored([1, 2, 3, 4], None, toks(16), BS)]))
    assert kv.churn("a") == 0.0  # stores are not evictions
    kv._message(feed, frames(1, [removed([4]), removed([3])]))
    assert kv.churn("a") == pytest.approx(2 / CHURN_TAU)
    now[0] += CHURN_TAU
    assert kv.churn("a") == pytest.approx(2 / CHURN_TAU / math.e)
    kv._message(feed, frames(2, [removed([2])]))
    assert kv.churn("a") == pytest.approx((2 / math.e + 1) / CHURN_TAU)
    assert kv.churn("b") == 0.0
    st = kv.status("a")
    assert st is not None and st["evicted_blocks_per_s"] == round(kv.churn("a"), 3)
