"""The shared-store base (router/state/store.py) against a real redis-server: a store degrades
after DEGRADE_AFTER failed round trips in a row (a success in between starts the count over),
recovers only when Redis takes a write (the one rule, the same for every store: in-flight
counts, quotas, the prefix index, usage, Responses ids), keeps its owed work within its cap,
reloads its scripts after SCRIPT FLUSH, and settles owed work when it closes. The usage book and
the Responses ids, once they answered on their own rules, do without Redis while degraded and
catch up once it takes a write. And the prefix index's old drift: lookups that waited on one
slow round trip are one failure, not one each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import pytest
import redis

from balancers.context import NO_CONTEXT
from balancers.inflight.redis import RedisInflight
from balancers.least_inflight import LeastInflight
from router.core.backend import Backend
from router.core.errors import StoreUnavailable
from router.core.runner import Runner
from router.request.admit.quota import KeyLimits
from router.request.admit.quota_shared import SharedQuotas
from router.request.placement.affinity_store import SharedPrefixIndex
from router.request.placement.prefix import block_hashes
from router.request.placement.response_ids import Holder
from router.request.placement.response_ids_shared import SharedResponseIds
from router.request.usage.book_shared import SharedUsageBook
from router.state.store import DEGRADE_AFTER, SharedStore
from tests.support.harness import Cluster, Proc

pytestmark = pytest.mark.redis

log = logging.getLogger("sluicegate.test_notes")


class Notes(SharedStore[str]):
    """The smallest store: a note is one key written in the store's slot."""

    chore = "notes_heartbeat"
    log = log
    degraded_message = "notes unavailable"
    recovered_message = "notes answer again"
    owed_max = 5

    def __init__(self, url: str, timeout: float = 1.0) -> None:
        prefix = uuid.uuid4().hex
        super().__init__(url, timeout=timeout, tag="{" + prefix + "}", beat_every=None)
        self._echo = self._script("return ARGV[1]")

    def key(self, name: str) -> str:
        return self._store_tag + ":note:" + name

    async def write(self, name: str) -> None:
        await self._call(self._store_tag, "SET", self.key(name), 1)

    def note(self, name: str) -> None:
        """Not waited for; owed when Redis does not take it (or the store is degraded)."""
        if self.degraded:
            self.owed.add(name)
            return
        self._post(self._store_tag, ("SET", self.key(name), 1), lambda: self.owed.add(name))

    async def echo(self, value: str) -> bytes:
        reply: bytes = await self._call(self._store_tag, "EVALSHA", self._echo, 0, value)
        return reply

    async def _settle(self) -> None:
        names = self.owed.take()
        done: set[str] = set()
        try:
            for name in names:
                await self.write(name)
                done.add(name)
        finally:
            self.owed.give_back(n for n in names if n not in done)


@pytest.fixture(scope="module")
def rds(module_procs: Cluster) -> Proc:
    return module_procs.redis()


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


@contextmanager
def refusing_writes(url: str) -> Iterator[redis.Redis]:
    """Redis answers (PING among others) but takes no write: what a full one looks like."""
    with redis.Redis.from_url(url) as r:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)
        try:
            yield r
        finally:
            r.config_set("maxmemory", 0)


def stored(url: str, keys: list[str]) -> list[bool]:
    with redis.Redis.from_url(url) as r:
        return [bool(r.exists(k)) for k in keys]


async def fail_once(store: Notes) -> None:
    with pytest.raises(StoreUnavailable):
        await store.write("x")


def test_degrades_after_failed_round_trips_in_a_row_with_one_warning(
    procs: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    rd = procs.redis()

    async def body() -> None:
        s = Notes(rd.url)
        with refusing_writes(rd.url):
            for _ in range(DEGRADE_AFTER - 1):
                await fail_once(s)
            assert not s.degraded
        await s.write("ok")  # a round trip Redis took: the count starts over
        with refusing_writes(rd.url):
            for _ in range(DEGRADE_AFTER - 1):
                await fail_once(s)
            assert not s.degraded
            await fail_once(s)
            assert s.degraded
            for _ in range(DEGRADE_AFTER):
                await fail_once(s)
        await s.aclose()

    with caplog.at_level(logging.WARNING, logger=log.name):
        run(body)
    assert [r.getMessage() for r in caplog.records] == ["notes unavailable"]


def test_recovery_takes_a_write_not_a_ping(
    procs: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    rd = procs.redis()

    async def body() -> None:
        s = Notes(rd.url)
        with refusing_writes(rd.url) as r:
            for _ in range(DEGRADE_AFTER):
                await fail_once(s)
            assert s.degraded
            assert r.ping()  # it answers, yet the store stays local
            assert not await s.heartbeat()
            assert s.degraded
        assert await s.heartbeat()
        assert not s.degraded
        await s.write("again")  # and the store's own writes go through
        await s.aclose()

    with caplog.at_level(logging.INFO, logger=log.name):
        run(body)
    assert [r.getMessage() for r in caplog.records] == ["notes unavailable", "notes answer again"]


def test_owed_work_keeps_the_newest_within_its_cap_and_settles_on_recovery(procs: Cluster) -> None:
    rd = procs.redis()
    names = [f"n{i}" for i in range(Notes.owed_max + 3)]

    async def body() -> None:
        s = Notes(rd.url)
        with refusing_writes(rd.url):
            for _ in range(DEGRADE_AFTER):
                await fail_once(s)
            for name in names:
                s.note(name)
            assert len(s.owed) == Notes.owed_max and s.owed.dropped == 3
            assert not await s.heartbeat()
            assert len(s.owed) == Notes.owed_max  # not taken: kept for the next round
        assert await s.heartbeat()
        assert len(s.owed) == 0
        assert stored(rd.url, [s.key(n) for n in names]) == [False] * 3 + [True] * Notes.owed_max
        await s.aclose()

    run(body)


def test_scripts_are_loaded_again_after_script_flush(rds: Proc) -> None:
    async def body() -> None:
        s = Notes(rds.url)
        await s.start()
        assert await s.echo("a") == b"a"
        with redis.Redis.from_url(rds.url) as r:
            r.script_flush()  # a restarted or failed-over Redis
        assert await s.echo("b") == b"b"
        assert not s.degraded and s._failures == 0
        await s.aclose()

    run(body)


def test_aclose_settles_owed_work_and_is_bounded_when_redis_is_gone(procs: Cluster) -> None:
    rd = procs.redis()
    timeout = 0.1
    bound = max(1.0, timeout * 4)  # what aclose gives owed work, then queued commands

    async def body() -> None:
        s = Notes(rd.url, timeout=timeout)
        with refusing_writes(rd.url):
            for _ in range(DEGRADE_AFTER):
                await fail_once(s)
            s.note("late")  # degraded: owed, not sent
        assert s.degraded and len(s.owed) == 1
        await s.aclose()
        assert stored(rd.url, [s.key("late")]) == [True]

        stuck = Notes(rd.url, timeout=timeout)
        await stuck.write("warm")
        stuck.owed.add("never")
        rd.signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            await stuck.aclose()
            assert time.monotonic() - t0 < 2 * bound + 1.0  # owed work, then the drain
        finally:
            rd.signal(signal.SIGCONT)

    run(body)


def _backend(name: str) -> Backend:
    return Backend(name, "http://127.0.0.1:9", "vllm", MappingProxyType({"m": "m"}), 1.0, None)


async def _inflight_call(store: Any) -> Callable[[], None]:
    lease = await store.acquire([_backend("a")], LeastInflight(), NO_CONTEXT)
    return lambda: store.release(lease)


async def _quota_call(store: Any) -> Callable[[], None]:
    held = await store.admit(KeyLimits("k", 1000, None, 10, "k"), 10, "r")
    return lambda: held.close(None)


async def _affinity_call(store: Any) -> Callable[[], None]:
    await store.match(block_hashes("p" * 64, 64), ["a"])
    return lambda: None


async def _usage_call(store: Any) -> Callable[[], None]:
    store.record("k", "m", 1, 1, 0, False)
    with contextlib.suppress(StoreUnavailable):  # a read writes what is pending first
        await store.query()
    return lambda: None


async def _response_ids_call(store: Any) -> Callable[[], None]:
    await store.remember(uuid.uuid4().hex, Holder("a", "m"))
    return lambda: None


def _usage_book(url: str, timeout: float = 0.1) -> SharedUsageBook:
    return SharedUsageBook(url, prefix=uuid.uuid4().hex, timeout=timeout, runner=Runner())


def _response_ids(url: str, prefix: str | None = None, timeout: float = 0.1) -> SharedResponseIds:
    return SharedResponseIds(
        url,
        ttl=60,
        max_local=100,
        prefix=prefix or uuid.uuid4().hex,
        timeout=timeout,
        runner=Runner(),
    )


# A runner that is never started: no chore probes behind the test's back.
STORES: dict[str, tuple[Callable[[str], Any], Callable[[Any], Awaitable[Callable[[], None]]]]] = {
    "inflight": (
        lambda url: RedisInflight(url, prefix=uuid.uuid4().hex, timeout=0.1, runner=Runner()),
        _inflight_call,
    ),
    "quota": (
        lambda url: SharedQuotas(url, prefix=uuid.uuid4().hex, timeout=0.1, runner=Runner()),
        _quota_call,
    ),
    "affinity": (
        lambda url: SharedPrefixIndex(url, prefix=uuid.uuid4().hex, timeout=0.1, runner=Runner()),
        _affinity_call,
    ),
    "usage": (_usage_book, _usage_call),
    "response_ids": (_response_ids, _response_ids_call),
}


@pytest.mark.parametrize("kind", sorted(STORES))
def test_every_store_recovers_by_the_same_rule(procs: Cluster, kind: str) -> None:
    """Each store, degraded, stays local while Redis answers (PING, removals) but refuses
    writes, and is shared again once it takes them: in-flight counts with no lease held came
    back on a PING before."""
    rd = procs.redis()
    make, request = STORES[kind]

    async def body() -> None:
        s = make(rd.url)
        await s.start()
        rd.signal(signal.SIGSTOP)
        try:
            held = []
            for _ in range(2 * DEGRADE_AFTER):  # a round trip is judged just after its caller
                if s.degraded:
                    break
                held.append(await request(s))
            assert s.degraded
        finally:
            rd.signal(signal.SIGCONT)
        for give_back in held:
            give_back()
        with refusing_writes(rd.url) as r:
            assert r.ping()
            assert not await s.heartbeat()
            assert s.degraded
        assert await s.heartbeat()
        assert not s.degraded
        await s.aclose()

    run(body)


def test_lookups_behind_one_slow_round_trip_are_one_failure(procs: Cluster) -> None:
    """The prefix index counted each lookup that timed out, so a burst waiting on one slow
    round trip degraded it at once; like the other stores it counts round trips now."""
    rd = procs.redis()
    hashes = block_hashes("q" * 128, 64)
    timeout = 0.1

    async def body() -> None:
        shared = SharedPrefixIndex(rd.url, prefix=uuid.uuid4().hex, timeout=timeout)
        await shared.start()
        assert await shared.match(hashes, ["a"]) == {}
        rd.signal(signal.SIGSTOP)
        try:
            burst = await asyncio.gather(
                *(shared.match(hashes, ["a"]) for _ in range(2 * DEGRADE_AFTER))
            )
            assert burst == [None] * (2 * DEGRADE_AFTER)
            await asyncio.sleep(2 * timeout)  # the round trip's own timeout has passed too
        finally:
            rd.signal(signal.SIGCONT)
        assert not shared.degraded
        assert await shared.match(hashes, ["a"]) == {}  # shared lookups go on
        await shared.aclose()

    run(body)


def test_usage_degraded_answers_at_once_and_writes_what_it_kept_on_recovery(
    procs: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """Usage writes refused DEGRADE_AFTER times in a row degrade the book (one warning): reads
    then fail without a round trip, records go on in memory, and the first heartbeat Redis takes
    writes all of them: nothing counted during the outage is lost or counted twice."""
    rd = procs.redis()

    async def body() -> None:
        book = _usage_book(rd.url, timeout=1.0)
        book.record("k", "m", 10, 1, 0, False)
        assert [r["requests"] for r in await book.query()] == [1]
        with refusing_writes(rd.url):
            for _ in range(DEGRADE_AFTER - 1):
                book.record("k", "m", 10, 1, 0, False)
                with pytest.raises(StoreUnavailable):
                    await book.query()
                assert not book.degraded
            book.record("k", "m", 10, 1, 0, False)
            with pytest.raises(StoreUnavailable):
                await book.query()
            assert book.degraded
            trips = book.round_trips
            book.record("k", "m", 10, 1, 0, False)
            with pytest.raises(StoreUnavailable):
                await book.query()
            assert book.round_trips == trips  # degraded: Redis is not asked
            assert not await book.heartbeat()
            assert book.degraded
        assert await book.heartbeat()
        assert not book.degraded
        [row] = await book.query()
        assert (row["requests"], row["prompt_tokens"]) == (
            DEGRADE_AFTER + 2,
            10 * (DEGRADE_AFTER + 2),
        )
        await book.aclose()

    with caplog.at_level(logging.INFO, logger="sluicegate.usage"):
        run(body)
    assert [r.getMessage() for r in caplog.records] == [
        "usage not written to Redis; kept in memory until it answers",
        "usage written to Redis again",
    ]


def test_response_ids_degraded_answer_from_this_process_until_redis_takes_a_write(
    procs: Cluster,
) -> None:
    """Responses ids whose writes Redis refused DEGRADE_AFTER times in a row are degraded: ids
    are kept in this process only and lookups answer from it without a round trip (another
    replica's id is unknown meanwhile); once Redis takes a write they are shared again."""
    rd = procs.redis()
    prefix = uuid.uuid4().hex

    async def body() -> None:
        ids, other = _response_ids(rd.url, prefix, 1.0), _response_ids(rd.url, prefix, 1.0)
        assert await other.remember("theirs", Holder("b", "m"))
        with refusing_writes(rd.url):
            for i in range(DEGRADE_AFTER):
                assert await ids.remember(f"mine-{i}", Holder("a", "m"))  # kept here
            assert ids.degraded and ids.fallbacks == DEGRADE_AFTER
            trips = ids.round_trips
            assert await ids.remember("while-away", Holder("a", "m"))
            assert await ids.find("while-away") == Holder("a", "m")
            assert await ids.find("theirs") is None  # not asked: unknown here meanwhile
            assert ids.round_trips == trips
            assert not await ids.heartbeat()
        assert await ids.heartbeat()
        assert not ids.degraded
        assert await ids.find("theirs") == Holder("b", "m")
        assert await ids.remember("after", Holder("a", "m"))
        assert await other.find("after") == Holder("a", "m")  # shared again
        await ids.aclose()
        await other.aclose()

    run(body)
