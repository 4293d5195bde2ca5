"""Cache-aware routing end to end: three mock vLLM engines with prefix caching, a real router
with `balancer: cache_aware`, the openai SDK as the client.

A follow-up turn lands where the first turn went and the engine reports the cached prefix; a
hot prefix spills past the load bound and the spill targets become holders; bad or huge prompts
never fail a request; a session key sticks and moves only to a backend added. Scrape interval
0.1 s (stale only after 3 s: a busy test machine must not make an engine look gone); every wait
is a poll with a deadline.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.support.harness import STARVED_S, Cluster, Proc, backend, control, in_flight
from tests.support.wait import wait_for

ENGINE = ["--engine", "--max-num-seqs", "16", "--kv-tokens", "65536", "--decode-ms", "5"]
ENGINE += ["--decode-ms-per-seq", "0", "--prefill-ms-per-1k", "5"]
NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Proc]]:
    c = Cluster()
    try:
        mocks = {n: c.mock(n, engine_args=ENGINE) for n in NAMES}
        router = c.router(
            {
                "backends": [backend(n, m) for n, m in mocks.items()],
                "balancer": "cache_aware",
                "engine_metrics": {"interval": 0.1, "timeout": 1, "stale_after": 3},
                "expose_backend_header": True,
                "health": {"interval": 60},
            }
        )
        yield {**mocks, "router": router}
    finally:
        c.close()


def client(proc: Proc) -> OpenAI:
    return OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)


def handbook(customer: str, chars: int) -> str:
    text = f"You answer for {customer}. Policy {customer}: be precise, cite sections. "
    return (text * (chars // len(text) + 1))[:chars]


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def router_metrics(router: Proc) -> str:
    return httpx.get(router.url + "/metrics", timeout=STARVED_S).text


def log_lines(router: Proc, *ids: str) -> dict[str, dict[str, Any]]:
    """The request log lines by id, once those of `ids` are written (the log writer batches)."""

    def by_id() -> dict[str, dict[str, Any]]:
        out = {}
        for line in router.log().splitlines():
            if '"request_id"' in line and line.startswith("{"):
                record = json.loads(line)
                out[record["request_id"]] = record
        return out

    wait_for(lambda: all(i in by_id() for i in ids), f"the log lines of {ids}", 5, 0.05)
    return by_id()


def test_a_follow_up_turn_lands_on_the_engine_that_served_the_first(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    sdk = client(router)
    before = router_metrics(router)
    firsts: Counter[str] = Counter()
    for k in range(6):
        messages: list[Any] = [
            {"role": "system", "content": handbook(f"customer-{k}", 6000)},
            {"role": "user", "content": f"Question {k}: what does section 4 say?"},
        ]
        raw = sdk.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=4, extra_headers={"x-request-id": f"f{k}"}
        )
        first_backend = raw.headers["x-sluicegate-backend"]
        first = raw.parse()
        firsts[first_backend] += 1
        assert first.usage is not None
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And section 5?"},
        ]
        raw = sdk.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=4, extra_headers={"x-request-id": f"s{k}"}
        )
        assert raw.headers["x-sluicegate-backend"] == first_backend
        second = raw.parse()
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        # The engine skipped nearly all of the first turn's prompt.
        assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * first.usage.prompt_tokens
    after = router_metrics(router)
    prefix = counter(after, "sluicegate_routing_decisions_total", reason="prefix")
    assert prefix - counter(before, "sluicegate_routing_decisions_total", reason="prefix") >= 6
    hit = counter(after, "sluicegate_affinity_hit_blocks_total")
    lookup = counter(after, "sluicegate_affinity_lookup_blocks_total")
    assert 0 < hit < lookup
    assert counter(after, "sluicegate_affinity_index_entries") > 0
    lines = log_lines(router, *(f"{t}{k}" for t in "fs" for k in range(6)))
    for k in range(6):
        assert lines[f"s{k}"]["reason"] == "prefix"
        assert lines[f"s{k}"]["prefix_chars"] >= 6000 - 256  # whole blocks of the first turn
        assert lines[f"f{k}"]["prefix_chars"] == 0


def test_a_hot_prefix_spills_past_the_load_bound(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    sdk = client(router)
    hot = handbook("everyone", 32_000)  # 8000 tokens

    def ask(i: int, tokens: int = 60) -> tuple[str, int]:
        raw = sdk.chat.completions.with_raw_response.create(
            model="m",
            max_tokens=tokens,
            messages=[{"role": "system", "content": hot}, {"role": "user", "content": f"q{i}"}],
        )
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        return raw.headers["x-sluicegate-backend"], cached

    ask(-1, 2)  # one engine holds the prefix before the burst
    before = router_metrics(router)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        served = Counter(b for b, _ in pool.map(ask, range(12)))
    after = router_metrics(router)
    moved = sum(
        counter(after, "sluicegate_routing_decisions_total", reason=r)
        - counter(before, "sluicegate_routing_decisions_total", reason=r)
        for r in ("spill", "load")
    )
    assert moved > 0, served
    # The holder keeps what its engine absorbs (its 65536 KV tokens hold 8 of these prompts,
    # counting what was sent since the last scrape), then the burst moves on: the queue there
    # costs more than a copy elsewhere (docs/balancers.md#cache_aware).
    assert len(served) >= 2 and max(served.values()) <= 8, served
    # The spill targets joined the holders: later turns hit a cache wherever they land.
    for i in range(4):
        _, cached = ask(100 + i, 2)
        assert cached > 7000


def test_the_mock_engine_reports_cached_tokens(fleet: dict[str, Proc]) -> None:
    mock = fleet["c"]
    sdk = client(mock)

    def counts() -> tuple[float, float]:
        text = httpx.get(mock.url + "/metrics", timeout=STARVED_S).text
        assert 'enable_prefix_caching="True"' in text
        return counter(text, "vllm:prefix_cache_queries_total"), counter(
            text, "vllm:prefix_cache_hits_total"
        )

    q0, h0 = counts()
    prompt = handbook("direct", 2000)  # 500 tokens, 31 full blocks of 16
    usage = [
        sdk.completions.create(model="mock-model", prompt=prompt, max_tokens=2).usage
        for _ in range(2)
    ]
    assert usage[0] is not None and usage[1] is not None
    assert usage[0].prompt_tokens_details is not None and usage[1].prompt_tokens_details
    assert usage[0].prompt_tokens_details.cached_tokens == 0
    assert usage[1].prompt_tokens_details.cached_tokens == 496  # whole blocks, never the last
    q1, h1 = counts()
    assert (q1 - q0, h1 - h0) == (1000, 496)
    chunks = [
        list(
            sdk.chat.completions.create(
                model="mock-model",
                stream=True,
                max_tokens=2,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": prompt}] * 2,
            )
        )
        for _ in range(2)
    ]
    last = chunks[-1][-1].usage
    assert last is not None and last.prompt_tokens_details is not None
    assert last.prompt_tokens_details.cached_tokens > 900
    # vLLM's reset_prefix_cache (the benchmark's cold start between variants): the cache
    # forgets, the counters keep counting.
    control(mock, reset_prefix_cache=True)
    again = sdk.completions.create(model="mock-model", prompt=prompt, max_tokens=2).usage
    assert again is not None and again.prompt_tokens_details is not None
    assert again.prompt_tokens_details.cached_tokens == 0
    q2, _ = counts()
    assert q2 > q1


def test_bad_input_never_fails_a_request(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    sdk = client(router)
    parts: Any = [
        {"type": "text", "text": handbook("parts", 3000)},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    r = sdk.chat.completions.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": parts}]
    )
    assert r.choices
    r2 = sdk.completions.create(model="m", max_tokens=2, prompt=[17, 4, 99] * 2000)
    assert r2.choices
    # 210k characters (past the 128k hashed, within the engine's KV capacity).
    huge = "all work and no play " * 10_000
    raw = sdk.chat.completions.with_raw_response.create(
        model="m",
        max_tokens=2,
        messages=[{"role": "user", "content": huge}],
        extra_headers={"x-request-id": "huge"},
    )
    assert raw.parse().choices
    for body in (
        {"model": "m", "max_tokens": 2},  # neither messages nor prompt
        {"model": "m", "max_tokens": 2, "messages": "not a list"},
        {"model": "m", "max_tokens": 2, "messages": [None, 3, {"role": 7, "content": {}}]},
    ):
        resp = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=STARVED_S)
        assert resp.status_code == 200, resp.text
    assert in_flight(router) == 0
    lines = log_lines(router, "huge")
    assert lines["huge"]["status"] == 200 and lines["huge"]["prefix_chars"] <= 128 * 1024
    assert re.search(r'"reason": "(prefix|load|spill)"', router.log())


def test_a_session_key_sticks_and_moves_minimally_when_a_backend_is_added(
    fleet: dict[str, Proc],
) -> None:
    c = Cluster()
    token = "session-test-admin-token"
    try:
        router = c.router(
            {
                "backends": [backend("a", fleet["a"]), backend("b", fleet["b"])],
                "balancer": "cache_aware",
                "engine_metrics": {"interval": 0.1, "timeout": 1, "stale_after": 3},
                "expose_backend_header": True,
                "health": {"interval": 60},
            },
            env={"SLUICEGATE_ADMIN_TOKEN": token},
        )

        def where(key: str, how: str = "header") -> str:
            extra: dict[str, Any] = {"user": key} if how == "user" else {}
            headers = {"x-session-id": key} if how == "header" else {}
            r = httpx.post(
                router.url + "/v1/chat/completions",
                json={
                    "model": "m",
                    "max_tokens": 1,
                    **extra,
                    "messages": [{"role": "user", "content": "hi"}],
                },
                headers=headers,
                timeout=STARVED_S,
            )
            assert r.status_code == 200, r.text
            return r.headers["x-sluicegate-backend"]

        keys = [f"session-{i}" for i in range(90)]
        home = {k: where(k) for k in keys}
        assert set(home.values()) == {"a", "b"}
        assert all(where(k) == home[k] for k in keys[:30])  # it sticks
        via_user = {k: where(k, "user") for k in keys[30:45]}
        assert all(via_user[k] == home[k] for k in via_user)  # the same key, from `user`
        added = httpx.post(
            router.url + "/admin/backends",
            json=backend("c", fleet["c"]),
            headers={"authorization": f"Bearer {token}"},
            timeout=STARVED_S,
        )
        assert added.status_code == 201, added.text

        def c_is_read() -> bool:
            auth = {"authorization": f"Bearer {token}"}
            listed = httpx.get(
                router.url + "/admin/backends", headers=auth, timeout=STARVED_S
            ).json()
            return any(
                b["name"] == "c" and b["engine"] and not b["engine"]["stale"] for b in listed
            )

        wait_for(c_is_read, "the added backend scraped", 5, 0.05)
        now = {k: where(k) for k in keys}
        moved = [k for k in keys if now[k] != home[k]]
        assert all(now[k] == "c" for k in moved)  # no key moves between a and b
        assert 0.15 <= len(moved) / len(keys) <= 0.55, len(moved)  # about 1/3
        text = router_metrics(router)
        assert counter(text, "sluicegate_routing_decisions_total", reason="session") >= 200
    finally:
        c.close()
