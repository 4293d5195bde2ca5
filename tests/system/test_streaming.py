"""The official openai SDK, through the router, to real mock-upstream processes."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import openai
import pytest

from tests.support.harness import Cluster, Proc, backend, control, expected_text, stats


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    a = module_procs.mock("a", tokens=12)
    b = module_procs.mock("b", tokens=12)
    router = module_procs.router(
        {
            "backends": [
                backend("a", a, {"m": "mock-model", "alias-m": "mock-model"}),
                backend("b", b, ["m"]),
            ],
            "balancer": "round_robin",
        }
    )
    return {"a": a, "b": b, "router": router}


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> None:
    if "fleet" in request.fixturenames:
        fleet = request.getfixturevalue("fleet")
        for name in ("a", "b"):
            control(
                fleet[name],
                reset_stats=True,
                tokens=12,
                itl_ms=0,
                ttft_ms=0,
                fail_status=0,
                hang=False,
                gzip=False,
            )


def client(fleet: dict[str, Proc]) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["router"].url + "/v1", api_key="client-key", max_retries=0)


def test_sync_stream_text_equals_upstream(fleet: dict[str, Proc]) -> None:
    stream = client(fleet).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected_text(12)


def test_sync_non_stream(fleet: dict[str, Proc]) -> None:
    r = client(fleet).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert r.choices[0].message.content == expected_text(5)


def test_completions_and_embeddings(fleet: dict[str, Proc]) -> None:
    c = client(fleet)
    r = c.completions.create(model="m", prompt="x", max_tokens=4)
    assert r.choices[0].text == expected_text(4)
    chunks = c.completions.create(model="m", prompt="x", max_tokens=3, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == expected_text(3)
    e = c.embeddings.create(model="m", input="x")
    assert e.data[0].embedding == [0.0, 0.5, 1.0]


def test_async_stream_and_non_stream(fleet: dict[str, Proc]) -> None:
    async def main() -> tuple[str, str]:
        ac = openai.AsyncOpenAI(base_url=fleet["router"].url + "/v1", api_key="k", max_retries=0)
        stream = await ac.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=7
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        whole = await ac.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6
        )
        await ac.close()
        return "".join(parts), whole.choices[0].message.content or ""

    streamed, whole = asyncio.run(main())
    assert streamed == expected_text(7)
    assert whole == expected_text(6)


def test_models_lists_public_names(fleet: dict[str, Proc]) -> None:
    ids = sorted(m.id for m in client(fleet).models.list())
    assert ids == ["alias-m", "m"]


def test_alias_rewrites_model_and_nothing_else(fleet: dict[str, Proc]) -> None:
    body = {"model": "alias-m", "max_tokens": 2, "extra_field": {"keep": [1, 2]}}
    r = httpx.post(fleet["router"].url + "/v1/completions", json=body)
    assert r.status_code == 200
    assert r.json()["model"] == "mock-model"
    rec = stats(fleet["a"])["recent"][-1]
    assert rec["model"] == "mock-model"


def test_an_aliased_stream_with_its_own_stream_options_reaches_the_backend_renamed(
    fleet: dict[str, Proc],
) -> None:
    body = {
        "model": "alias-m",
        "stream": True,
        "max_tokens": 3,
        "stream_options": {"include_usage": False},
    }
    r = httpx.post(fleet["router"].url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert '"usage":{' not in r.text  # asked for none: the router's own request is stripped
    rec = stats(fleet["a"])["recent"][-1]
    assert rec["model"] == "mock-model"


@pytest.mark.parametrize("itl_ms", [0, 5], ids=["at_once", "paced"])
def test_stream_bytes_are_forwarded_unchanged(fleet: dict[str, Proc], itl_ms: int) -> None:
    # Paced, each token is its own upstream read, passed on by the upstream connection's read
    # callback itself (router/core/client_link.py); at once, the reads coalesce.
    for name in ("a", "b"):
        control(fleet[name], itl_ms=itl_ms)
    body = {"model": "m", "stream": True, "max_tokens": 5}
    same = {"x-request-id": "same-id"}
    via = httpx.post(fleet["router"].url + "/v1/chat/completions", json=body, headers=same)
    # Round robin picks either: `a` gets the model renamed (its alias), `b` gets "m" as sent.
    # The router asks for usage (include_usage) and removes that event; vLLM puts its
    # system_fingerprint on the usage event then, and the router moves it back onto the last
    # token's event, where the engine puts it without the option: the bytes are the same.
    direct = {
        httpx.post(fleet[name].url + "/v1/chat/completions", json=sent, headers=same).content
        for name, sent in (("a", {**body, "model": "mock-model"}), ("b", body))
    }
    assert all(b',"system_fingerprint":"vllm-0.32.0-mock"}' in d for d in direct)
    assert via.content in direct
    assert via.headers["content-type"] == "text/event-stream"
    assert via.headers["cache-control"] == "no-cache"
    assert via.headers["x-accel-buffering"] == "no"


def test_gzip_upstream_is_passed_through_byte_exact(fleet: dict[str, Proc]) -> None:
    for name in ("a", "b"):
        control(fleet[name], gzip=True)
    body = {"model": "m", "stream": True, "max_tokens": 4}
    with httpx.stream(
        "POST",
        fleet["router"].url + "/v1/chat/completions",
        json=body,
        headers={"accept-encoding": "gzip"},
    ) as r:
        raw = b"".join(r.iter_raw())
        assert r.headers["content-encoding"] == "gzip"
    import gzip

    text = gzip.decompress(raw).decode()
    assert "tok3 " in text and text.endswith("data: [DONE]\n\n")
    # The SDK decodes it like any other answer.
    r2 = client(fleet).chat.completions.create(model="m", messages=[], max_tokens=3)
    assert r2.choices[0].message.content == expected_text(3)


def test_request_id_round_trip_and_no_client_authorization(fleet: dict[str, Proc]) -> None:
    r = httpx.post(
        fleet["router"].url + "/v1/chat/completions",
        json={"model": "m", "max_tokens": 1},
        headers={
            "authorization": "Bearer client-secret",
            "x-request-id": "req-123",
            "connection": "keep-alive, x-hop",
            "x-hop": "must-not-pass",
            "x-custom": "passes",
            "proxy-authorization": "Basic nope",
        },
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-123"
    rec = next(x for m in ("a", "b") for x in stats(fleet[m])["recent"])
    assert rec["request_id"] == "req-123"
    assert rec["authorization"] is None
    assert "x-hop" not in rec["headers"]
    assert "proxy-authorization" not in rec["headers"]
    assert rec["headers"]["x-custom"] == "passes"


def test_request_id_generated_when_absent(fleet: dict[str, Proc]) -> None:
    r = httpx.post(fleet["router"].url + "/v1/completions", json={"model": "m", "max_tokens": 1})
    rid = r.headers["x-request-id"]
    assert len(rid) >= 16
    upstream_ids = [x["request_id"] for m in ("a", "b") for x in stats(fleet[m])["recent"]]
    assert rid in upstream_ids


def test_pool_reuses_connections(fleet: dict[str, Proc]) -> None:
    url = fleet["router"].url + "/v1/chat/completions"
    concurrency, total = 6, 60

    async def main() -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as c:

            async def one(i: int) -> None:
                r = await c.post(url, json={"model": "m", "stream": i % 2 == 0, "max_tokens": 3})
                assert r.status_code == 200

            await asyncio.gather(*(one(i) for i in range(concurrency * 2)))  # warm-up
            before = {m: stats(fleet[m])["connections_opened"] for m in ("a", "b")}
            sem = asyncio.Semaphore(concurrency)

            async def bounded(i: int) -> None:
                async with sem:
                    await one(i)

            await asyncio.gather(*(bounded(i) for i in range(total)))
            after = {m: stats(fleet[m])["connections_opened"] for m in ("a", "b")}
            opened = sum(after[m] - before[m] for m in after)
            assert opened <= concurrency, (before, after)

    control(fleet["a"], itl_ms=2, tokens=3)
    control(fleet["b"], itl_ms=2, tokens=3)
    asyncio.run(main())


def _post_error(fleet: dict[str, Proc], body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(fleet["router"].url + "/v1/chat/completions", content=body, **kw)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b'"a string"', 400, "invalid_body"),
        (b'{"messages": []}', 400, "missing_model"),
        (b'{"model": 7}', 400, "missing_model"),
        (b'{"model": "nope"}', 404, "model_not_found"),
        (b"\xff\xfe\x00garbage", 400, "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    ],
)
def test_bad_requests_get_openai_errors(
    fleet: dict[str, Proc], body: bytes, status: int, code: str
) -> None:
    r = _post_error(fleet, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and err["type"] and err["message"]


def test_body_over_limit_is_413(fleet: dict[str, Proc]) -> None:
    big = b'{"model": "m", "x": "' + b"a" * (4 * 1024 * 1024 + 10) + b'"}'
    r = _post_error(fleet, big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_unknown_model_via_sdk_raises_not_found(fleet: dict[str, Proc]) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client(fleet).chat.completions.create(model="missing", messages=[])
    assert info.value.status_code == 404


def test_upstream_4xx_is_forwarded_with_its_body(fleet: dict[str, Proc]) -> None:
    for name in ("a", "b"):
        control(fleet[name], fail_status=400)
    r = httpx.post(fleet["router"].url + "/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 400
    assert "failing on purpose" in r.json()["error"]["message"]
    # 4xx is the client's fault: not retried on the other backend.
    assert stats(fleet["a"])["requests"] + stats(fleet["b"])["requests"] == 1


def test_upstream_5xx_everywhere_forwards_the_status(fleet: dict[str, Proc]) -> None:
    for name in ("a", "b"):
        control(fleet[name], fail_status=503)
    r = httpx.post(fleet["router"].url + "/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 503
    assert r.json()["error"]["message"].endswith("failing on purpose")


def test_mid_stream_failure_ends_with_error_event(fleet: dict[str, Proc]) -> None:
    for name in ("a", "b"):
        control(fleet[name], die_after=3, tokens=10)
    with httpx.stream(
        "POST", fleet["router"].url + "/v1/chat/completions", json={"model": "m", "stream": True}
    ) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert len(re.findall(r"tok\d+ ", text)) == 3  # the mock's token texts ("token_ids" aside)
    events = [e for e in text.split("\n\n") if e]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"
    for name in ("a", "b"):
        control(fleet[name], die_after=-1)


def test_half_event_then_close_gets_a_parseable_error(fleet: dict[str, Proc]) -> None:
    for name in ("a", "b"):
        control(fleet[name], half_event_after=2, tokens=10)
    with httpx.stream(
        "POST", fleet["router"].url + "/v1/chat/completions", json={"model": "m", "stream": True}
    ) as r:
        text = r.read().decode()
    for name in ("a", "b"):
        control(fleet[name], half_event_after=-1)
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    import json

    err = json.loads(events[-2].removeprefix("data: "))
    assert err["error"]["code"] == "upstream_mid_stream"


def test_admin_backends_lists_in_flight(fleet: dict[str, Proc]) -> None:
    r = httpx.get(fleet["router"].url + "/admin/backends")
    rows = {b["name"]: b for b in r.json()}
    assert set(rows) == {"a", "b"}
    assert rows["a"]["in_flight"] == 0
    assert rows["a"]["models"] == {"m": "mock-model", "alias-m": "mock-model"}
    assert rows["a"]["url"] == fleet["a"].url


def test_health_and_ready(fleet: dict[str, Proc]) -> None:
    assert httpx.get(fleet["router"].url + "/healthz").status_code == 200
    assert httpx.get(fleet["router"].url + "/readyz").status_code == 200
