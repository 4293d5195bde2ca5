"""Usage accounting against real routers, the mock engine and the official openai SDK: tokens
counted equal the engine's own counters (vllm:prompt_tokens_total, vllm:generation_tokens_total,
vllm:prefix_cache_hits_total), streamed or not, with and without include_usage from the client;
the client's bytes are those it gets from the engine directly; /admin/usage sums replicas
through Redis, and keeps buckets in memory without it."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import openai
import pytest
import redis as redis_lib
from openai.types.chat import ChatCompletionMessageParam

from tests.support.harness import STARVED_S, Cluster, Proc, backend, control, sha, wait_http
from tests.support.wait import wait_for

ADMIN = "admin-usage-token-0123456789"
ALPHA = "sk-usage-alpha-0123456789"
BETA = "sk-usage-beta-0123456789"
ENGINE = ["--engine", "--decode-ms", "1", "--decode-ms-per-seq", "0", "--prefill-ms-per-1k", "0"]
LONG = "You are a careful assistant. " * 40  # ~1100 characters: whole prefix-cache blocks


KEYS = [{"sha256": sha(ALPHA), "name": "alpha"}, {"sha256": sha(BETA), "name": "beta"}]
ENV = {"SLUICEGATE_ADMIN_TOKEN": ADMIN}


def config(mock: Proc, openai_like: Proc, **extra: Any) -> dict[str, Any]:
    # "m" is renamed upstream (the body is serialised again), "mock-model" is not (spliced).
    be = backend("u", mock, {"m": "mock-model", "mock-model": "mock-model"})
    oa = backend("oa", openai_like, {"oa": "mock-model"}, kind="openai", api_key="sk-oa-0123")
    return {"backends": [be, oa], "api_keys": KEYS, **extra}


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    c = module_procs
    mock = c.mock("u", tokens=6, engine_args=ENGINE)
    oa = c.mock("oa")
    control(oa, usage_nulls=True)  # OpenAI's shape: "usage":null in chunks with include_usage
    redis, own = c.redis(), c.redis()
    shared = config(mock, oa, redis_url=redis.url, usage_flush=0.2)
    # Started together, then waited for: three imports in parallel instead of one by one.
    routers = {
        "r1": c.router(shared, env=ENV, wait=False),
        "r2": c.router(shared, env=ENV, wait=False),
        "passive": c.router(config(mock, oa, usage_accounting="passive"), env=ENV, wait=False),
        # Its Redis is stopped and started again by one test.
        "alone": c.router(
            config(mock, oa, redis_url=own.url, usage_flush=0.2), env=ENV, wait=False
        ),
    }
    for r in routers.values():
        wait_http(r.url + "/healthz", proc=r.popen)
    return {"mock": mock, "oa": oa, "own_redis": own, **routers}


def engine_counts(mock: Proc) -> dict[str, float]:
    text = httpx.get(mock.url + "/metrics", timeout=STARVED_S).text
    out = {}
    for name in ("prompt_tokens", "generation_tokens", "prefix_cache_hits"):
        found = re.search(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        assert found is not None, name
        out[name] = float(found.group(1))
    return out


def router_tokens(router: Proc, key: str, model: str) -> dict[str, float]:
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    out = {"prompt": 0.0, "completion": 0.0, "cached": 0.0}
    for kind in out:
        labels = rf'key="{key}",kind="{kind}",model="{model}"'
        found = re.search(rf"^sluicegate_tokens_total\{{{labels}\}} (\S+)$", text, re.M)
        if found:
            out[kind] = float(found.group(1))
    return out


def usage(router: Proc, token: str | None = ADMIN, **params: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(router.url + "/admin/usage", params=params, headers=headers, timeout=STARVED_S)


def sdk(router: Proc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)


def total(rows: list[dict[str, Any]], field: str) -> int:
    return sum(int(r[field]) for r in rows)


def test_tokens_counted_equal_the_engines_own_counts(fleet: dict[str, Proc]) -> None:
    r1, mock = fleet["r1"], fleet["mock"]
    client = sdk(r1, ALPHA)
    before_engine = engine_counts(mock)
    before = router_tokens(r1, "alpha", "m")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": LONG}]

    # A stream whose client did not ask for usage: it sees no usage event and no usage field.
    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))
    assert chunks and all(c.usage is None and c.choices for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == "".join(f"tok{i} " for i in range(6))

    # The same prompt again, asking for usage: the client gets the engine's counts, cached ones
    # included (the prefix is in the engine's cache now).
    asked = list(
        client.chat.completions.create(
            model="m",
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = asked[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 6
    details = last.usage.prompt_tokens_details
    assert details is not None and (details.cached_tokens or 0) > 0

    # Not streamed, and a completion stream.
    whole = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert whole.usage is not None
    parts = list(client.completions.create(model="mock-model", prompt="say hi", stream=True))
    assert parts and all(p.usage is None and p.choices for p in parts)

    after_engine = engine_counts(mock)
    after = router_tokens(r1, "alpha", "m")
    spliced = router_tokens(r1, "alpha", "mock-model")
    engine = {k: after_engine[k] - before_engine[k] for k in after_engine}
    counted = {k: after[k] - before[k] + spliced[k] for k in after}
    assert counted["prompt"] == engine["prompt_tokens"]
    assert counted["completion"] == engine["generation_tokens"] == 4 * 6
    assert counted["cached"] == engine["prefix_cache_hits"] > 0

    # The same numbers by the hour, summed over this router's requests of the key.
    rows = usage(r1, key="alpha").json()["data"]
    assert total(rows, "requests") == 4 and total(rows, "estimated_requests") == 0
    assert total(rows, "prompt_tokens") == engine["prompt_tokens"]
    assert total(rows, "completion_tokens") == engine["generation_tokens"]
    assert {r["model"] for r in rows} == {"m", "mock-model"}
    assert all(r["hour"].endswith(":00:00Z") for r in rows)


def raw_stream(url: str, model: str, request_id: str, **extra: Any) -> bytes:
    body = {"model": model, "stream": True, "max_tokens": 5, **extra}
    headers = {"authorization": f"Bearer {ALPHA}", "x-request-id": request_id}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=10) as r:
        assert r.status_code == 200
        return b"".join(r.iter_raw())


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ],
)
def test_the_client_gets_the_engines_bytes(
    fleet: dict[str, Proc], path: str, payload: dict[str, Any]
) -> None:
    mock, r1, passive = fleet["mock"], fleet["r1"], fleet["passive"]
    # Short prompts: nothing cached, so usage events are equal from call to call.
    for options in (None, {"include_usage": True}, {"continuous_usage_stats": True}):
        extra = {**payload, **({"stream_options": options} if options else {})}
        direct = raw_stream(mock.url + path, "mock-model", "same-id", **extra)
        assert (b'"usage"' in direct) == (options == {"include_usage": True})
        for router in (r1, passive):
            # r1 injects include_usage into a stream that did not ask, passive never does: the
            # client gets the engine's bytes either way (the usage event's system_fingerprint
            # moved back onto the last token's event, where vLLM puts it without the option).
            for model in ("m", "mock-model"):
                assert raw_stream(router.url + path, model, "same-id", **extra) == direct


def test_openai_shape_loses_its_usage_nulls_too(fleet: dict[str, Proc]) -> None:
    oa, r1 = fleet["oa"], fleet["r1"]
    chat = "/v1/chat/completions"
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    direct = raw_stream(oa.url + chat, "mock-model", "oa-id", **hi)
    asked = raw_stream(
        oa.url + chat, "mock-model", "oa-id", **hi, stream_options={"include_usage": True}
    )
    assert b'"usage"' not in direct and asked.count(b'"usage":null') == 6  # 5 tokens, finish
    before = total(usage(r1, model="oa").json()["data"], "completion_tokens")
    assert raw_stream(r1.url + chat, "oa", "oa-id", **hi) == direct
    rows = usage(r1, model="oa").json()["data"]
    assert total(rows, "completion_tokens") - before == 5
    assert total(rows, "estimated_requests") == 0


@pytest.mark.parametrize("nulls", [False, True])
def test_a_usage_event_cut_across_reads_is_still_removed(
    fleet: dict[str, Proc], nulls: bool
) -> None:
    oa, r1 = fleet["oa"], fleet["r1"]
    chat = "/v1/chat/completions"
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    control(oa, split_tail_ms=30, usage_nulls=nulls)
    try:
        direct = raw_stream(oa.url + chat, "mock-model", "cut-id", **hi)
        options = {"stream_options": {"include_usage": True}}
        asked = raw_stream(oa.url + chat, "mock-model", "cut-id", **hi, **options)
        assert b'"choices":[],"usage"' in asked
        assert raw_stream(r1.url + chat, "oa", "cut-id", **hi) == direct
    finally:
        control(oa, split_tail_ms=0, usage_nulls=True)


def test_passive_counts_content_events_marked_estimated(fleet: dict[str, Proc]) -> None:
    passive, mock = fleet["passive"], fleet["mock"]
    before_engine = engine_counts(mock)
    before = usage(passive, key="beta").json()["data"]
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "count me"}]}
    raw = httpx.post(
        passive.url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {BETA}"},
        timeout=10,
    )
    assert raw.status_code == 200 and b'"usage"' not in raw.content
    generated = engine_counts(mock)["generation_tokens"] - before_engine["generation_tokens"]
    rows = usage(passive, key="beta").json()["data"]
    assert total(rows, "requests") - total(before, "requests") == 1
    assert total(rows, "estimated_requests") - total(before, "estimated_requests") == 1
    assert total(rows, "completion_tokens") - total(before, "completion_tokens") == generated
    # The prompt is estimated from the request body (bytes / 4).
    prompt = total(rows, "prompt_tokens") - total(before, "prompt_tokens")
    assert prompt == round(len(httpx.Request("POST", "/", json=body).content) / 4)


def test_usage_is_summed_across_replicas_through_redis(fleet: dict[str, Proc]) -> None:
    r1, r2 = fleet["r1"], fleet["r2"]
    since = str(int(time.time()) - 5)
    start = {k: total(usage(r1, key=k, since=since).json()["data"], "requests") for k in ("beta",)}
    for router in (r1, r2, r2):
        sdk(router, BETA).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hello"}]
        )

    # r2 writes every 0.2 s; a read flushes the reader's own counts first.
    def beta_rows() -> list[dict[str, Any]]:
        return list(usage(r1, key="beta", model="m", since=since).json()["data"])

    wait_for(lambda: total(beta_rows(), "requests") - start["beta"] >= 3, "3 booked", 5, 0.05)
    rows = beta_rows()
    assert total(rows, "requests") - start["beta"] == 3
    assert {(r["key"], r["model"]) for r in rows} == {("beta", "m")}
    assert total(rows, "completion_tokens") == 3 * 6
    # Both replicas answer the same.
    again = usage(r2, key="beta", model="m", since=since).json()["data"]
    assert total(again, "requests") == total(rows, "requests")
    # ISO-8601 works as well; a since in the future has nothing yet.
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(since)))
    assert usage(r1, key="beta", model="m", since=iso).json()["data"] == rows
    assert usage(r1, since=str(int(time.time()) + 7200)).json()["data"] == []


@pytest.mark.parametrize("since", ["yesterday", "", "nan", "-5", "2026-13-45T00:00:00"])
def test_a_bad_since_is_a_400_in_openais_shape(fleet: dict[str, Proc], since: str) -> None:
    for router in (fleet["r1"], fleet["passive"]):
        r = usage(router, since=since)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "invalid_since" and "since" in err["message"]
        assert err["type"] == "invalid_request_error"


def test_usage_needs_the_admin_token(fleet: dict[str, Proc]) -> None:
    for router in (fleet["r1"], fleet["passive"]):
        assert usage(router, token=None).status_code == 401
        wrong = usage(router, token="not-the-token")
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_admin_token"
        assert ADMIN not in wrong.text


def test_usage_counted_while_redis_is_down_is_written_when_it_returns(
    fleet: dict[str, Proc], module_procs: Cluster
) -> None:
    redis, router = fleet["own_redis"], fleet["alone"]
    hi: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    sdk(router, ALPHA).chat.completions.create(model="m", messages=hi)
    assert total(usage(router).json()["data"], "requests") == 1
    redis.stop()
    for _ in range(2):  # requests never wait for Redis
        sdk(router, ALPHA).chat.completions.create(model="m", messages=hi)
    down = usage(router)
    assert down.status_code == 503 and down.json()["error"]["code"] == "usage_unavailable"
    # Back, empty: the router writes what it kept since the first request.
    module_procs.redis(port=redis.port)

    def written_back() -> bool:
        answer = usage(router)
        return answer.status_code == 200 and total(answer.json()["data"], "requests") == 2

    wait_for(written_back, "what it kept written back", 5, 0.1)
    answer = usage(router)
    assert answer.status_code == 200
    assert total(answer.json()["data"], "requests") == 2
    assert total(answer.json()["data"], "completion_tokens") == 2 * 6


def test_usage_counted_since_the_last_write_is_written_at_shutdown(
    fleet: dict[str, Proc], module_procs: Cluster
) -> None:
    # No timed write in this test's life: only the shutdown flush can put the count in Redis.
    redis = module_procs.redis()
    router = module_procs.router(
        config(fleet["mock"], fleet["oa"], redis_url=redis.url, usage_flush=3600), env=ENV
    )
    hi: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    sdk(router, ALPHA).chat.completions.create(model="m", messages=hi)
    assert router.stop() == 0
    client = redis_lib.Redis.from_url(redis.url)
    try:
        names = list(client.scan_iter(match="{sluicegate}:usage:*"))
        assert len(names) == 1
        fields = {tuple(json.loads(k)): int(v) for k, v in client.hgetall(names[0]).items()}
    finally:
        client.close()
    assert fields[("alpha", "m", "requests")] == 1
    assert fields[("alpha", "m", "completion_tokens")] == 6


def test_a_client_leaving_at_done_is_counted_with_the_engines_usage(
    fleet: dict[str, Proc],
) -> None:
    # The openai SDK stops reading at `[DONE]` and closes: the router sees that client leave
    # while it still waits for the engine's end of body. The engine's usage had already
    # passed; it must be what is counted, not an estimate.
    r1, mock = fleet["r1"], fleet["mock"]
    control(mock, end_gap_ms=300)
    try:
        before_engine, before = engine_counts(mock), usage(r1, key="alpha").json()["data"]
        c = sdk(r1, ALPHA)
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "leave at done"}]
        for options in (None, {"include_usage": True}):
            extra = {"stream_options": options} if options else None
            chunks = list(
                c.chat.completions.create(
                    model="m", messages=messages, stream=True, extra_body=extra
                )
            )
            assert chunks and all(ch.usage is None for ch in chunks[:-1])
        # Counted as the request ends: at the client's close, or at worst the gap after it.
        wait_for(
            lambda: (
                total(usage(r1, key="alpha").json()["data"], "requests") - total(before, "requests")
                >= 2
            ),
            "the two requests counted",
            5,
        )
        rows = usage(r1, key="alpha").json()["data"]
    finally:
        control(mock, end_gap_ms=0)
    engine = {k: v - before_engine[k] for k, v in engine_counts(mock).items()}
    assert total(rows, "estimated_requests") == total(before, "estimated_requests")
    assert total(rows, "prompt_tokens") - total(before, "prompt_tokens") == engine["prompt_tokens"]
    assert total(rows, "completion_tokens") - total(before, "completion_tokens") == 2 * 6
    assert engine["generation_tokens"] == 2 * 6
