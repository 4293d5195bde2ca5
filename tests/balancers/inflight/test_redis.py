"""The Redis in-flight store against a real redis-server: atomic shared counts, capacity, round
trips, lease expiry (injected clock), releases that survive cancellation, Redis slow or down."""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence, Set
from types import MappingProxyType
from typing import Any, ClassVar

import pytest
import redis

from balancers.base import Candidate
from balancers.context import NO_CONTEXT
from balancers.inflight.redis import RedisInflight
from balancers.least_inflight import LeastInflight
from balancers.plugin import adapted
from balancers.round_robin import RoundRobin
from router.core.backend import Backend
from tests.support.harness import Cluster, Proc, free_port, late_by

pytestmark = pytest.mark.redis


def mk(name: str, weight: float = 1.0, cap: int | None = None) -> Backend:
    return Backend(name, "http://127.0.0.1:9", "vllm", MappingProxyType({"m": "m"}), weight, cap)


@pytest.fixture(scope="module")
def rds(module_procs: Cluster) -> Proc:
    return module_procs.redis()


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def store(url: str, prefix: str, **kw: Any) -> RedisInflight:
    return RedisInflight(url, prefix=prefix, heartbeat=False, **{"timeout": 1.0, **kw})


def zcard(url: str, prefix: str, backend: str) -> int:
    with redis.Redis.from_url(url) as r:
        return int(r.zcard("{" + prefix + "}:inflight:" + backend))


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_two_replicas_share_one_count_atomically(rds: Proc) -> None:
    prefix = uuid.uuid4().hex
    bs = [mk(n) for n in "abcd"]

    async def body() -> None:
        a, b = store(rds.url, prefix), store(rds.url, prefix)
        await a.start()
        await b.start()
        li = LeastInflight()
        # 200 acquires at once, half from each replica: atomic pick-and-count leaves 50 each.
        leases = await asyncio.gather(
            *(s.acquire(bs, li, NO_CONTEXT) for s in [a, b] * 100), return_exceptions=False
        )
        assert not a.degraded and not b.degraded
        assert Counter(lease.backend for lease in leases if lease) == dict.fromkeys("abcd", 50)
        assert await a.counts(list("abcd")) == dict.fromkeys("abcd", 50)
        assert await b.counts(list("abcd")) == dict.fromkeys("abcd", 50)
        for s, lease in zip([a, b] * 100, leases, strict=True):
            s.release(lease)  # type: ignore[arg-type]
        await a.flush()
        await b.flush()
        assert await b.counts(list("abcd")) == dict.fromkeys("abcd", 0)
        await a.aclose()
        await b.aclose()

    run(body)


def test_one_round_trip_to_acquire_and_one_to_release(rds: Proc) -> None:
    prefix = uuid.uuid4().hex
    bs = [mk(n) for n in "abc"]

    async def body() -> None:
        s = store(rds.url, prefix)
        await s.start()
        with redis.Redis.from_url(rds.url) as r:
            r.config_resetstat()
            leases = [await s.acquire(bs, LeastInflight(), NO_CONTEXT) for _ in range(10)]
            for lease in leases:
                s.release(lease)  # type: ignore[arg-type]
            await s.flush()
            cmds = {
                k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()
            }
        await s.aclose()
        # What the scripts run inside Redis, and connection setup, are not round trips.
        inner = {"time", "zremrangebyscore", "zcard", "zadd", "pexpire"}
        setup = {"hello", "client|setinfo", "config|resetstat", "info"}
        trips = {k: v for k, v in cmds.items() if k not in inner | setup}
        assert trips == {"evalsha": 10, "zrem": 10}
        assert cmds["zadd"] == 10

    run(body)


def test_lua_ties_spread_evenly_and_follow_weights(rds: Proc) -> None:
    prefix = uuid.uuid4().hex

    async def cycle(s: RedisInflight, bs: Sequence[Backend], n: int) -> Counter[str]:
        got: Counter[str] = Counter()
        li = LeastInflight()
        for _ in range(n):
            lease = await s.acquire(bs, li, NO_CONTEXT)
            assert lease is not None
            got[lease.backend] += 1
            s.release(lease)
            await s.flush()  # idle again: every pick is a tie
        return got

    async def body() -> None:
        s = store(rds.url, prefix)
        await s.start()
        even = await cycle(s, [mk(n) for n in "abcd"], 2000)
        for name in "abcd":
            assert even[name] / 2000 == pytest.approx(0.25, abs=0.04)
        weighted = await cycle(s, [mk("x", 1), mk("y", 3)], 2000)
        assert weighted["y"] / 2000 == pytest.approx(0.75, abs=0.04)
        # Under load (nothing released) the counts settle in the ratio of the weights.
        bs = [mk("p", 1), mk("q", 2), mk("r", 5)]
        for _ in range(400):
            await s.acquire(bs, LeastInflight(), NO_CONTEXT)
        assert await s.counts(["p", "q", "r"]) == {"p": 50, "q": 100, "r": 250}
        await s.aclose()

    run(body)


def test_lua_two_choices_for_large_sets(rds: Proc) -> None:
    prefix = uuid.uuid4().hex
    bs = [mk(f"b{i}") for i in range(24)]

    async def body() -> None:
        s = store(rds.url, prefix)
        await s.start()
        for _ in range(5):
            await s.acquire([bs[0]], LeastInflight(), NO_CONTEXT)
        got: Counter[str] = Counter()
        for _ in range(300):
            lease = await s.acquire(bs, LeastInflight(), NO_CONTEXT)
            assert lease is not None
            got[lease.backend] += 1
            s.release(lease)
            await s.flush()
        assert "b0" not in got and len(got) >= 18
        await s.aclose()

    run(body)


def test_capacity_holds_across_replicas_for_every_balancer(rds: Proc) -> None:
    prefix = uuid.uuid4().hex
    bs = [mk("a", cap=1), mk("b", cap=1)]

    async def body() -> None:
        a, b = store(rds.url, prefix), store(rds.url, prefix)
        await a.start()
        await b.start()
        rr_a, rr_b = RoundRobin(), RoundRobin()
        first = await a.acquire(bs, rr_a, NO_CONTEXT)
        second = await b.acquire(bs, rr_b, NO_CONTEXT)  # its rotation starts at the full one
        assert first is not None and second is not None
        assert {first.backend, second.backend} == {"a", "b"}
        assert await a.acquire(bs, rr_a, NO_CONTEXT) is None
        assert await b.acquire(bs, LeastInflight(), NO_CONTEXT) is None
        a.release(first)
        await a.flush()
        again = await b.acquire(bs, LeastInflight(), NO_CONTEXT)
        assert again is not None and again.backend == first.backend
        b.release(second)
        b.release(again)
        await b.flush()
        assert await a.counts(["a", "b"]) == {"a": 0, "b": 0}
        await a.aclose()
        await b.aclose()

    run(body)


class Recorder:
    """A third-party-style balancer: reads loads, picks the least, remembers what it saw."""

    name: ClassVar[str] = "recorder"

    def __init__(self) -> None:
        self.seen: list[dict[str, int]] = []

    def pick(self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()) -> Any:
        self.seen.append({c.name: c.inflight for c in candidates})
        pool = [c for c in candidates if c.name not in exclude]
        return min(pool, key=lambda c: (c.inflight, c.name)) if pool else None


def test_plugin_balancers_see_shared_counts(rds: Proc) -> None:
    prefix = uuid.uuid4().hex
    bs = [mk("a"), mk("b", cap=3)]

    async def body() -> None:
        a, b = store(rds.url, prefix), store(rds.url, prefix)
        await a.start()
        await b.start()
        for _ in range(3):
            await a.acquire([bs[1]], LeastInflight(), NO_CONTEXT)
        rec = adapted(Recorder, "recorder")()  # as the router builds a plugin
        lease = await b.acquire(bs, rec, NO_CONTEXT)
        # b is full (3 held by the other replica) so it is not even offered.
        assert rec.inner.seen == [{"a": 0}]  # type: ignore[attr-defined]
        assert lease is not None and lease.backend == "a"
        await a.aclose()
        await b.aclose()

    run(body)


def test_release_is_not_lost_to_cancellation(rds: Proc) -> None:
    prefix = uuid.uuid4().hex
    bs = [mk("a")]

    async def body() -> None:
        s = store(rds.url, prefix)
        await s.start()
        started = asyncio.Event()

        async def request() -> None:
            lease = await s.acquire(bs, LeastInflight(), NO_CONTEXT)
            assert lease is not None
            try:
                started.set()
                await asyncio.Event().wait()  # a stream that never ends
            finally:
                s.release(lease)

        tasks = [asyncio.ensure_future(request()) for _ in range(20)]
        await started.wait()
        await asyncio.sleep(0.05)
        assert await s.counts(["a"]) == {"a": 20}
        for t in tasks:
            t.cancel()  # the clients left
        await asyncio.wait(tasks)
        await s.flush()
        assert await s.counts(["a"]) == {"a": 0}
        await s.aclose()

    run(body)
    assert zcard(rds.url, prefix, "a") == 0


def test_dead_replica_leases_expire_live_stream_stays_counted(rds: Proc) -> None:
    prefix = uuid.uuid4().hex
    clock = Clock()
    bs = [mk("a")]

    async def body() -> None:
        dead = store(rds.url, prefix, clock=clock, lease_ttl=10.0)
        live = store(rds.url, prefix, clock=clock, lease_ttl=10.0)
        await dead.start()
        await live.start()
        for _ in range(3):
            await dead.acquire(bs, LeastInflight(), NO_CONTEXT)
        mine = await live.acquire(bs, LeastInflight(), NO_CONTEXT)
        assert mine is not None
        await dead._redis.aclose()  # kill -9: no release, no heartbeat from here on
        assert await live.counts(["a"]) == {"a": 4}
        clock.t += 9.9
        assert await live.counts(["a"]) == {"a": 4}, "expired before the lease ttl"
        clock.t += 0.2
        # The live replica has not beaten either: its own lease lapses too, then the beat
        # re-adds it. In real time it beats every ttl/3, which the loop below does.
        assert await live.heartbeat()
        assert await live.counts(["a"]) == {"a": 1}
        for _ in range(200):  # a 10-minute stream, beating every ttl/3
            clock.t += 10.0 / 3
            assert await live.heartbeat()
            assert await live.counts(["a"]) == {"a": 1}
        live.release(mine)
        await live.flush()
        assert await live.counts(["a"]) == {"a": 0}
        await live.aclose()

    run(body)


def test_redis_down_falls_back_locally_and_comes_back(
    procs: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    rd = procs.redis(port)
    prefix = uuid.uuid4().hex
    bs = [mk("a"), mk("b")]
    caplog.set_level(logging.INFO, "sluicegate.inflight")

    async def body() -> None:
        # Redis is killed, not slowed (a refused connection fails at once): a timeout a loaded
        # machine meets, so the store is not degraded before the kill.
        s = store(rd.url, prefix, timeout=0.5)
        await s.start()
        shared = [await s.acquire(bs, LeastInflight(), NO_CONTEXT) for _ in range(2)]
        assert not s.degraded
        rd.kill9()
        local = [await s.acquire(bs, LeastInflight(), NO_CONTEXT) for _ in range(4)]
        assert all(lease is not None for lease in local)
        assert s.degraded and s.fallbacks == 4
        assert await s.counts(["a", "b"]) == {"a": 3, "b": 3}  # the local view
        s.release(shared[0])  # type: ignore[arg-type]
        assert not await s.heartbeat()
        procs.redis(port)  # back, empty (no persistence)
        assert await s.heartbeat()
        assert not s.degraded
        # Every live lease, shared or local, is counted in Redis again.
        assert sorted((await s.counts(["a", "b"])).values()) == [2, 3]
        assert zcard(rd.url, prefix, "a") + zcard(rd.url, prefix, "b") == 5
        for lease in [shared[1], *local]:
            s.release(lease)  # type: ignore[arg-type]
        await s.flush()
        assert await s.counts(["a", "b"]) == {"a": 0, "b": 0}
        await s.aclose()

    run(body)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "counting locally" in warnings[0].getMessage()
    assert any("shared" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_redis_slow_falls_back_without_error_and_settles_owed_removals(procs: Cluster) -> None:
    rd = procs.redis()
    prefix = uuid.uuid4().hex
    bs = [mk("a")]

    async def body() -> None:
        timeout = 0.05
        s = store(rd.url, prefix, timeout=timeout)
        await s.start()
        rd.signal(signal.SIGSTOP)  # accepts nothing, answers nothing: "slow"
        try:

            async def acquires(n: int) -> list[Any]:
                return [await s.acquire(bs, LeastInflight(), NO_CONTEXT) for _ in range(n)]

            # Each timer starts with what it bounds, so its own lateness is the machine's.
            first, late = await late_by(acquires(1), timeout)
            assert late < timeout
            assert first[0] is not None and not s.degraded  # one late answer is no verdict
            # At most a timeout each until three round trips in a row failed (the first call's
            # round trip may be judged only after it stopped waiting: four calls)...
            rest, late = await late_by(acquires(3), 3 * timeout)
            assert late < timeout
            assert s.degraded and s.fallbacks == 4
            # ...then no more waiting: done before a timer of one timeout started with it.
            last, late = await late_by(acquires(1), timeout)
            assert late < 0
            leases = first + rest + last
            assert all(lease is not None for lease in leases) and s.fallbacks == 5
            for lease in leases:
                s.release(lease)
        finally:
            rd.signal(signal.SIGCONT)
        # The script may have run once Redis woke up: the owed removal settles it.
        for _ in range(50):
            if await s.heartbeat():
                break
            await asyncio.sleep(0.05)
        assert not s.degraded
        assert await s.counts(["a"]) == {"a": 0}
        await s.aclose()

    run(body)


def test_no_secret_in_logs_when_redis_is_unreachable(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"redis://user:s3cretpw@127.0.0.1:{free_port()}/0"

    async def body() -> None:
        s = RedisInflight(url, timeout=0.05, heartbeat=False)
        await s.start()
        for _ in range(3):
            lease = await s.acquire([mk("a")], LeastInflight(), NO_CONTEXT)
            assert lease is not None
            s.release(lease)
        assert s.degraded
        await s.aclose()

    run(body)
    text = caplog.text + "".join(str(getattr(r, "fields", "")) for r in caplog.records)
    assert "counting locally" in text
    assert "s3cretpw" not in text


def test_scripts_reloaded_after_redis_forgets_them(rds: Proc) -> None:
    prefix = uuid.uuid4().hex
    bs = [mk("a"), mk("b")]

    async def body() -> None:
        s = store(rds.url, prefix, timeout=0.5)
        await s.start()
        with redis.Redis.from_url(rds.url) as r:
            r.script_flush()  # what a restarted or failed-over Redis looks like to a client
        leases = await asyncio.gather(
            *(s.acquire(bs, LeastInflight(), NO_CONTEXT) for _ in range(6))
        )
        assert not s.degraded and s.fallbacks == 0
        assert await s.counts(["a", "b"]) == {"a": 3, "b": 3}
        for lease in leases:
            s.release(lease)  # type: ignore[arg-type]
        await s.flush()
        assert await s.counts(["a", "b"]) == {"a": 0, "b": 0}
        await s.aclose()

    run(body)
