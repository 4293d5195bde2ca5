"""The engine's other APIs through sluicegate, with the official SDKs: OpenAI's Responses API
(streamed and not, a previous_response_id chain across 2 mock engines and 2 router replicas
sharing Redis, GET and cancel, an engine gone), Anthropic's Messages API (streamed and not, bad
key, unknown model, abort mid-stream), count_tokens without tokens, /tokenize, an audio upload,
and a backend's own 404 relayed without ejecting it.

One fleet for the whole file (2 mocks, Redis, 2 routers): each test uses what it needs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from router.tools.mock.kv_publish import mock_tokens
from tests.support.harness import STARVED_S, Cluster, Proc, backend, control, stats
from tests.support.wait import wait_for

KEY = "sk-api-test"
MODEL = "m"


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Any]:
    c = module_procs
    redis = c.redis()
    a, b = c.mock("a"), c.mock("b")
    config: dict[str, Any] = {
        "backends": [backend("a", a), backend("b", b)],
        "balancer": "round_robin",
        # a quota, so that its headers show which requests it counted
        "api_keys": [
            {"sha256": hashlib.sha256(KEY.encode()).hexdigest(), "name": "team", "rpm": 100000}
        ],
        "health": {"interval": 60},
        "outlier": {"consecutive_failures": 3},
    }
    # 0.5 s: Redis must answer for the replicas to share (the 50 ms default is a serving
    # budget a loaded test machine can miss).
    env = {"SLUICEGATE_REDIS_URL": redis.url, "SLUICEGATE_REDIS_TIMEOUT": "0.5"}
    r1 = c.router(config, env=env)
    r2 = c.router(config, env=env)
    return {"c": c, "redis": redis, "a": a, "b": b, "r1": r1, "r2": r2, "config": config}


def oai(router: Proc, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=20)


def ant(router: Proc, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key=key, max_retries=0, timeout=20)


def holder_of(fleet: dict[str, Any], response_id: str) -> str:
    """Which mock engine stored the response (its /stats lists each request's response)."""
    for name in ("a", "b"):
        r = httpx.get(fleet[name].url + f"/v1/responses/{response_id}", timeout=STARVED_S)
        if r.status_code == 200:
            return name
    raise AssertionError(f"no engine holds {response_id}")


def last_request(mock: Proc, path: str) -> dict[str, Any]:
    return [r for r in stats(mock)["recent"] if r["path"] == path][-1]


def tokens_metric(router: Proc, kind: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("sluicegate_tokens_total{") and f'kind="{kind}"' in line:
            if 'key="team"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_responses_sdk_streamed_and_not_with_usage(fleet: dict[str, Any]) -> None:
    client = oai(fleet["r1"])
    before = tokens_metric(fleet["r1"], "completion")
    whole = client.responses.create(model=MODEL, input="hello there", max_output_tokens=5)
    assert whole.output_text == "tok0 tok1 tok2 tok3 tok4 "
    assert whole.usage is not None and whole.usage.output_tokens == 5
    texts, completed = [], None
    for event in client.responses.create(
        model=MODEL, input="hello there", max_output_tokens=4, stream=True
    ):
        if event.type == "response.output_text.delta":
            texts.append(event.delta)
        elif event.type == "response.completed":
            completed = event.response
    assert "".join(texts) == "tok0 tok1 tok2 tok3 "
    assert completed is not None and completed.usage is not None
    # Counted from each API's own usage fields: 5 + 4 completion tokens.
    assert tokens_metric(fleet["r1"], "completion") - before == 9


def test_previous_response_chain_across_replicas_get_and_cancel(fleet: dict[str, Any]) -> None:
    r1, r2 = oai(fleet["r1"]), oai(fleet["r2"])
    first = r1.responses.create(model=MODEL, input="turn 1", max_output_tokens=2)
    home = holder_of(fleet, first.id)
    previous = first.id
    # Round robin alone would alternate engines: each follow-up, through either replica and
    # streamed or not, must reach the engine holding its previous response.
    for i, client in enumerate((r2, r1, r2, r1)):
        if i % 2:
            with client.responses.stream(
                model=MODEL,
                input=f"turn {i + 2}",
                max_output_tokens=2,
                previous_response_id=previous,
            ) as s:
                nxt = s.get_final_response()
        else:
            nxt = client.responses.create(
                model=MODEL,
                input=f"turn {i + 2}",
                max_output_tokens=2,
                previous_response_id=previous,
            )
        assert holder_of(fleet, nxt.id) == home
        got = last_request(fleet[home], "/v1/responses")
        assert got["previous_response_id"] == previous
        previous = nxt.id
    fetched = r2.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == "tok0 tok1 "
    # The engine's own answer to a cancel of a finished response, relayed from the right one.
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        r1.responses.cancel(first.id)
    with pytest.raises(openai.NotFoundError) as unknown:
        r1.responses.retrieve("resp_never_made")
    assert unknown.value.code == "response_not_found"


def test_follow_up_whose_engine_is_gone_gets_a_clear_404(fleet: dict[str, Any]) -> None:
    c: Cluster = fleet["c"]
    first = oai(fleet["r1"]).responses.create(model=MODEL, input="x", max_output_tokens=1)
    home = holder_of(fleet, first.id)
    other = "b" if home == "a" else "a"
    # A replica whose fleet lost the engine holding it (same Redis: it knows the id).
    config = {**fleet["config"], "backends": [backend(other, fleet[other])]}
    lone = c.router(config, env={"SLUICEGATE_REDIS_URL": fleet["redis"].url})
    before = stats(fleet[other])["requests"]
    with pytest.raises(openai.NotFoundError) as gone:
        oai(lone).responses.create(
            model=MODEL, input="y", max_output_tokens=1, previous_response_id=first.id
        )
    assert gone.value.code == "response_not_found"
    assert "no longer serving" in str(gone.value)
    with pytest.raises(openai.NotFoundError):
        oai(lone).responses.retrieve(first.id)
    assert stats(fleet[other])["requests"] == before  # never another engine's "not found"
    lone.stop()


def test_anthropic_messages_streamed_and_not(fleet: dict[str, Any]) -> None:
    client = ant(fleet["r1"])
    before = tokens_metric(fleet["r1"], "completion")
    msg = client.messages.create(
        model=MODEL,
        max_tokens=3,
        messages=[{"role": "user", "content": "hello"}],
        extra_headers={"anthropic-beta": "tools-2024-04-04"},
    )
    assert msg.content[0].type == "text" and msg.content[0].text == "tok0 tok1 tok2 "
    assert msg.usage.output_tokens == 3 and msg.usage.input_tokens >= 1
    with client.messages.stream(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hello"}]
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "tok0 tok1 tok2 tok3 " and final.usage.output_tokens == 4
    assert tokens_metric(fleet["r1"], "completion") - before == 7
    seen = [
        r["headers"]
        for n in ("a", "b")
        for r in stats(fleet[n])["recent"]
        if r["path"] == "/v1/messages"
    ]
    # Anthropic's own headers pass through; the client's key never reaches a backend.
    assert [h.get("anthropic-beta") for h in seen].count("tools-2024-04-04") == 1
    assert all(h["anthropic-version"] and "x-api-key" not in h for h in seen)


def test_count_tokens_routed_and_costs_requests_not_tokens(fleet: dict[str, Any]) -> None:
    client = ant(fleet["r1"])
    raw = client.messages.with_raw_response.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "hello world, hello"}]
    )
    assert raw.parse().input_tokens >= 1
    # Counted against the key's requests (issue 46: it was outside every limit), no tokens.
    assert raw.headers.get("x-ratelimit-limit-requests") == "100000"
    assert not [h for h in raw.headers if h.startswith("x-ratelimit") and "tokens" in h]
    counted = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}]
    )
    assert counted.headers.get("x-ratelimit-limit-requests") == "100000"


def test_anthropic_errors_in_anthropic_format(fleet: dict[str, Any]) -> None:
    with pytest.raises(anthropic.AuthenticationError) as bad:
        ant(fleet["r1"], key="sk-wrong").messages.create(
            model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    assert bad.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
    }
    with pytest.raises(anthropic.NotFoundError) as unknown:
        ant(fleet["r1"]).messages.create(
            model="no-such-model", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    assert isinstance(unknown.value.body, dict)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    assert "no-such-model" in unknown.value.body["error"]["message"]


def test_anthropic_abort_mid_stream_stops_generation(fleet: dict[str, Any]) -> None:
    for name in ("a", "b"):
        control(fleet[name], itl_ms=20, reset_stats=True)
    try:
        with ant(fleet["r2"]).messages.stream(
            model=MODEL, max_tokens=2000, messages=[{"role": "user", "content": "go on"}]
        ) as s:
            for n, _ in enumerate(s.text_stream):
                if n == 3:
                    break
        wait_for(
            lambda: sum(stats(fleet[n])["aborted"] for n in ("a", "b")) >= 1, "the abort", 10, 0.05
        )
        st = [stats(fleet[name]) for name in ("a", "b")]
        assert sum(s["aborted"] for s in st) == 1
        # Stopped right away: a few tokens past the break, not the 2000 asked for.
        assert sum(s["tokens_generated"] for s in st) < 100
    finally:
        for name in ("a", "b"):
            control(fleet[name], itl_ms=0)


def test_tokenize_and_audio_upload(fleet: dict[str, Any]) -> None:
    r = httpx.post(
        fleet["r1"].url + "/tokenize",
        json={"model": MODEL, "prompt": "hello world"},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=5,
    )
    # The engine's own answer, relayed: the mock tokenizes as its KV events do (4 chars an id).
    assert r.status_code == 200 and r.json()["tokens"] == mock_tokens("hello world")
    assert r.json()["count"] == 2
    audio = b"RIFF" + bytes(range(256)) * 64  # the upload's bytes must arrive untouched
    text = oai(fleet["r1"]).audio.transcriptions.create(
        model=MODEL, file=("speech.wav", audio, "audio/wav")
    )
    assert text.text.startswith("tok0 tok1")
    got = [
        r
        for n in ("a", "b")
        for r in stats(fleet[n])["recent"]
        if r["path"] == "/v1/audio/transcriptions"
    ]
    # The alias was replaced by the backend's model id inside the form.
    assert [r["model"] for r in got] == ["mock-model"]
    # vLLM streams a transcription as chat-like chunks (not OpenAI's transcript.text events):
    # read as SSE.
    r = httpx.post(
        fleet["r2"].url + "/v1/audio/transcriptions",
        data={"model": MODEL, "stream": "true"},
        files={"file": ("speech.wav", audio, "audio/wav")},
        headers={"authorization": f"Bearer {KEY}"},
        timeout=5,
    )
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    assert '"delta":{"content":"tok0 "}' in r.text


def test_backend_404_is_relayed_and_does_not_eject(fleet: dict[str, Any]) -> None:
    router = fleet["r1"]
    for name in ("a", "b"):
        control(fleet[name], fail_status=404, fail_count=4)
    try:
        for _ in range(6):  # past consecutive_failures (3) on each backend
            r = httpx.post(
                router.url + "/v1/rerank",
                json={"model": MODEL, "query": "q", "documents": ["d"]},
                headers={"authorization": f"Bearer {KEY}"},
                timeout=5,
            )
            assert r.status_code == 404 and "failing on purpose" in r.text  # the backend's
        backends = httpx.get(router.url + "/admin/backends", timeout=STARVED_S).json()
        assert all(b["healthy"] and b["consecutive_failures"] == 0 for b in backends)
    finally:
        for name in ("a", "b"):
            control(fleet[name], fail_status=0, fail_count=-1)


@pytest.fixture(autouse=True)
def _no_leak(fleet: dict[str, Any]) -> Iterator[None]:
    yield
    # Every request released its in-flight slot, also the aborted one.
    for router in (fleet["r1"], fleet["r2"]):
        wait_for(
            lambda r=router: (
                sum(
                    int(b["in_flight"])
                    for b in httpx.get(r.url + "/admin/backends", timeout=STARVED_S).json()
                )
                == 0
            ),
            f"{router.url}: every slot released",
            5,
            0.05,
        )
