"""The mock engine held to a real vLLM: the same requests to both, the shapes compared.

What is compared is what sluicegate relies on: the field sets (and value types) of whole bodies
and of every kind of stream event, chat and completions; the SSE framing and the final
`data: [DONE]`; `usage` with `prompt_tokens_details.cached_tokens` (and the prefix cache behind
it: whole blocks, never the last token); `stream_options.include_usage` and
`continuous_usage_stats`; error statuses and bodies for bad input; the `vllm:*` metric families
and labels the router and the engine tier read, `cache_config_info` included; and what a client's
disconnect does to `num_requests_running` and the counters. Text is random on the real engine and
`tok0 tok1 ...` on the mock, so values are compared only where they are not random.

The mock is started with the real engine's own block size, KV blocks, context length and model
name (read from its `/metrics` and `/v1/models`), once with its engine model (`--engine`) and
once without (what most of `make test` runs against).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from router.engine.parse import parse
from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster
from tests_engine.support import ensure_healthy, wait_idle

# Families sluicegate reads (router/engine/parse.py) or its engine tier checks against.
FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_cached",
    "vllm:generation_tokens",
    "vllm:request_success",
)
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"


@pytest.fixture(scope="module")
def targets(engine_fleet: Fleet) -> Iterator[dict[str, Any]]:
    """{"real": url, "mock": url (engine model), "plain": url (no engine model), "model"}."""
    ensure_healthy(engine_fleet)
    real = engine_fleet.engines[0].url
    models = httpx.get(real + "/v1/models", timeout=10).json()["data"]
    model, max_len = models[0]["id"], models[0]["max_model_len"]
    cache = _family(httpx.get(real + "/metrics", timeout=10).text, "vllm:cache_config_info")
    labels = cache.samples[0].labels
    block, blocks = int(labels["block_size"]), int(labels["num_gpu_blocks"])
    common = ["--served-model-name", model, "--max-model-len", str(max_len)]
    cluster = Cluster()
    try:
        mock = cluster.mock(
            "conform-engine",
            engine_args=[
                "--engine",
                "--block-size",
                str(block),
                "--kv-tokens",
                str(block * blocks),
                *common,
            ],
        )
        plain = cluster.mock("conform-plain", engine_args=common)
        yield {
            "real": real,
            "mock": mock.url,
            "plain": plain.url,
            "model": model,
            "block": block,
            "engine": engine_fleet.engines[0],
        }
    finally:
        cluster.close()


def _family(text: str, name: str) -> Any:
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            return fam
    raise AssertionError(f"{name} missing")


def shape(value: Any) -> Any:
    """The JSON value with every leaf replaced by its type's name."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    if value is None:
        return "null"
    return type(value).__name__


def events(r: httpx.Response) -> list[Any]:
    """The stream's events, its framing checked: `data: ` lines, each closed by a blank line,
    the last `[DONE]`, nothing after it."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    body = r.content
    assert body.endswith(b"data: [DONE]\n\n")
    parts = body.split(b"\n\n")
    assert parts[-1] == b""
    out: list[Any] = []
    for part in parts[:-2]:
        assert part.startswith(b"data: {"), part[:80]
        assert b"\n" not in part
        out.append(json.loads(part[6:]))
    assert parts[-2] == b"data: [DONE]"
    return out


def kinds(evs: list[Any], chat: bool) -> dict[str, list[Any]]:
    """Events by kind: role (chat's first), token, finish (the last token's), usage-only."""
    out: dict[str, list[Any]] = {"role": [], "token": [], "finish": [], "usage": []}
    for i, ev in enumerate(evs):
        if not ev["choices"]:
            out["usage"].append(ev)
        elif ev["choices"][0]["finish_reason"] is not None:
            out["finish"].append(ev)
        elif chat and i == 0 and "role" in ev["choices"][0]["delta"]:
            out["role"].append(ev)
        else:
            out["token"].append(ev)
    return out


def post(url: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _body(model: str, chat: bool, **extra: Any) -> dict[str, Any]:
    if chat:
        base = {"model": model, "messages": [{"role": "user", "content": "hello there, friend"}]}
    else:
        base = {"model": model, "prompt": "hello there, friend"}
    return {**base, "max_tokens": 4, "temperature": 0, **extra}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_whole_bodies_have_vllms_fields(targets: dict[str, Any], chat: bool) -> None:
    path = CHAT if chat else CMPL
    got = {k: post(targets[k], path, _body(targets["model"], chat)) for k in TARGETS}
    for k, r in got.items():
        assert r.status_code == 200, (k, r.text)
        assert r.headers["content-type"] == "application/json"
        # Compact JSON: the router reads usage and the first token without parsing JSON.
        assert b'": ' not in r.content and b'", "' not in r.content, k
    real = got["real"].json()
    for k in ("mock", "plain"):
        assert shape(got[k].json()) == shape(real), k
        usage = got[k].json()["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert real["usage"]["completion_tokens"] == 4


TARGETS = ("real", "mock", "plain")


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("opts", ["none", "include_usage", "continuous"])
def test_stream_events_have_vllms_fields(targets: dict[str, Any], chat: bool, opts: str) -> None:
    extra: dict[str, Any] = {"stream": True}
    if opts != "none":
        extra["stream_options"] = {
            "include_usage": True,
            **({"continuous_usage_stats": True} if opts == "continuous" else {}),
        }
    path = CHAT if chat else CMPL
    by = {
        k: kinds(events(post(targets[k], path, _body(targets["model"], chat, **extra))), chat)
        for k in TARGETS
    }
    real = by["real"]
    # vLLM's order: (chat) the role-only event, tokens, the last token's event with the finish
    # reason (no separate empty one), then the usage-only event when asked for.
    assert len(real["role"]) == (1 if chat else 0)
    assert len(real["finish"]) == 1
    assert len(real["usage"]) == (0 if opts == "none" else 1)
    for k in ("mock", "plain"):
        mine = by[k]
        for kind in ("role", "finish", "usage"):
            assert [shape(e) for e in mine[kind]] == [shape(e) for e in real[kind]], (k, kind)
        assert {json.dumps(shape(e)) for e in mine["token"]} == {
            json.dumps(shape(e)) for e in real["token"]
        }, k
        if opts != "none":
            usage = mine["usage"][0]["usage"]
            assert usage["completion_tokens"] == 4
            assert usage["total_tokens"] == usage["prompt_tokens"] + 4
    if opts != "none":
        assert real["usage"][0]["usage"]["completion_tokens"] == 4


def test_sdk_reads_the_same_fields_from_both(targets: dict[str, Any]) -> None:
    """Through the official SDK: the usage fields an application reads exist on both."""
    for k in TARGETS:
        client = OpenAI(base_url=targets[k] + "/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model=targets["model"],
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None, k
        assert last.usage.completion_tokens == 3, k
        assert last.usage.prompt_tokens_details is not None, k
        assert last.usage.prompt_tokens_details.cached_tokens == 0, k
        assert chunks[0].choices[0].delta.role == "assistant", k
        assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length", k


def _errors(model: str) -> list[tuple[str, str, Any]]:
    msgs = [{"role": "user", "content": "hi"}]
    # Past a 2048-token context in tokens (both count over 2048), not so long in characters
    # that vLLM's earlier character check answers instead (not modelled by the mock).
    long = " ".join(f"word{i}" for i in range(1500))
    chat = {"model": model, "messages": msgs}
    cmpl = {"model": model, "prompt": "hi"}
    unknown = {"model": "no-such-model", "messages": msgs}
    return [
        ("negative max_tokens", CHAT, {**chat, "max_tokens": -1}),
        ("zero max_tokens", CHAT, {**chat, "max_tokens": 0}),
        ("max_tokens over the context", CHAT, {**chat, "max_tokens": 10**6}),
        ("completions over the context", CMPL, {**cmpl, "max_tokens": 10**6}),
        ("max_completion_tokens negative", CHAT, {**chat, "max_completion_tokens": -3}),
        ("max_tokens a word", CHAT, {**chat, "max_tokens": "many"}),
        ("max_tokens a fraction", CHAT, {**chat, "max_tokens": 2.5}),
        ("unknown model", CHAT, {**unknown, "max_tokens": 2}),
        ("unknown model, stream", CHAT, {**unknown, "stream": True}),
        ("unknown model, completions", CMPL, {**cmpl, "model": "no-such-model"}),
        ("no messages", CHAT, {"model": model, "max_tokens": 2}),
        ("messages a string", CHAT, {"model": model, "messages": "hi"}),
        ("no prompt", CMPL, {"model": model, "max_tokens": 2}),
        ("prompt over the context", CMPL, {**cmpl, "prompt": long, "max_tokens": 2}),
        ("body an array", CHAT, [1, 2]),
        (
            "stream_options without stream",
            CHAT,
            {**chat, "stream_options": {"include_usage": True}},
        ),
        ("negative, stream", CHAT, {**chat, "max_tokens": -1, "stream": True}),
    ]


def test_bad_input_gets_vllms_status_and_error(targets: dict[str, Any]) -> None:
    for name, path, body in _errors(targets["model"]):
        got = {k: post(targets[k], path, body) for k in TARGETS}
        real = got["real"]
        assert real.status_code in (400, 404), (name, real.text)
        for k in ("mock", "plain"):
            r = got[k]
            assert r.status_code == real.status_code, (name, k, r.text, real.text)
            assert r.headers["content-type"] == "application/json", (name, k)
            assert r.json() == real.json(), (name, k)


@pytest.mark.parametrize(
    "raw",
    [b'{"model": "x", "messages": [', b'{"prompt": "x", "max_tokens": 2,}', b"", b"null"],
    ids=["truncated", "trailing-comma", "empty", "null"],
)
def test_malformed_json_gets_vllms_error(targets: dict[str, Any], raw: bytes) -> None:
    headers = {"content-type": "application/json"}
    got = {k: httpx.post(targets[k] + CMPL, content=raw, headers=headers) for k in TARGETS}
    real = got["real"]
    assert real.status_code == 400
    for k in ("mock", "plain"):
        assert got[k].status_code == 400, k
        assert got[k].json() == real.json(), k


def test_models_health_and_unknown_paths(targets: dict[str, Any]) -> None:
    real_models = httpx.get(targets["real"] + "/v1/models").json()
    for k in ("mock", "plain"):
        mine = httpx.get(targets[k] + "/v1/models").json()
        assert shape(mine) == shape(real_models), k
        assert [m["id"] for m in mine["data"]] == [m["id"] for m in real_models["data"]]
        assert mine["data"][0]["max_model_len"] == real_models["data"][0]["max_model_len"]
    for k in TARGETS:
        health = httpx.get(targets[k] + "/health")
        assert (health.status_code, health.content) == (200, b""), k
        nope = httpx.post(targets[k] + "/v1/nope", json={})
        assert (nope.status_code, nope.json()) == (404, {"detail": "Not Found"}), k
        wrong = httpx.get(targets[k] + CHAT)
        assert (wrong.status_code, wrong.json()) == (405, {"detail": "Method Not Allowed"}), k


def _metrics(url: str) -> tuple[str, str]:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.headers["content-type"], r.text


def _labelsets(text: str) -> dict[str, tuple[str, set[tuple[str, ...]]]]:
    """Family -> (type, the label-name sets of its samples, by sample name)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in FAMILIES:
            sets = {(s.name, *sorted(s.labels)) for s in fam.samples}
            out[fam.name] = (fam.type, sets)
    return out


def test_metric_families_and_labels_match(targets: dict[str, Any]) -> None:
    real_type, real = _metrics(targets["real"])
    mock_type, mock = _metrics(targets["mock"])
    assert mock_type == real_type
    assert "vllm:gpu_cache_usage_perc" not in real  # the old name, kept only as a fallback
    want, got = _labelsets(real), _labelsets(mock)
    assert set(want) == set(FAMILIES)
    assert got == want
    # Label values the router and the tier read: the reasons, and the KV geometry.
    for name in ("vllm:num_requests_waiting_by_reason", "vllm:request_success"):
        values = {tuple(sorted(s.labels.items())) for s in _family(real, name).samples}
        mine = {tuple(sorted(s.labels.items())) for s in _family(mock, name).samples}
        strip = lambda vs: {tuple(kv for kv in v if kv[0] != "model_name") for v in vs}  # noqa: E731
        assert strip(mine) == strip(values), name
    rc = _family(real, "vllm:cache_config_info").samples[0].labels
    mc = _family(mock, "vllm:cache_config_info").samples[0].labels
    assert set(mc) == set(rc)
    for key in ("block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"):
        assert mc[key] == rc[key], key
    # The router's own reader takes both alike.
    a, b = parse(real.encode(), "vllm"), parse(mock.encode(), "vllm")
    assert (
        a.kv_capacity_tokens
        == b.kv_capacity_tokens
        == int(rc["block_size"]) * int(rc["num_gpu_blocks"])
    )
    assert a.preemptions is not None and b.preemptions is not None


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_total") or s.name == "vllm:num_requests_running":
                reason = s.labels.get("finished_reason")
                key = f"{s.name}:{reason}" if reason else s.name
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_prefix_cache_and_counters_agree(targets: dict[str, Any]) -> None:
    """The same long prompt twice: the second finds whole blocks cached, never its last token,
    and the token counters move by what `usage` says, on the engine and on the mock alike."""
    wait_idle([targets["engine"]])  # counters move by this test's requests only
    block = targets["block"]
    salt = uuid.uuid4().hex[:8]
    prompt = f"{salt} " + " ".join(f"item{i}" for i in range(400))
    for k in ("real", "mock"):
        before = _counters(targets[k])
        usages = []
        for _ in range(2):
            body = {"model": targets["model"], "prompt": prompt, "max_tokens": 3, "temperature": 0}
            r = post(targets[k], CMPL, body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        after = _counters(targets[k])
        first, second = usages
        n = first["prompt_tokens"]
        assert n > 2 * block, (k, n)  # at least two whole blocks to find
        assert first["prompt_tokens_details"]["cached_tokens"] == 0, k
        assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // block * block, k
        delta = {key: after[key] - before.get(key, 0.0) for key in after}
        assert delta["vllm:prompt_tokens_total"] == 2 * n, k
        assert delta["vllm:generation_tokens_total"] == 6, k
        assert delta["vllm:prefix_cache_queries_total"] == 2 * n, k
        assert delta["vllm:prefix_cache_hits_total"] == (n - 1) // block * block, k
        assert delta["vllm:request_success_total:length"] == 2, k


def test_client_disconnect_aborts_alike(targets: dict[str, Any]) -> None:
    """A client that leaves mid-stream: running goes back to 0 within a second, generation
    stops, and vLLM counts the abort under no finished_reason; the mock does the same."""
    wait_idle([targets["engine"]])
    for k in ("real", "mock"):
        before = _counters(targets[k])
        body = {
            "model": targets["model"],
            "prompt": "tell me a long story",
            "max_tokens": 1500,
            "stream": True,
        }
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", targets[k] + CMPL, json=body) as r:
                seen = 0
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen == 3:
                            break
        deadline = time.monotonic() + 2.0
        while True:
            now = _counters(targets[k])
            if now["vllm:num_requests_running"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert now["vllm:num_requests_running"] == 0, k
        time.sleep(0.3)  # nothing more is generated after the abort
        later = _counters(targets[k])
        generated = later["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
        assert 3 <= generated < 500, (k, generated)
        for reason in ("length", "stop", "abort"):
            key = f"vllm:request_success_total:{reason}"
            assert later[key] == before[key], (k, reason)
