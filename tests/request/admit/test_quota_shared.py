"""Per-key quotas shared through Redis (real redis-server): the store with an injected clock
(sliding window, corrections, crashed replicas' slots, Redis slow), then real routers (2 replicas
x 2 workers) driven by the official openai SDK: rpm, tpm and max_parallel hold across all of
them, a cancelled stream frees its slot, Redis killed -> each process enforces its share and says
so in /readyz and a metric, and shared enforcement resumes when Redis returns."""

from __future__ import annotations

import asyncio
import signal
import threading
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import openai
import pytest
import redis
from redis.cluster import RedisCluster

from router.core.redis_client import RedisTarget
from router.request.admit.quota import KeyLimits, Reservation
from router.request.admit.quota_shared import SharedQuotas, SharedReservation, key_tag
from tests.support.answers import answered_async
from tests.support.harness import STARVED_S, Cluster, Proc, backend, late_by, sha, wait_http
from tests.support.wait import wait_for

pytestmark = pytest.mark.redis

CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


@pytest.fixture(scope="module")
def rds(module_procs: Cluster) -> Proc:
    return module_procs.redis()


def book(url: str | RedisTarget, prefix: str, clock: Clock, **kw: Any) -> SharedQuotas:
    return SharedQuotas(url, prefix=prefix, clock=clock, heartbeat=False, **{"timeout": 1.0, **kw})


def slots(url: str, prefix: str, key_id: str) -> int:
    with redis.Redis.from_url(url) as r:
        return int(r.zcard(key_tag(prefix, key_id) + ":p"))


def test_window_slides_and_corrections_land_in_the_reservations_bucket(rds: Proc) -> None:
    prefix, clock = uuid.uuid4().hex, Clock()
    limits = KeyLimits("team-a", rpm=None, tpm=1000)

    async def body() -> None:
        a, b = book(rds.url, prefix, clock), book(rds.url, prefix, clock)
        await a.start()
        await b.start()
        first = await a.admit(limits, 600, "r1")
        assert isinstance(first, SharedReservation)
        # The other replica sees the 600 reserved: 500 more does not fit.
        refused = await answered_async(b.admit(limits, 500, "r2"))
        assert not isinstance(refused, SharedReservation | Reservation)
        assert refused.status_code == 429
        headers = dict(refused.raw_headers)
        assert headers[b"x-ratelimit-remaining-tokens"] == b"400"
        assert 1 <= int(headers[b"retry-after"]) <= 61
        clock.t += 30
        first.close(100)  # the real usage: 500 tokens go back, to the bucket 30 s ago
        await a.flush()
        held = await b.admit(limits, 500, "r3")
        assert isinstance(held, SharedReservation)
        assert dict(held.headers)[b"x-ratelimit-remaining-tokens"] == b"400"
        held.close(500)
        await b.flush()
        # 31 s later the first request's bucket (100 real tokens) leaves the window, and its
        # refund with it; the second one (500) still counts.
        clock.t += 31
        third = await a.admit(limits, 500, "r4")
        assert isinstance(third, SharedReservation)
        assert dict(third.headers)[b"x-ratelimit-remaining-tokens"] == b"0"
        await a.aclose()
        await b.aclose()

    run(body)


def test_parallel_slots_of_a_crashed_replica_expire_and_live_ones_are_kept(rds: Proc) -> None:
    prefix, clock = uuid.uuid4().hex, Clock()
    limits = KeyLimits("par", max_parallel=2)

    async def body() -> None:
        alive = book(rds.url, prefix, clock, slot_ttl=10)
        crashed = book(rds.url, prefix, clock, slot_ttl=10)
        await alive.start()
        await crashed.start()
        mine = await alive.admit(limits, 10, "a")
        lost = await crashed.admit(limits, 10, "b")
        assert isinstance(mine, SharedReservation) and isinstance(lost, SharedReservation)
        refused = await answered_async(alive.admit(limits, 10, "c"))
        assert refused.status_code == 429  # type: ignore[union-attr]
        # `crashed` never beats again; `alive` re-stamps its slot every ttl/3.
        for _ in range(4):
            clock.t += 3
            assert await alive.heartbeat()
        assert slots(rds.url, prefix, "par") == 1  # only the live one is left
        again = await alive.admit(limits, 10, "d")
        assert isinstance(again, SharedReservation)
        mine.close(None)
        again.close(None)
        await alive.flush()
        assert slots(rds.url, prefix, "par") == 0
        await alive.aclose()
        await crashed.aclose()

    run(body)


def test_a_stopping_replica_gives_back_the_slots_of_requests_still_running(rds: Proc) -> None:
    prefix, clock = uuid.uuid4().hex, Clock()
    limits = KeyLimits("stopping", max_parallel=1)

    async def body() -> None:
        stopping = book(rds.url, prefix, clock)
        other = book(rds.url, prefix, clock)
        await stopping.start()
        await other.start()
        held = await stopping.admit(limits, 10, "a")  # a stream longer than the drain
        assert isinstance(held, SharedReservation)
        refused = await answered_async(other.admit(limits, 10, "b"))
        assert refused.status_code == 429  # type: ignore[union-attr]
        await stopping.aclose()
        assert slots(rds.url, prefix, "stopping") == 0  # free now, not a slot ttl later
        mine = await other.admit(limits, 10, "c")
        assert isinstance(mine, SharedReservation)
        held.close(500)  # the request ends after its replica's store closed: nothing sent
        await asyncio.sleep(0.05)
        assert slots(rds.url, prefix, "stopping") == 1  # `other`'s slot is left alone
        mine.close(None)
        await other.aclose()

    run(body)


def test_redis_slower_than_the_timeout_costs_at_most_the_timeout_then_shares_locally(
    procs: Cluster,
) -> None:
    server = procs.redis()
    prefix, clock = uuid.uuid4().hex, Clock()
    limits = KeyLimits("slow", rpm=10)
    changes: list[bool] = []

    async def body() -> None:
        other = book(server.url, prefix, clock)
        await other.start()  # a second process registered: each one's share is half
        q = book(server.url, prefix, clock, on_degraded=changes.append, timeout=0.1)
        await q.start()
        assert q.processes == 2
        server.signal(signal.SIGSTOP)
        try:
            late: list[float] = []
            answers: list[Any] = []
            while not q.degraded and len(answers) < 30:
                # Never a hang: each admission is done within a timeout of a timer of one timeout
                # started with it, whose own lateness is the machine's.
                answer, lateness = await late_by(answered_async(q.admit(limits, 1, "x")), 0.1)
                answers.append(answer)
                late.append(lateness)
            assert max(late) < 0.1
            answers += [await answered_async(q.admit(limits, 1, "x")) for _ in range(6)]
            assert q.degraded and changes == [True]
            admitted = [a for a in answers if isinstance(a, Reservation)]
            assert len(admitted) == 5  # this process's share: rpm 10 / 2 processes
            assert q.status() == {"mode": "local_share", "processes": 2}
        finally:
            server.signal(signal.SIGCONT)
        assert await q.heartbeat()
        assert not q.degraded and changes == [True, False]
        assert isinstance(await q.admit(limits, 1, "y"), SharedReservation)
        await q.aclose()
        assert await other.heartbeat() and other.processes == 1  # a stopped one leaves at once
        await other.aclose()

    run(body)


def test_keys_spread_over_a_redis_cluster_and_each_key_is_enforced_on_its_shard(
    procs: Cluster,
) -> None:
    nodes = procs.redis_cluster(3)
    target = RedisTarget(url=nodes[0].url, cluster=True)
    prefix, clock = uuid.uuid4().hex, Clock()
    names = [f"team-{i}" for i in range(6)]

    async def body() -> None:
        a, b = book(target, prefix, clock), book(target, prefix, clock)
        await a.start()
        await b.start()
        assert b.processes == 2 and await a.heartbeat() and a.processes == 2
        for name in names:
            limits = KeyLimits(name, rpm=3, max_parallel=2)
            held = [await answered_async(q.admit(limits, 1, "r")) for q in (a, b, a)]
            assert [isinstance(h, SharedReservation) for h in held] == [True, True, False]
            assert "parallel" in bytes(held[2].body).decode()  # type: ignore[union-attr]
            held[0].close(None)  # type: ignore[union-attr]
            await a.flush()
            assert isinstance(await b.admit(limits, 1, "r"), SharedReservation)
            refused = await answered_async(a.admit(limits, 1, "r"))  # the third: rpm 3 reached
            assert "requests per minute" in bytes(refused.body).decode()  # type: ignore[union-attr]
        await a.aclose()
        await b.aclose()

    run(body)
    # Keys of different client keys live on different shards.
    with RedisCluster(host="127.0.0.1", port=nodes[0].port) as rc:
        owners = {rc.get_node_from_key(key_tag(prefix, n) + ":r").port for n in names}
    assert len(owners) > 1


# --- real routers ----------------------------------------------------------------------------

TPM, RPM, PAR = "sk-shared-tpm-0123456789", "sk-shared-rpm-0123456789", "sk-shared-par-0123456789"


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster, rds: Proc) -> list[Proc]:
    """Two replicas with two workers each, one Redis."""
    slow = module_procs.mock("s", itl_ms=20, tokens=5)  # streams held open
    fast = module_procs.mock("f", tokens=5)  # bursts
    cfg = {
        "backends": [backend("s", slow), backend("f", fast, models={"fast": "mock-model"})],
        "redis_url": rds.url,
        "redis_lease_ttl": 3,
        "redis_timeout": 0.5,  # a loaded test machine; the timeout path has its own test
        "api_keys": [
            {"sha256": sha(TPM), "name": "tpm", "tpm": 3000},
            {"sha256": sha(RPM), "name": "rpm", "rpm": 30},
            {"sha256": sha(PAR), "name": "par", "max_parallel": 2},
        ],
    }
    routers = [module_procs.router(cfg, workers=2, wait=False) for _ in range(2)]
    for r in routers:
        wait_http(r.url + "/healthz", proc=r.popen)
    return routers


def burst(routers: list[Proc], key: str, n: int, body: dict[str, Any]) -> list[httpx.Response]:
    """`n` requests from 8 threads spread over every replica."""
    out: list[httpx.Response] = []
    lock = threading.Lock()
    todo = list(range(n))

    def user(i: int) -> None:
        with httpx.Client(timeout=30) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    j = todo.pop()
                r = http.post(
                    routers[(i + j) % len(routers)].url + CHAT,
                    json=body,
                    headers={"authorization": f"Bearer {key}"},
                )
                with lock:
                    out.append(r)

    threads = [threading.Thread(target=user, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_tpm_holds_across_two_replicas_of_two_workers(fleet: list[Proc]) -> None:
    body = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    answers = burst(fleet, TPM, 100, body)  # 100 x 51 real tokens: far over 3000
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert len(ok) + len(refused) == 100
    admitted = sum(r.json()["usage"]["total_tokens"] for r in ok)
    # Per process, four processes would have let ~4 x 3000 through. The lower bound: the window
    # fills up to one estimate (~75) plus the unspent part of the estimates in flight (8 x ~25).
    assert 0.85 * 3000 <= admitted <= 1.05 * 3000
    err = refused[0].json()["error"]
    assert err["type"] == err["code"] == "rate_limit_exceeded"
    assert refused[0].headers["x-ratelimit-limit-tokens"] == "3000"
    assert ok[0].headers["x-ratelimit-limit-tokens"] == "3000"


def test_rpm_holds_exactly_across_replicas(fleet: list[Proc]) -> None:
    body = {"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answers = burst(fleet, RPM, 50, body)
    statuses = sorted(r.status_code for r in answers)
    assert statuses == [200] * 30 + [429] * 20
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in answers)
    assert remaining[-1] == 29 and remaining[:21] == [0] * 21


def test_max_parallel_holds_across_replicas_and_a_cancelled_stream_frees_its_slot(
    fleet: list[Proc], rds: Proc
) -> None:
    a, b = fleet
    body = {"model": "m", "stream": True, "messages": [], "max_tokens": 300}  # ~6 s
    auth = {"authorization": f"Bearer {PAR}"}

    def sdk(router: Proc) -> openai.OpenAI:
        return openai.OpenAI(base_url=router.url + "/v1", api_key=PAR, max_retries=0)

    def one(router: Proc) -> Any:
        return sdk(router).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )

    with httpx.Client(timeout=20) as http:
        with http.stream("POST", a.url + CHAT, json=body, headers=auth) as first:
            assert first.status_code == 200
            with http.stream("POST", b.url + CHAT, json=body, headers=auth) as second:
                assert second.status_code == 200
                for router in (a, b):
                    with pytest.raises(openai.RateLimitError) as info:
                        one(router)
                    assert "parallel" in str(info.value.body)
                assert slots(rds.url, "sluicegate", "par") == 2
            # The client left the second stream: its slot leaves Redis at once, not at expiry.
            wait_for(lambda: slots(rds.url, "sluicegate", "par") == 1, "its slot gone", 2)
            assert one(a).choices[0].message.content is not None
    wait_for(lambda: slots(rds.url, "sluicegate", "par") == 0, "every slot gone", 2)


def test_redis_killed_each_process_enforces_its_share_and_says_so(procs: Cluster) -> None:
    server = procs.redis()
    mock = procs.mock("k", tokens=2)
    key = "sk-shared-kill-0123456789"
    router = procs.router(
        {
            "backends": [backend("k", mock)],
            "redis_url": server.url,
            "redis_lease_ttl": 1,
            # A starved machine's Redis misses the 50 ms default now and then, and a worker
            # then counts on its share for a moment: here Redis is killed, not slow.
            "redis_timeout": 0.5,
            "api_keys": [{"sha256": sha(key), "name": "k", "rpm": 1000, "max_parallel": 50}],
        },
        workers=2,
    )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)

    def ask() -> Any:
        return client.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )

    def quotas() -> dict[str, Any]:
        return dict(httpx.get(router.url + "/readyz", timeout=STARVED_S).json()["quotas"])

    def all_say(mode: str) -> Callable[[], bool]:
        # Each answer comes from either worker: several in a row must say it.
        return lambda: all(quotas() == {"mode": mode, "processes": 2} for _ in range(8))

    def degraded_metric() -> str:
        text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
        return next(x for x in text.splitlines() if x.startswith("sluicegate_quota_degraded "))

    wait_for(all_say("shared"), "shared")  # both workers registered and see each other
    assert ask().headers["x-ratelimit-limit-requests"] == "1000"
    port = server.port
    server.kill9()
    # Each worker finds Redis gone at its next refresh (`redis_lease_ttl`, 1 s) and its own
    # calls' timeouts; a starved machine's full suite took longer than the default 10 s once.
    wait_for(all_say("local_share"), "each process on its share", STARVED_S)
    wait_for(lambda: degraded_metric() == "sluicegate_quota_degraded 1.0", "degraded")
    # Served, each worker against its share of the limit.
    wait_for(
        lambda: all(ask().headers["x-ratelimit-limit-requests"] == "500" for _ in range(6)),
        "every answer limited to its share",
    )
    procs.redis(port=port)
    wait_for(all_say("shared"), "shared again")
    wait_for(lambda: degraded_metric() == "sluicegate_quota_degraded 0.0", "recovered")
    wait_for(
        lambda: all(ask().headers["x-ratelimit-limit-requests"] == "1000" for _ in range(6)),
        "every answer limited to the whole",
    )
