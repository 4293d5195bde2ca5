"""Quotas that cannot be gamed (issue 22's red-team cases, each as it was reproduced): a huge
`max_completion_tokens` where the engine reads `max_tokens`, `n` in the estimate, abandoned
non-streamed requests, invalid limit values (400, not 500, not a default), a quota script error
in Redis (a refusal, not an outage), and a Redis outage (the local share neither starts from
empty windows nor is forgotten when Redis returns). Real router, mock engines and redis-server;
the official openai SDK where a client is one."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import redis
from starlette.responses import Response

from router.request.admit.estimate import (
    CHAT_LIMITS,
    COMPLETION_LIMITS,
    NO_COMPLETION,
    BadLimit,
    estimate_tokens,
)
from router.request.admit.quota import KeyLimits, Quotas, Reservation
from router.request.admit.quota_shared import SharedQuotas
from tests.support.answers import answered, answered_async
from tests.support.harness import Cluster, Proc, backend, sha
from tests.support.wait import wait_for_async

TPM_A = "sk-hard-attack-0123456789"
TPM_C = "sk-hard-control-0123456789"
TPM_N = "sk-hard-n-0123456789"
TPM_GONE = "sk-hard-abandon-0123456789"
OPEN = "sk-hard-open-0123456789"


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    fast = module_procs.mock("fast", tokens=5)
    slow = module_procs.mock("slow", itl_ms=20, tokens=5)
    router = module_procs.router(
        {
            "backends": [backend("fast", fast, ["m"]), backend("slow", slow, ["slow"])],
            "api_keys": [
                {"sha256": sha(TPM_A), "name": "attack", "tpm": 2000},
                {"sha256": sha(TPM_C), "name": "control", "tpm": 2000},
                {"sha256": sha(TPM_N), "name": "n", "tpm": 2000},
                {"sha256": sha(TPM_GONE), "name": "gone", "tpm": 1000},
                {"sha256": sha(OPEN), "name": "open", "tpm": 10**9},  # estimated: 500 before
            ],
        }
    )
    return {"router": router, "fast": fast, "slow": slow}


def post(router: Proc, key: str, path: str, body: dict[str, Any], timeout: float = 10) -> int:
    r = httpx.post(
        router.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=timeout
    )
    return r.status_code


# --- the estimate ---------------------------------------------------------------------------


def test_the_estimate_is_an_integer_from_the_endpoints_own_field_times_n_and_clamped() -> None:
    body = {"max_tokens": 100, "max_completion_tokens": 10**19, "n": 3}
    # completions: vLLM reads max_tokens only; chat: max_completion_tokens first
    assert estimate_tokens(body, 400, COMPLETION_LIMITS) == 100 + 3 * 100
    with pytest.raises(BadLimit):  # past int64: no engine takes it
        estimate_tokens(body, 400, CHAT_LIMITS)
    body["max_completion_tokens"] = 10**18
    assert estimate_tokens(body, 400, CHAT_LIMITS, max_model_len=2048) == 100 + 3 * 2048
    assert estimate_tokens({"n": 2, "best_of": 5, "max_tokens": 10}, 40, COMPLETION_LIMITS) == 60
    assert estimate_tokens({"n": 64, "max_tokens": 7}, 0) == 64 * 7
    assert estimate_tokens({"max_tokens": 7, "n": 9}, 4000, NO_COMPLETION) == 1000  # embeddings
    assert estimate_tokens({}, 10**9, max_model_len=4096) == 4096 + 256  # prompt clamped too
    assert estimate_tokens({"max_tokens": None}, 0, default_max_tokens=33) == 33
    assert type(estimate_tokens({"max_tokens": 5}, 7)) is int


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"max_tokens": 10**400}, "max_tokens", "integer_above_max_value"),
        ({"max_tokens": "1000"}, "max_tokens", "invalid_type"),
        ({"max_tokens": 1000.0}, "max_tokens", "invalid_type"),
        ({"max_tokens": True}, "max_tokens", "invalid_type"),
        ({"max_tokens": -5}, "max_tokens", "integer_below_min_value"),
        ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens", None),
        ({"max_tokens": 5, "n": "2"}, "n", "invalid_type"),
        ({"max_tokens": 5, "n": 10**6}, "n", "integer_above_max_value"),
    ],
)
def test_a_limit_value_an_engine_would_read_otherwise_is_refused(
    body: dict[str, Any], param: str, code: str | None
) -> None:
    with pytest.raises(BadLimit) as info:
        estimate_tokens(body, 100)
    assert info.value.param == param
    assert code is None or info.value.code == code


@pytest.mark.parametrize("value", [10**400, "1000", 1000.0, True, -5])
def test_invalid_max_tokens_answers_400_in_openais_shape(
    fleet: dict[str, Proc], value: Any
) -> None:
    client = openai.OpenAI(base_url=fleet["router"].url + "/v1", api_key=OPEN, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=value,
        )
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict)
    assert body["type"] == "invalid_request_error" and body["param"] == "max_tokens"
    assert info.value.response.headers["x-request-id"]


# --- tpm bypasses, end to end ----------------------------------------------------------------


def test_a_huge_max_completion_tokens_on_completions_buys_no_more_than_the_control(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    base = {"model": "m", "prompt": "hi", "max_tokens": 100}
    control = sum(post(router, TPM_C, "/v1/completions", base) == 200 for _ in range(40))
    attack_body = {**base, "max_completion_tokens": 10**19}
    attack = sum(post(router, TPM_A, "/v1/completions", attack_body) == 200 for _ in range(40))
    # ~100 real tokens each against 2000 a minute: about 19 in both, never 40.
    assert 10 <= control <= 21
    assert attack <= control + 1


def test_n_multiplies_the_estimate(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    body["n"] = 64
    with ThreadPoolExecutor(10) as pool:
        codes = list(
            pool.map(lambda _: post(router, TPM_N, "/v1/chat/completions", body), range(10))
        )
    # 64 x 100 is over the whole 2000: at most one gets the empty window, the rest wait.
    assert codes.count(200) <= 1 and codes.count(429) >= 9


def test_abandoned_non_streamed_requests_are_charged_their_estimate(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    # ~2 s of generation each; the client gives up after 0.3 s, before any response head.
    body = {"model": "slow", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    estimate = estimate_tokens(body, len(httpx.Request("POST", "/", json=body).content))
    abandoned = 0
    refused = False
    for _ in range(1000 // estimate + 4):
        try:
            code = post(router, TPM_GONE, "/v1/chat/completions", body, timeout=0.3)
        except httpx.TimeoutException:
            abandoned += 1
            time.sleep(0.05)  # the router notices the disconnect and charges
            continue
        assert code == 429
        refused = True
        break
    assert refused, f"{abandoned} abandoned requests and no 429 under tpm 1000"
    assert abandoned <= 1000 // estimate + 1


# --- Redis: script errors and outages ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 2_000_000.0

    def __call__(self) -> float:
        return self.t


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


@pytest.mark.redis
def test_a_quota_script_error_refuses_the_request_and_is_no_outage(module_procs: Cluster) -> None:
    server = module_procs.redis()

    async def body() -> None:
        book = SharedQuotas(server.url, prefix=uuid.uuid4().hex[:8], heartbeat=False, timeout=1.0)
        await book.start()
        try:
            # An estimate Redis cannot add (past int64): no caller sends one any more, but
            # if one came, the key must not fall to the (fresh, smaller) local share.
            for _ in range(4):
                out = await answered_async(book.admit(KeyLimits("big", tpm=10**10), 10**19, "r"))
                assert isinstance(out, Response) and out.status_code == 429
            assert book.fallbacks == 0 and not book.degraded
            ok = await book.admit(KeyLimits("big", tpm=10**10), 10, "r")
            assert not isinstance(ok, Response)
            ok.close(10)
        finally:
            await book.aclose()

    run(body)


async def _admit_many(books: list[SharedQuotas], limits: KeyLimits, count: int) -> int:
    admitted = 0
    for i in range(count):
        out = await answered_async(books[i % len(books)].admit(limits, 1, "r"))
        if isinstance(out, Reservation) or not isinstance(out, Response):
            out.close(1)
            admitted += 1
    return admitted


async def _two_processes(url: str, clock: Clock) -> list[SharedQuotas]:
    prefix = uuid.uuid4().hex[:8]
    books = [
        SharedQuotas(url, prefix=prefix, clock=clock, heartbeat=False, timeout=0.2)
        for _ in range(2)
    ]
    for b in books:
        await b.start()
    for b in books:
        await b.heartbeat()
    assert [b.processes for b in books] == [2, 2]
    return books


@pytest.mark.redis
def test_an_outage_with_redis_paused_admits_at_most_one_share_more(module_procs: Cluster) -> None:
    """Redis stops answering (its data kept), then answers again: rpm 60 across two processes."""
    server = module_procs.redis()
    limits = KeyLimits("out", rpm=60)
    clock = Clock()

    async def body() -> None:
        books = await _two_processes(server.url, clock)
        try:
            before = await _admit_many(books, limits, 20)
            assert before == 20
            pause_s = 4.0
            with redis.Redis.from_url(server.url) as r:
                r.execute_command("CLIENT", "PAUSE", str(int(pause_s * 1000)), "ALL")
            during = await _admit_many(books, limits, 60)
            assert all(b.fallbacks for b in books)
            for b in books:  # the pause over, each process takes its beat again
                await wait_for_async(b.heartbeat, "Redis answers again", pause_s + 5, 0.1)
            after = await _admit_many(books, limits, 60)
            # Each share is 30 and already held 10: 20 more each, then nothing once shared.
            assert before + during + after <= 60 * (1 + 1 / 2), (before, during, after)
            assert after == 0
        finally:
            for b in books:
                await b.aclose()

    run(body)


@pytest.mark.redis
def test_an_outage_with_redis_restarted_empty_admits_at_most_one_share_more(
    procs: Cluster,
) -> None:
    """Redis killed and started again without its data: the windows come back from the
    processes that admitted."""
    server = procs.redis()
    limits = KeyLimits("restart", rpm=60)
    clock = Clock()

    async def body() -> None:
        books = await _two_processes(server.url, clock)
        try:
            before = await _admit_many(books, limits, 40)
            assert before == 40
            port = server.port
            server.kill9()
            during = await _admit_many(books, limits, 60)
            procs.redis(port=port)
            for b in books:
                await wait_for_async(b.heartbeat, "Redis answers again", 10, 0.1)
            after = await _admit_many(books, limits, 60)
            assert before + during + after <= 60 * (1 + 1 / 2), (before, during, after)
            assert after == 0
        finally:
            for b in books:
                await b.aclose()

    run(body)


def test_the_local_windows_count_what_was_admitted_elsewhere() -> None:
    clock = Clock()
    local = Quotas(clock=clock)
    limits = KeyLimits("k", rpm=10, tpm=1000, max_parallel=2)
    held = [local.take(limits, 300) for _ in range(2)]
    out = answered(local.admit_now, limits, 300, "r")
    assert isinstance(out, Response)  # two in flight: max_parallel 2
    held[0].close(100)  # 200 back
    out = local.admit_now(limits, 500, "r")
    assert isinstance(out, Reservation)
    assert dict(out.headers)[b"x-ratelimit-remaining-tokens"] == b"100"
