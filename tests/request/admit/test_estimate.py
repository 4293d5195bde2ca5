"""The tpm estimate counts work the body does not show (issue 46, cases 5 and 24): a completions
batch (`prompt` as a list) per prompt, `n` for each, a stored conversation continued with
`previous_response_id`; and a request larger than the key's whole tpm is refused with 429
`request_too_large` even into an empty window, by the local quota and by the one shared through
Redis. Real routers, mock engines and redis-server; the official openai SDK as the client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import redis

from router.request.admit.estimate import (
    CHAT_LIMITS,
    COMPLETION_LIMITS,
    MAX_ESTIMATE,
    NO_COMPLETION,
    estimate_tokens,
)
from router.request.admit.quota import KeyLimits, Quotas, Reservation
from tests.support.answers import answered
from tests.support.harness import Cluster, Proc, backend, sha, stats
from tests.support.wait import wait_for

BATCH = "sk-est-batch-0123456789"
N = "sk-est-n-0123456789"
WIDE = "sk-est-wide-0123456789"
HIST = "sk-est-history-0123456789"
HIST_WIDE = "sk-est-history-wide-0123456789"


def keys() -> list[dict[str, Any]]:
    return [
        {"sha256": sha(BATCH), "name": "batch", "tpm": 2000},
        {"sha256": sha(N), "name": "n", "tpm": 2000},
        {"sha256": sha(WIDE), "name": "wide", "tpm": 1_000_000},
        {"sha256": sha(HIST), "name": "history", "tpm": 3000},
        {"sha256": sha(HIST_WIDE), "name": "history-wide", "tpm": 1_000_000},
    ]


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    c = module_procs
    a, b = c.mock("a", tokens=5), c.mock("b", tokens=5)
    server = c.redis()
    local = c.router({"backends": [backend("a", a)], "api_keys": keys()})
    shared = {
        "backends": [backend("a", a), backend("b", b)],
        "balancer": "round_robin",
        "api_keys": keys(),
    }
    # 0.5 s: Redis must answer for the replicas to share (the 50 ms default is a serving
    # budget a loaded test machine can miss).
    env = {"SLUICEGATE_REDIS_URL": server.url, "SLUICEGATE_REDIS_TIMEOUT": "0.5"}
    r1 = c.router(shared, env=env)
    r2 = c.router(shared, env=env)
    return {"local": local, "r1": r1, "r2": r2, "a": a, "b": b, "redis": server}


def oai(router: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=20)


def post(router: Proc, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        router.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=20
    )


def reached(mock: Proc, path: str) -> int:
    return sum(1 for r in stats(mock)["recent"] if r.get("path") == path)


def assert_too_large(error: openai.RateLimitError, tpm: int) -> None:
    body = error.body
    assert isinstance(body, dict)
    assert body["code"] == "request_too_large" and body["type"] == "rate_limit_exceeded"
    assert f"{tpm} tokens per minute" in body["message"]
    headers = error.response.headers
    # Waiting cannot help: no Retry-After, and the SDKs are told not to retry.
    assert "retry-after" not in headers and headers["x-should-retry"] == "false"
    assert headers["x-ratelimit-limit-tokens"] == str(tpm) and headers["x-request-id"]


# --- the estimate ---------------------------------------------------------------------------


def test_the_estimate_counts_each_prompt_of_a_batch_n_for_each_and_a_stored_history() -> None:
    batch = {"prompt": ["hi"] * 200, "max_tokens": 10}
    assert estimate_tokens(batch, 1000, COMPLETION_LIMITS) == 250 + 200 * 10
    assert estimate_tokens({**batch, "n": 3}, 1000, COMPLETION_LIMITS) == 250 + 200 * 3 * 10
    ids = {"prompt": [[1, 2, 3]] * 7}  # token-id lists: a batch too, the default budget each
    assert estimate_tokens(ids, 400, COMPLETION_LIMITS, 256) == 100 + 7 * 256
    one = {"prompt": [1, 2, 3], "max_tokens": 10}  # one prompt of ids
    assert estimate_tokens(one, 400, COMPLETION_LIMITS) == 110
    assert estimate_tokens({"n": 64, "max_tokens": 1000}, 400, CHAT_LIMITS) == 100 + 64_000
    # A stored conversation the body does not show; each prompt is at most max_model_len.
    assert estimate_tokens({"max_output_tokens": 5}, 400, ("max_output_tokens",)) == 105
    assert estimate_tokens({"max_output_tokens": 5}, 400, ("max_output_tokens",), history=20_000)
    got = estimate_tokens(
        {"max_output_tokens": 5}, 400, ("max_output_tokens",), max_model_len=4096, history=10**9
    )
    assert got == 4096 + 5
    # A batch is clamped per prompt, not as one; embeddings (no completion) never multiply.
    assert estimate_tokens(batch, 10**7, COMPLETION_LIMITS, max_model_len=1000) == 200 * 1010
    assert estimate_tokens({"prompt": ["x"] * 9}, 4000, NO_COMPLETION) == 1000
    # The most any body can ask stays an exact integer, below 2^53.
    huge = {"prompt": ["x"] * 10**6, "n": 1024, "max_tokens": 10**9}
    got = estimate_tokens(huge, 10**7, COMPLETION_LIMITS, max_model_len=2**24)
    assert got == MAX_ESTIMATE < 2**53


def test_a_request_over_the_whole_limit_is_refused_and_a_share_still_waits() -> None:
    quotas = Quotas(clock=lambda: 1000.0)
    limits = KeyLimits("k", tpm=2000)
    refused = answered(quotas.admit_now, limits, 2001, "r1")
    assert not isinstance(refused, Reservation) and refused.status_code == 429
    assert quotas.in_use("k") == (0, 0, 0)  # nothing reserved
    assert isinstance(quotas.admit_now(limits, 2000, "r2"), Reservation)  # exactly the limit
    # Redis down: a process's share (1000 of 2000) still takes what fits the whole key, once
    # its window is empty.
    share = KeyLimits("s", tpm=1000)
    assert isinstance(quotas.admit_now(share, 1500, "r3", whole_tpm=2000), Reservation)
    refused = answered(quotas.admit_now, share, 2500, "r4", whole_tpm=2000)
    assert not isinstance(refused, Reservation) and b"request_too_large" in refused.body


# --- end to end -------------------------------------------------------------------------------


def test_a_batch_of_prompts_is_charged_per_prompt(fleet: dict[str, Proc]) -> None:
    router = fleet["local"]
    before = reached(fleet["a"], "/v1/completions")
    client = oai(router, BATCH)

    def batch(_: int) -> openai.RateLimitError | None:
        try:
            client.completions.create(model="m", prompt=["hi"] * 200, max_tokens=250)
        except openai.RateLimitError as exc:
            return exc
        return None

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(batch, range(10)))
    # 200 x 250 = 50,000 tokens against 2000 a minute: none admitted, even into an empty window.
    for answer in answers:
        assert answer is not None, "a 200-prompt batch was admitted"
        assert_too_large(answer, 2000)
    assert reached(fleet["a"], "/v1/completions") == before
    # A batch that fits reserves each prompt's budget (the remaining-tokens header shows it).
    r = post(
        router, WIDE, "/v1/completions", {"model": "m", "prompt": ["hi"] * 4, "max_tokens": 50}
    )
    assert r.status_code == 200
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 1_000_000 - 4 * 50


@pytest.mark.parametrize("where", ["local", "r1"])
def test_n_over_the_whole_limit_is_refused_into_an_empty_window(
    fleet: dict[str, Proc], where: str
) -> None:
    """Locally and through Redis: 64 x 1000 against tpm 2000 is never admitted."""
    router = fleet[where]
    client = oai(router, N)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], n=64, max_tokens=1000
        )
    assert_too_large(info.value, 2000)
    # Nothing was reserved for it: the window is as empty as before.
    r = post(
        router,
        N,
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    )
    assert r.status_code == 200
    assert int(r.headers["x-ratelimit-remaining-tokens"]) > 2000 - 100


def test_a_continued_conversation_is_charged_its_stored_history(fleet: dict[str, Proc]) -> None:
    """tpm 3000: a ~2000-token conversation, then 8 follow-ups at once that each send a few
    bytes but make the engine read the whole conversation again: none fits what is left."""
    router = fleet["local"]
    first = post(
        router,
        HIST,
        "/v1/responses",
        {"model": "m", "input": "word " * 1600, "max_output_tokens": 5},
    )
    assert first.status_code == 200, first.text
    size = first.json()["usage"]["total_tokens"]
    assert 1500 < size < 2500
    follow = {
        "model": "m",
        "input": "and then?",
        "max_output_tokens": 5,
        "previous_response_id": first.json()["id"],
    }
    with ThreadPoolExecutor(8) as pool:
        codes = [
            r.status_code
            for r in pool.map(lambda _: post(router, HIST, "/v1/responses", follow), range(8))
        ]
    assert codes == [429] * 8


def test_the_history_size_reaches_the_other_replicas(fleet: dict[str, Proc]) -> None:
    """Made through one replica, continued through another: the size went through Redis."""
    first = post(
        fleet["r1"],
        HIST_WIDE,
        "/v1/responses",
        {"model": "m", "input": "word " * 8000, "max_output_tokens": 5},
    )
    assert first.status_code == 200, first.text
    response_id, size = first.json()["id"], first.json()["usage"]["total_tokens"]
    store = redis.Redis.from_url(fleet["redis"].url)

    def sized() -> bool:
        raw = store.get(f"sluicegate:resp:{response_id}")
        return raw is not None and raw.rsplit(b"\x1f", 1)[-1] not in (b"", b"0")

    wait_for(sized, "the conversation's size written to Redis")
    follow = {
        "model": "m",
        "input": "and then?",
        "max_output_tokens": 5,
        "previous_response_id": response_id,
    }
    r = post(fleet["r2"], HIST_WIDE, "/v1/responses", follow)
    assert r.status_code == 200, r.text
    # The window holds the first request (~size) and this one's estimate, which carries the
    # conversation (~size again): without it, ~size + 30 would be used.
    used = 1_000_000 - int(r.headers["x-ratelimit-remaining-tokens"])
    assert used >= 2 * size - 100
