"""The prefix index shared in Redis: two router replicas route as one, and Redis dying loses
affinity but no request.

Real processes: one redis-server, four mock vLLM engines with prefix caching, routers with
`balancer: cache_aware` (two sharing Redis, one without it as the control), the openai SDK as
the client. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.support.harness import STARVED_S, Cluster, Proc, backend, in_flight, wait_http
from tests.support.wait import wait_for

ENGINE = ["--engine", "--max-num-seqs", "16", "--kv-tokens", "65536", "--decode-ms", "2"]
ENGINE += ["--decode-ms-per-seq", "0", "--prefill-ms-per-1k", "2"]
NAMES = ("a", "b", "c", "d")
WARNING = "redis prefix index unavailable"
REDIS_TIMEOUT = 0.5
LEASE_TTL = 10.0  # redis_lease_ttl's default: the fleet leaves it


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Any]]:
    c = Cluster()
    try:
        redis = c.redis()
        with concurrent.futures.ThreadPoolExecutor(len(NAMES)) as pool:  # they start together
            started = {n: pool.submit(c.mock, n, engine_args=ENGINE) for n in NAMES}
            mocks = {n: f.result() for n, f in started.items()}
        config = {
            "backends": [backend(n, m) for n, m in mocks.items()],
            "balancer": "cache_aware",
            "engine_metrics": {"interval": 0.1, "timeout": 1, "stale_after": 3},
            "expose_backend_header": True,
            "health": {"interval": 60},
        }
        shared = {"SLUICEGATE_REDIS_URL": redis.url, "SLUICEGATE_REDIS_TIMEOUT": str(REDIS_TIMEOUT)}
        routers = [c.router(config, env=shared, wait=False) for _ in range(2)]
        routers.append(c.router(config, wait=False))  # the control: its own index only
        for r in routers:
            wait_http(r.url + "/healthz", proc=r.popen)
        yield {"cluster": c, "redis": redis, "mocks": mocks, "routers": routers}
    finally:
        c.close()


def client(proc: Proc) -> OpenAI:
    return OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0, timeout=20)


def handbook(customer: str, chars: int = 6000) -> str:
    text = f"You answer for {customer}. Policy {customer}: be precise, cite sections. "
    return (text * (chars // len(text) + 1))[:chars]


def turn(router: Proc, messages: list[Any]) -> tuple[str, int, int, str]:
    """One chat turn: (backend, prompt tokens, cached tokens, the answer)."""
    raw = client(router).chat.completions.with_raw_response.create(
        model="m", messages=messages, max_tokens=4
    )
    done = raw.parse()
    assert done.usage is not None
    details = done.usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details is not None else 0
    answer = done.choices[0].message.content or ""
    return raw.headers["x-sluicegate-backend"], done.usage.prompt_tokens, cached, answer


def conversation(name: str) -> list[Any]:
    return [
        {"role": "system", "content": handbook(name)},
        {"role": "user", "content": f"{name}: what does section 4 say?"},
    ]


def follow_up(messages: list[Any], answer: str) -> list[Any]:
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "5?"}]


def counter(router: Proc, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(router.url + "/metrics", timeout=STARVED_S).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_follow_up_through_the_other_replica_lands_on_the_same_engine(
    fleet: dict[str, Any],
) -> None:
    one, two, alone = fleet["routers"]
    firsts: dict[str, tuple[str, int, list[Any]]] = {}
    for k in range(8):
        messages = conversation(f"shared-{k}")
        engine, prompt_tokens, _, answer = turn(one, messages)
        firsts[f"shared-{k}"] = (engine, prompt_tokens, follow_up(messages, answer))
    # Spread over engines: no single engine that any router would pick anyway.
    assert len({engine for engine, _, _ in firsts.values()}) >= 2
    # Records are written behind (router/request/placement/affinity_store.py): the next lookup
    # through the same replica carries every one queued before it to Redis.
    turn(one, conversation("flush"))
    prefix_before = counter(two, "sluicegate_routing_decisions_total", reason="prefix")
    for engine, prompt_tokens, messages in firsts.values():
        landed, _, cached, _ = turn(two, messages)
        assert landed == engine
        assert cached >= 0.9 * prompt_tokens  # the engine skipped the first turn's prefill
    after = counter(two, "sluicegate_routing_decisions_total", reason="prefix")
    assert after - prefix_before == 8
    assert counter(two, "sluicegate_affinity_fallbacks_total") == 0
    assert counter(two, "sluicegate_affinity_shared_entries") > 0
    # The control: a router with its own index knows none of these prefixes, so it places them
    # as new groups, spread in the order it meets them (balancers/prefix_homes.py): met in
    # the other order, some land elsewhere.
    misses = sum(
        turn(alone, messages)[0] != engine for engine, _, messages in reversed(firsts.values())
    )
    assert misses > 0
    assert counter(alone, "sluicegate_routing_decisions_total", reason="prefix") == 0


def test_redis_killed_mid_run_loses_affinity_but_no_request(fleet: dict[str, Any]) -> None:
    c: Cluster = fleet["cluster"]
    one, two, _ = fleet["routers"]
    redis: Proc = fleet["redis"]
    stop = threading.Event()
    done: list[str] = []
    errors: list[BaseException] = []

    def talk(worker: int) -> None:
        i = 0
        while not stop.is_set() and i < 400:
            messages = conversation(f"flow-{worker}-{i}")
            try:
                _, _, _, answer = turn(one, messages)
                turn(two, follow_up(messages, answer))
                done.append(f"{worker}-{i}")
            except BaseException as exc:  # the test reports every failure
                errors.append(exc)
            i += 1

    fallbacks = [counter(r, "sluicegate_affinity_fallbacks_total") for r in (one, two)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        workers = [pool.submit(talk, w) for w in range(3)]
        try:
            wait_for(lambda: len(done) >= 6, "traffic before the outage", 15.0)
            port = redis.port
            redis.kill9()  # by its PID; requests are in flight on both replicas
            during = len(done)
            wait_for(lambda: len(done) >= during + 12, "traffic during the outage", 15.0)
            back = c.redis(port=port)
            fleet["redis"] = back
            after = len(done)
            wait_for(lambda: len(done) >= after + 6, "traffic after the outage", 15.0)
        finally:
            stop.set()
            for w in workers:
                w.result(timeout=30)
    assert not errors, errors[:3]
    now = [counter(r, "sluicegate_affinity_fallbacks_total") for r in (one, two)]
    assert now[0] > fallbacks[0] and now[1] > fallbacks[1]  # both routed on their own index
    for r in (one, two):
        assert r.log().count(WARNING) == 1, r.log()[-2000:]  # once per outage, not per request
        # Every lease released: the answer reaches the client before the router's release (a
        # ZREM handed to the store's task, bounded by the Redis timeout; owed ones go with the
        # next heartbeat, a third of the lease TTL), so poll over twice that.
        settle = 2 * (LEASE_TTL / 3 + REDIS_TIMEOUT)
        wait_for(lambda r=r: in_flight(r) == 0, "every lease released", within=settle)
    # Shared routing resumes: once the replicas answer from Redis again, follow-ups through the
    # other replica land where their first turns went (4 in a row: 1 in 256 by chance).
    deadline = time.monotonic() + 10
    streak, k = 0, 0
    while streak < 4:
        assert time.monotonic() < deadline, "shared routing did not resume"
        messages = conversation(f"resumed-{k}")
        engine, _, _, answer = turn(one, messages)
        landed, _, _, _ = turn(two, follow_up(messages, answer))
        streak = streak + 1 if landed == engine else 0
        k += 1
    stalled = [counter(r, "sluicegate_affinity_fallbacks_total") for r in (one, two)]
    messages = conversation("resumed-last")
    turn(two, follow_up(messages, turn(one, messages)[3]))
    assert [counter(r, "sluicegate_affinity_fallbacks_total") for r in (one, two)] == stalled
