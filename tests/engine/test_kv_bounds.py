"""The KV-event feed's bounds against a publisher that floods it (issue 46): the index trim past
an engine's capacity stays linear, a message's size and a loop turn's work are bounded, held
batches are counted in bytes, the adapter names an engine reports are bounded, and timestamps
that are not finite never reach the admin API. Figures (stalls, memory) live in
bench/scenarios/kv.py."""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from router.core.backend import Backend
from router.core.settings import BackendConfig
from router.engine import kv_events, kv_index
from router.engine.kv_events import KvEvents
from router.engine.kv_index import TokenIndex
from router.engine.kv_wire import Stored
from tests.support.harness import STARVED_S, Cluster, Proc, backend
from tests.support.kv_publisher import Publisher, frames, removed, stored
from tests.support.wait import wait_for, wait_for_async

BS = 4


def _one_block(h: int) -> Stored:
    tokens = msgspec.Raw(msgspec.msgpack.encode([h, h + 1, h + 2, h + 3]))
    return Stored([h], None, tokens, BS, None, None, "GPU", 0)


def test_trimming_past_the_capacity_costs_what_filling_it_did() -> None:
    """An engine that keeps storing past its capacity (an honest one after missed removals):
    each block stored past it evicts the oldest, and N of those cost about what the first N
    stores did. Before, each eviction scanned the slots earlier evictions had emptied at the
    front of a dict: quadratic (1.3 M blocks froze a router for a minute). The bound is 8x
    the same process's own cost of filling (CPU time of this thread: another process's load
    does not count); the quadratic trim took 18x at this size, and more with every block."""
    cap = 200_000
    idx = TokenIndex()
    events = [_one_block(h) for h in range(1, 2 * cap + 1)]
    t0 = time.thread_time()
    for ev in events[:cap]:
        idx.stored("a", ev, cap)
    fill = time.thread_time() - t0
    bound = 8 * fill
    t1 = time.thread_time()
    done = 0
    for ev in events[cap:]:
        idx.stored("a", ev, cap)
        done += 1
        if done % 1000 == 0 and time.thread_time() - t1 > bound:
            break  # already quadratic: no need to wait for the rest
    past = time.thread_time() - t1
    assert done == cap and past <= bound, f"{done} blocks past the capacity took {past / fill:.1f}x"
    assert idx.blocks("a") == cap
    held = idx._engines["a"].by_hash
    assert idx.match([held[2 * cap]], ["a"]) == {"a": 1}  # the newest kept, the oldest gone
    assert (1 in held, cap in held, cap + 1 in held) == (False, False, True)


@pytest.fixture(scope="module")
def fed_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Publisher]]:
    """A router whose backend `a` (a mock) publishes KV events on an ipc path this test owns."""
    run = Path(tmp_path_factory.mktemp("kvb"))
    endpoint = f"ipc://{run}/a.sock"
    pub = Publisher(endpoint)
    c = Cluster()
    try:
        mock = c.mock("a")
        router = c.router(
            {
                "backends": [backend("a", mock, kv_events={"endpoint": endpoint, "topic": "kv"})],
                "health": {"interval": 60},
            },
            env={"SLUICEGATE_LOG_LEVEL": "warning"},
        )
        assert pub.sock.poll(10_000), "the router never subscribed"
        assert pub.sock.recv()[:1] == b"\x01"
        yield router, pub
    finally:
        c.close()
        pub.close()


def _kv_row(router: Proc) -> dict[str, Any]:
    r = httpx.get(router.url + "/admin/backends/a", timeout=STARVED_S)
    assert r.status_code == 200, r.text
    return dict(r.json()["kv_events_state"])


def _first_seq(router: Proc) -> object:
    # Before the feed's first batch is applied there is no publisher yet (or no seq): "not yet".
    publishers = _kv_row(router)["publishers"]
    return publishers[0]["seq"] if publishers else None


@pytest.mark.parametrize("ts", [-math.inf, math.inf, math.nan])
def test_a_batch_stamped_with_no_finite_time_keeps_the_admin_api_answering(
    fed_router: tuple[Proc, Publisher], ts: float
) -> None:
    """A batch whose timestamp is -inf made the feed's lag infinite, and `GET /admin/backends`
    answered 500 (JSON has no infinity): such a time reads as none (0.0, long ago)."""
    router, pub = fed_router
    seq = pub.publish([stored([pub.seq + 1], None, [1, 2, 3, 4], BS)], ts=ts)
    wait_for(lambda: _first_seq(router) == seq, "the batch applied")
    lag = _kv_row(router)["lag_seconds"]
    assert isinstance(lag, float) and math.isfinite(lag) and lag > 0
    r = httpx.get(router.url + "/admin/backends", timeout=STARVED_S)
    assert r.status_code == 200 and r.json()[0]["kv_events_state"]["lag_seconds"] == lag
    assert httpx.get(router.url + "/metrics", timeout=STARVED_S).status_code == 200


# --- one publisher's flood: message size, work per loop turn, held and replayed bytes -------


def run(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """The async test's body on its own event loop (the suite runs no asyncio plugin)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        asyncio.run(fn(*args, **kwargs))

    return wrapper


def _kv(endpoint: str, replay: str | None = None) -> KvEvents:
    kv = KvEvents(capacity=lambda _n: 1 << 16)
    cfg: dict[str, object] = {"endpoint": endpoint, "topic": "kv"}
    if replay is not None:
        cfg["replay_endpoint"] = replay
    kv.sync(
        [
            Backend.from_config(
                BackendConfig(name="a", url="http://127.0.0.1:9", models=["m"], kv_events=cfg)  # type: ignore[arg-type]
            )
        ]
    )
    return kv


def _blocks(first: int, n: int) -> Any:
    """`n` blocks of one event, engine hashes from `first` (tokens: each hash, 4 times)."""
    hashes = range(first, first + n)
    return stored(list(hashes), None, [h for h in hashes for _ in range(4)], BS)


class _Ticks:
    """A task that counts event-loop turns, and the count at each batch `kv` applies: two
    batches applied in one turn see the same count."""

    def __init__(self, kv: KvEvents) -> None:
        self.now = 0
        self.at: list[tuple[int, int]] = []  # (turn, blocks the batch stored)
        self._task = asyncio.get_running_loop().create_task(self._tick())
        apply = kv.index.apply

        def counted(backend: str, events: Any, cap: int) -> Any:
            out = apply(backend, events, cap)
            self.at.append((self.now, out[3]))
            return out

        kv.index.apply = counted  # type: ignore[method-assign,assignment]

    async def _tick(self) -> None:
        while True:
            self.now += 1
            await asyncio.sleep(0)

    def stop(self) -> None:
        self._task.cancel()


@run
async def test_a_frame_over_the_message_bound_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 132 MB batch stalled the loop 6.2 s: ZMQ_MAXMSGSIZE drops a larger frame, with the
    publisher's connection; the router connects again, and the lost batch is a gap."""
    monkeypatch.setattr(kv_events, "MAX_MESSAGE_BYTES", 64 * 1024)
    endpoint = f"ipc://{tmp_path}/big.sock"
    pub = Publisher(endpoint)
    kv = _kv(endpoint)
    try:
        await kv.start()
        await pub.subscribed()
        pub.publish([_blocks(1, 2)])  # seq 0
        await wait_for_async(lambda: kv.index.blocks("a") == 2, "a batch of the usual size")
        pub.publish([_blocks(100, 8000)])  # seq 1: about 200 KB
        # The router's socket dropped the connection, and connects again (ZMQ would not, after
        # a protocol error): the batches after it arrive.
        async with asyncio.timeout(10.0):
            while kv.index.blocks("a") == 2:
                pub.publish([_blocks(10 + pub.seq, 1)])
                await asyncio.sleep(0.05)
        assert 100 not in kv.index._engines["a"].by_hash and kv.dropped >= 1
        assert kv.state("a") == "unsure"  # seq 1 never arrived: a gap
    finally:
        await kv.aclose()
        pub.close()


@pytest.mark.parametrize(("bound", "value"), [("TURN_BYTES", 1), ("TURN_SECONDS", 0.0)])
@run
async def test_a_backlog_is_applied_a_turn_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bound: str, value: float
) -> None:
    """Queued batches were applied in one go, however many: a loop turn handles TURN_BYTES
    of messages or TURN_SECONDS of work, then the loop's other tasks run (set to one message
    here: every batch in a turn of its own), and every batch is still applied, in order."""
    monkeypatch.setattr(kv_events, bound, value)
    endpoint = f"ipc://{tmp_path}/turns.sock"
    pub = Publisher(endpoint)
    kv = _kv(endpoint)
    ticks = _Ticks(kv)
    try:
        await kv.start()
        await pub.subscribed()
        for i in range(30):
            pub.publish([_blocks(1 + 10 * i, 2)])
        await wait_for_async(lambda: kv.index.blocks("a") == 60, "every batch")
        turns = [t for t, _ in ticks.at]
        assert len(turns) == 30 and turns == sorted(set(turns)), turns
        assert kv.live("a") and kv.status("a")["publishers"][0]["seq"] == 29  # type: ignore[index]
    finally:
        ticks.stop()
        await kv.aclose()
        pub.close()


class _Replay:
    """A replay socket (vLLM's ROUTER) that answers with `batches` (seq, payload) then the end;
    `silent`, only once `silent` is set False (until then the replay runs on)."""

    def __init__(self, pub: Publisher, endpoint: str, silent: bool = False) -> None:
        self.sock = pub.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.batches: list[tuple[int, bytes]] = []
        self.silent = silent
        self.asked = 0
        self._waiting: list[bytes] = []
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            while self.sock.poll(0):
                client, _, _start = self.sock.recv_multipart()
                self.asked += 1
                self._waiting.append(client)
            while self._waiting and not self.silent:
                client = self._waiting.pop(0)
                for seq, payload in self.batches:
                    self.sock.send_multipart([client, b"", b"kv", seq.to_bytes(8, "big"), payload])
                end = (-1).to_bytes(8, "big", signed=True)
                self.sock.send_multipart([client, b"", b"", end, b""])
            await asyncio.sleep(0.01)

    def close(self) -> None:
        self._task.cancel()
        self.sock.close(0)


def _payload(seq: int, events: list[Any]) -> bytes:
    return frames(seq, events)[2]


@run
async def test_a_replay_is_applied_a_turn_at_a_time_and_new_batches_wait_behind_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches held during a replay were applied at once when it ended (27 s for 546 MB): the
    replayed and held batches are applied a turn's budget at a time, and what arrives
    meanwhile waits behind them, in order."""
    monkeypatch.setattr(kv_events, "TURN_BYTES", 1)
    endpoint, replay_at = f"ipc://{tmp_path}/r.sock", f"ipc://{tmp_path}/r-replay.sock"
    pub = Publisher(endpoint)
    replay = _Replay(pub, replay_at)
    replay.batches = [(seq, _payload(seq, [_blocks(1 + 10 * seq, 2)])) for seq in range(20)]
    pub.seq = 20  # the engine published 0-19 before the router came
    kv = _kv(endpoint, replay_at)
    ticks = _Ticks(kv)
    later = [False]
    apply = kv.index.apply

    def publish_meanwhile(backend: str, events: Any, cap: int) -> Any:
        if not later[0]:  # while the first replayed batch is applied: two new ones
            later[0] = True
            pub.publish([_blocks(1000, 1)])
            pub.publish([_blocks(1010, 1)])
        return apply(backend, events, cap)

    kv.index.apply = publish_meanwhile  # type: ignore[method-assign,assignment]
    try:
        await kv.start()
        await pub.subscribed()
        await wait_for_async(lambda: kv.index.blocks("a") == 42, "the replay and the two after it")
        turns = [t for t, _ in ticks.at]
        assert len(turns) == 22 and turns == sorted(set(turns)), turns
        assert [n for _, n in ticks.at] == [2] * 20 + [1, 1]
        assert kv.live("a") and kv.status("a")["publishers"][0]["seq"] == 21  # type: ignore[index]
        assert replay.asked == 1
    finally:
        ticks.stop()
        replay.close()
        await kv.aclose()
        pub.close()


@run
async def test_batches_held_during_a_replay_are_bounded_in_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay that never answers held up to 10,000 batches of any size (546 MB): what is
    held is counted in bytes (HOLD_MAX_BYTES), the oldest going first, and when the replay
    ends (here it answers at last, with nothing) the feed applies the rest and is `unsure`."""
    monkeypatch.setattr(kv_events, "HOLD_MAX_BYTES", 16 * 1024)
    endpoint, replay_at = f"ipc://{tmp_path}/h.sock", f"ipc://{tmp_path}/h-replay.sock"
    pub = Publisher(endpoint)
    replay = _Replay(pub, replay_at, silent=True)
    kv = _kv(endpoint, replay_at)
    try:
        await kv.start()
        await pub.subscribed()
        await wait_for_async(lambda: replay.asked == 1, "the replay asked for")
        for i in range(40):  # each about 1.7 KB
            pub.publish([_blocks(1 + 100 * i, 40)])
        await wait_for_async(lambda: kv.batches == 40, "every batch received")
        feed = kv._engines["a"].feeds[0]
        assert kv.state("a") == "replaying"
        held = len(feed.held)
        assert feed.held_bytes <= 16 * 1024 and 0 < held < 40
        assert feed.held_bytes == sum(b.size + kv_events.HOLD_OVERHEAD for b in feed.held)
        assert [b.seq for b in feed.held] == list(range(40 - held, 40))  # the newest kept
        replay.silent = False
        # The held batches are applied as the replay ends: wait for the state and the blocks.
        await wait_for_async(
            lambda: kv.state("a") == "unsure" and kv.index.blocks("a") == 40 * held,
            "the replay over, every held batch applied",
        )
        assert not feed.held
    finally:
        replay.close()
        await kv.aclose()
        pub.close()


@run
async def test_a_replays_answer_is_read_up_to_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay socket's answer was read whatever its size: past REPLAY_MAX_BYTES it is
    no longer read, what came is applied, and the feed is `unsure` (it missed the rest)."""
    monkeypatch.setattr(kv_events, "REPLAY_MAX_BYTES", 16 * 1024)
    endpoint, replay_at = f"ipc://{tmp_path}/q.sock", f"ipc://{tmp_path}/q-replay.sock"
    pub = Publisher(endpoint)
    replay = _Replay(pub, replay_at)
    replay.batches = [(seq, _payload(seq, [_blocks(1 + 100 * seq, 40)])) for seq in range(40)]
    pub.seq = 40
    kv = _kv(endpoint, replay_at)
    try:
        await kv.start()
        await pub.subscribed()
        await wait_for_async(lambda: kv.state("a") == "unsure", "the replay read in part")
        applied = kv.index.blocks("a") // 40
        assert 0 < applied < 40 and kv.index.blocks("a") == 40 * applied
        read = sum(len(p) + 10 + kv_events.HOLD_OVERHEAD for _, p in replay.batches[: applied + 1])
        assert read > 16 * 1024  # the one that went past the bound was not applied
        assert kv.status("a")["publishers"][0]["seq"] == applied - 1  # type: ignore[index]
    finally:
        replay.close()
        await kv.aclose()
        pub.close()


def test_a_batch_past_its_block_bound_is_applied_in_part_and_the_feed_is_unsure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One batch's work had no bound but its size: past MAX_BATCH_BLOCKS block hashes (stored
    and removed) the rest is not applied, and the index is no longer exact."""
    monkeypatch.setattr(kv_index, "MAX_BATCH_BLOCKS", 100)
    kv = _kv("ipc:///nonexistent/a.sock")
    feed = kv_events.Feed("a", "ipc:///nonexistent/a.sock", False, b"", None, 0)
    kv._engines["a"].feeds = [feed]
    kv._message(feed, frames(0, [_blocks(1, 60), removed([1, 2]), _blocks(100, 30)]))
    assert kv.index.blocks("a") == 88 and kv.live("a")
    kv._message(feed, frames(1, [_blocks(200, 60), _blocks(300, 60), removed([200])]))
    assert kv.index.blocks("a") == 148 and kv.state("a") == "unsure"


def test_the_adapter_names_an_engine_reports_are_bounded() -> None:
    """300,000 adapter names added 109 MB that was never released: an engine keeps the
    MAX_LORAS most recently seen, and a name no request could give (over MAX_LORA_NAME
    characters) is not indexed."""
    idx = TokenIndex()

    def with_lora(h: int, name: str) -> Stored:
        ev = _one_block(h)
        return Stored(ev.hashes, None, ev.token_ids, BS, name, [[name]], "GPU", 0)

    idx.stored("a", with_lora(1, "first"), 1 << 20)
    for i in range(kv_index.MAX_LORAS - 1):
        idx.stored("a", with_lora(10 + i, f"adapter-{i}"), 1 << 20)
    idx.stored("a", with_lora(2, "first"), 1 << 20)  # seen again: the most recent now
    for i in range(2 * kv_index.MAX_LORAS):
        idx.stored("a", with_lora(10_000 + i, f"more-{i}"), 1 << 20)
    assert len(idx._engines["a"].loras) == kv_index.MAX_LORAS
    assert idx.has_lora("a", f"more-{2 * kv_index.MAX_LORAS - 1}")
    assert not idx.has_lora("a", "adapter-0")
    long = "x" * (kv_index.MAX_LORA_NAME + 1)
    assert idx.stored("a", with_lora(5, long), 1 << 20) == 0 and not idx.has_lora("a", long)


def test_the_adapter_name_seen_again_stays() -> None:
    idx = TokenIndex()

    def with_lora(h: int, name: str) -> Stored:
        ev = _one_block(h)
        return Stored(ev.hashes, None, ev.token_ids, BS, name, [[name]], "GPU", 0)

    idx.stored("a", with_lora(1, "kept"), 1 << 20)
    for i in range(3 * kv_index.MAX_LORAS):
        idx.stored("a", with_lora(10 + i, f"n-{i}"), 1 << 20)
        if i % 100 == 0:
            idx.stored("a", with_lora(1, "kept"), 1 << 20)
    assert idx.has_lora("a", "kept") and len(idx._engines["a"].loras) == kv_index.MAX_LORAS
