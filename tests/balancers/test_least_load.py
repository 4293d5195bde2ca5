"""`least_load` as a pure policy: exact least_inflight without readings, stale last, bursts
spread by dispatches since the reading; and through both in-flight stores (local, Redis)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import MappingProxyType

from balancers.base import Candidate
from balancers.context import NO_CONTEXT, PickContext
from balancers.inflight.local import LocalInflight
from balancers.least_inflight import LeastInflight
from balancers.least_load import LeastLoad
from router.core.backend import Backend
from router.core.engine import EngineReading


def reading(running: float = 0, waiting: float = 0, kv: float = 0.0, **kw: object) -> EngineReading:
    return EngineReading(waiting, running, kv, None, None, 1.0, kw.pop("seq", 1), **kw)  # type: ignore[arg-type]


def test_without_readings_it_picks_exactly_as_least_inflight() -> None:
    gen = random.Random(7)
    a, b = LeastLoad(random.Random(3)), LeastInflight(random.Random(3))
    for _ in range(2000):
        n = gen.randint(1, 40)
        cands = [
            Candidate(f"b{i}", gen.choice((1.0, 2.0, 0.5)), gen.randint(0, 5)) for i in range(n)
        ]
        exclude = {f"b{gen.randint(0, n)}"}
        assert a.pick(cands, PickContext(exclude)) == b.pick(cands, PickContext(exclude))


def test_engine_load_wins_over_our_own_counts() -> None:
    bal = LeastLoad(random.Random(1))
    busy = Candidate("busy", 1.0, 0, reading(running=20))  # hidden load: not ours
    idle = Candidate("idle", 1.0, 3, reading(running=3))
    assert bal.pick([busy, idle]).candidate == idle


def test_queue_and_full_kv_weigh_more_than_running() -> None:
    bal = LeastLoad(random.Random(1))
    queued = Candidate("queued", 1.0, 0, reading(running=4, waiting=2))
    running = Candidate("running", 1.0, 0, reading(running=10))
    assert bal.pick([queued, running]).candidate == running
    full = Candidate("full", 1.0, 0, reading(running=2, kv=1.0))
    roomy = Candidate("roomy", 1.0, 0, reading(running=6, kv=0.5))
    assert bal.pick([full, roomy]).candidate == roomy


def test_stale_reading_ranks_last_never_idle() -> None:
    bal = LeastLoad(random.Random(1))
    stale = Candidate("stale", 1.0, 0, reading(stale=True))
    busy = Candidate("busy", 1.0, 9, reading(running=30, waiting=5))
    assert all(bal.pick([stale, busy]).candidate == busy for _ in range(50))
    # Only stale ones left: the fewest in flight among them.
    other = Candidate("other", 1.0, 4, reading(stale=True))
    assert bal.pick([other, stale]).candidate == stale


def test_a_burst_between_two_readings_spreads_out() -> None:
    store, bal = LocalInflight(), LeastLoad(random.Random(1))
    backends = _backends("a", "b", "c")
    readings = {"a": reading(running=0), "b": reading(running=2), "c": reading(running=4)}
    leases = [store.acquire_now(backends, bal, NO_CONTEXT, readings) for _ in range(12)]
    # Counting its own requests since the reading, it levels the three at 8 each.
    assert Counter(x.backend for x in leases if x) == {"a": 6, "b": 4, "c": 2}
    # Requests that finished since the reading free their place again.
    for lease in leases:
        if lease and lease.backend == "a":
            store.release(lease)
    more = [store.acquire_now(backends, bal, NO_CONTEXT, readings) for _ in range(6)]
    assert Counter(x.backend for x in more if x) == {"a": 6}
    # A new reading (seq 2) already includes those requests: counting starts over from it.
    fresh = {n: reading(running=8, seq=2) for n in ("a", "b", "c")}
    again = [store.acquire_now(backends, bal, NO_CONTEXT, fresh) for _ in range(3)]
    assert Counter(x.backend for x in again if x) == {"a": 1, "b": 1, "c": 1}


def test_our_request_that_ended_after_the_scrape_is_not_seen_on_the_engine() -> None:
    """A reading taken while our one request waited there, first seen after it ended: with the
    count at the scrape it is an idle engine, not one with a request queued."""
    bal = LeastLoad(random.Random(1))
    caught = reading(waiting=1, inflight_at=1)  # the scrape caught our request in the queue
    assert bal.score(Candidate("a", 1.0, 0, caught)) == bal.score(Candidate("b", 1.0, 0, reading()))
    # Without the count at the scrape the reading pairs with the count when first seen: the
    # request looks queued still (the balancer cannot tell it from someone else's).
    blind = LeastLoad(random.Random(1))
    assert blind.score(Candidate("a", 1.0, 0, reading(waiting=1))) == 4.0
    # Ours finished since come off the queue first, then the batch; never below idle.
    two_ended = reading(running=2, waiting=1, seq=2, inflight_at=3)
    assert bal.score(Candidate("c", 1.0, 1, two_ended)) == 1.0
    all_ended = reading(running=1, waiting=1, seq=2, inflight_at=5)
    assert bal.score(Candidate("d", 1.0, 0, all_ended)) == 0.0


def test_weight_scales_the_score() -> None:
    bal = LeastLoad(random.Random(1))
    big = Candidate("big", 4.0, 0, reading(running=8))
    small = Candidate("small", 1.0, 0, reading(running=3))
    assert bal.pick([big, small]).candidate == big


def _backends(*names: str) -> list[Backend]:
    return [Backend(n, "http://127.0.0.1:1", "vllm", MappingProxyType({"m": "m"})) for n in names]


def test_local_store_hands_readings_to_the_balancer() -> None:
    store = LocalInflight()
    readings = {"a": reading(running=9), "b": reading(running=1)}
    lease = store.acquire_now(_backends("a", "b"), LeastLoad(), NO_CONTEXT, readings)
    assert lease is not None and lease.backend == "b"


def test_redis_store_generic_path_with_readings(tmp_path: object) -> None:
    from balancers.inflight.redis import RedisInflight
    from tests.support.harness import Cluster

    c = Cluster()
    try:
        redis = c.redis()

        async def run() -> list[str]:
            store = RedisInflight(redis.url, timeout=1.0, heartbeat=False)
            await store.start()
            try:
                readings = {"a": reading(running=9), "b": reading(running=1)}
                bal = LeastLoad(random.Random(2))
                picked = []
                for _ in range(10):
                    lease = await store.acquire(_backends("a", "b"), bal, NO_CONTEXT, readings)
                    assert lease is not None
                    picked.append(lease.backend)
                counts = await store.counts(["a", "b"])
                assert counts == {"a": picked.count("a"), "b": picked.count("b")}
                return picked
            finally:
                await store.aclose()

        picked = asyncio.run(run())
        # b levels with a at 9 (8 of ours), then they alternate.
        assert picked[:8] == ["b"] * 8 and set(picked[8:]) <= {"a", "b"}
    finally:
        c.close()


def test_metrics_path_defaults_and_off_switches() -> None:
    from router.core.settings import BackendConfig

    def cfg(**kw: object) -> Backend:
        return Backend.from_config(
            BackendConfig.model_validate({"name": "x", "url": "http://h:1", "models": ["m"], **kw})
        )

    assert cfg().metrics_path == "/metrics"
    assert cfg(kind="sglang").metrics_path == "/metrics"
    assert cfg(metrics_path=None).metrics_path is None
    assert cfg(metrics_path="").metrics_path is None  # Helm drops nulls from values
    assert cfg(kind="openai").metrics_path is None  # never scraped
