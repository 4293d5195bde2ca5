"""Precise prefix routing on real vLLM: the router's index follows each engine's KV events
(stores, evictions, a restart) and `cache_aware` follows the index, per the engines' own
`cached_tokens`; the router's tokens equal the engine's `/tokenize`; the engine's events decode
as the mock's do (the mock is held to them)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from router.request.placement.token_memo import MIN_IDS, earlier, memo_key, shared_ids
from router.request.placement.tokens import RouterTokenizer
from router.tools.enginefleet.fleet import START_TIMEOUT_S, Engine, Fleet
from tests.support.harness import Cluster, Proc
from tests.support.wait import wait_for
from tests_engine.support import kv_capacity_blocks, rows, start_router


def _doc(tag: str, words: int = 240) -> list[dict[str, Any]]:
    """A chat whose system prompt is ~1.1-1.4k tokens (8-10 full blocks of 128, by the tag),
    under max_model_len."""
    return [
        {"role": "system", "content": " ".join(f"{tag}{i}" for i in range(words))},
        {"role": "user", "content": "go"},
    ]


def _chat(base: str, model: str, messages: list[dict[str, Any]]) -> tuple[str | None, int, int]:
    """(the backend that served, cached prompt tokens, prompt tokens)."""
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    r.raise_for_status()
    usage = r.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    return r.headers.get("x-sluicegate-backend"), cached, int(usage["prompt_tokens"])


def _kv_rows(router: Proc) -> dict[str, dict[str, Any]]:
    rows = httpx.get(router.url + "/admin/backends", timeout=10).json()
    return {r["name"]: r["kv_events_state"] for r in rows}


def _reasons(router: Proc) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(router.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("sluicegate_routing_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('reason="')[1].split('"')[0]
            backend = labels.split('backend="')[1].split('"')[0]
            out[f"{backend}/{reason}"] = out.get(f"{backend}/{reason}", 0.0) + float(value)
    return out


def _idle_readings(router: Proc) -> None:
    """Until the router's readings show no engine running or queueing: cache_aware weighs a
    holder's batch against the prefill it saves, and a reading taken while an earlier request
    ran would make the holder look busy (on a starved machine scrapes lag)."""
    wait_for(
        lambda: all(
            (e := r["engine"]) and not e["stale"] and e["running"] == 0 and e["waiting"] == 0
            for r in rows(router).values()
        ),
        "the router reads both engines idle",
        30,
    )


def _router(procs: Cluster, fleet: Fleet) -> Proc:
    e0 = fleet.engines[0]
    config = {
        "balancer": "cache_aware",
        "expose_backend_header": True,
        "affinity": {"tokenizers": {e0.model: {"via": "router", "path": str(e0.model_dir)}}},
        "backends": [
            {
                "name": f"engine-{e.index}",
                "url": e.url,
                "kind": "vllm",
                "models": {e.model: e.model},
                "kv_events": {},  # discovered from the engine's GET /kv_event_sources
            }
            for e in fleet.engines
        ],
    }
    return start_router(procs, fleet, config)


def _fill(engine: Engine, tag: str) -> None:
    """Enough other prompts straight to `engine` to evict everything it held."""
    blocks, _ = kv_capacity_blocks(engine)
    for j in range(blocks // 8 + 2):  # each fills 8 blocks or more
        _chat(engine.url, engine.model, _doc(f"{tag}{j}x"))  # distinct from the first word on


# The session's engines start in this test's setup (it runs first) and it restarts one: two
# engine starts, each allowed START_TIMEOUT_S, and its requests. Under the tier's 300 s a machine
# at load average 18-28 timed it out in the restart (setup 220 s), every routing check passed.
@pytest.mark.timeout(2 * START_TIMEOUT_S + 120)
def test_routing_follows_the_engines_own_cache(fleet: Fleet, procs: Cluster) -> None:
    router = _router(procs, fleet)
    model = fleet.engines[0].model
    wait_for(
        lambda: all(r and r["state"] == "live" for r in _kv_rows(router).values()),
        "both engines' events live",
        30,
    )
    e0, e1 = fleet.engines[:2]
    a = _doc(f"a{time.monotonic_ns() % 997}w")
    # A client the router never sees fills engine 1's cache ...
    _, cached, prompt = _chat(e1.url, model, a)
    assert cached == 0
    # The engine reports full blocks only: as many as the prompt fills (8-10, by the tag); a
    # repeat finds them all cached but the one holding its last token, which is computed again.
    block = kv_capacity_blocks(e1)[1]
    full = prompt // block
    reused = (prompt - 1) // block * block
    wait_for(lambda: _kv_rows(router)["engine-1"]["blocks"] >= full, "the router indexed it", 10)
    # ... and the router sends that prefix there, where the engine finds it cached.
    for _ in range(2):
        _idle_readings(router)
        backend, cached, _ = _chat(router.url, model, a)
        assert backend == "engine-1" and cached >= reused
    assert _reasons(router).get("engine-1/prefix_exact", 0) >= 2

    # Engine 1 evicts it (traffic straight to it), engine 0 gets it: the choice moves.
    _fill(e1, "fill")
    _chat(e0.url, model, a)
    wait_for(
        lambda: _kv_rows(router)["engine-1"]["events"].get("BlockRemoved", 0) > 0,
        "engine 1's eviction and engine 0's store seen",
        10,
    )
    time.sleep(0.3)  # the last batch of the direct request
    _idle_readings(router)
    backend, cached, _ = _chat(router.url, model, a)
    assert backend == "engine-0" and cached >= reused

    # Engine 0 restarts empty: its index goes (health saw it stop, or its seq began at 0 again),
    # the prefix is not sent there for a cache it no longer has, and the index fills again.
    e0.restart(wait=True)
    wait_for(lambda: _kv_rows(router)["engine-0"]["blocks"] == 0, "engine 0's index dropped", 30)
    _chat(router.url, model, a)
    assert _reasons(router).get("engine-0/prefix_exact", 0) == 1  # only the one before
    _chat(e0.url, model, a)
    wait_for(
        lambda: (r := _kv_rows(router)["engine-0"])["state"] == "live" and r["blocks"] >= full,
        "engine 0 live and indexed again",
        15,
    )


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "def f(x):\n    return x * 2\n"},
        {"prompt": "  leading spaces, é, 中文 and 🎉"},
        {"messages": [{"role": "user", "content": "hello  there\n"}]},
        {
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "system", "content": "A second system message."},
                {"role": "developer", "content": "and a developer one"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "part one"},
                        {"type": "text", "text": "part two"},
                    ],
                },
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "The weather now",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"],
                        },
                    },
                }
            ],
        },
    ],
)
def test_router_tokens_equal_the_engines(fleet: Fleet, body: dict[str, Any]) -> None:
    e = fleet.engines[0]
    tk = RouterTokenizer(str(e.model_dir))
    engine = httpx.post(e.url + "/tokenize", json={"model": e.model, **body}, timeout=30)
    assert engine.status_code == 200, engine.text
    assert tk.tokens(body) == engine.json()["tokens"]


def test_router_tokens_of_prompts_sharing_a_long_prefix_equal_the_engines(fleet: Fleet) -> None:
    """Long prompts are encoded in chunks, the shared prefix's from the router's cache: the ids
    still equal the engine's own, for completions and chat alike."""
    e = fleet.engines[0]
    tk = RouterTokenizer(str(e.model_dir))
    words = ["route", "the", "prompt's", "prefix", "to", "engine", "2026", "(cached)", "é"]
    prefix = " ".join(words[(i * 5) % len(words)] for i in range(700)) + "\n\n"
    for tail in ("first question?", "a second, longer question about it", "x"):
        for body in (
            {"prompt": prefix + tail},
            {
                "messages": [
                    {"role": "system", "content": prefix},
                    {"role": "user", "content": tail},
                ]
            },
        ):
            engine = httpx.post(e.url + "/tokenize", json={"model": e.model, **body}, timeout=30)
            assert engine.status_code == 200, engine.text
            assert tk.tokens(body) == engine.json()["tokens"]
    assert tk._chunked  # the chunks were in play


def test_the_memos_ids_begin_every_later_prompt_of_their_conversation(fleet: Fleet) -> None:
    """`via: engine`'s memo (router/request/placement/token_memo.py) on the real chat template: what
    one request's whole prompt and its earlier messages alone share (less the margin) begins the
    engine's own ids of every later prompt with those earlier messages, whatever comes last."""
    e = fleet.engines[0]

    def ids(body: dict[str, Any]) -> list[int]:
        r = httpx.post(e.url + "/tokenize", json={"model": e.model, **body}, timeout=30)
        assert r.status_code == 200, r.text
        tokens = r.json()["tokens"]
        assert isinstance(tokens, list)
        return tokens

    system = {"role": "system", "content": "You route prompts to engines (2026). " * 30}
    histories = [
        [system],
        [system, {"role": "user", "content": "hello?"}, {"role": "assistant", "content": "Hi."}],
        [{"role": "user", "content": "Only a user turn before, é and all. " * 20}],
    ]
    for history in histories:
        first = {"messages": [*history, {"role": "user", "content": "first question?"}]}
        learned = shared_ids(ids(first), ids(earlier(first)))
        assert len(learned) >= MIN_IDS
        for last in ("a second, longer question about routing", "x", "é?"):
            later = {"messages": [*history, {"role": "user", "content": last}]}
            assert memo_key(e.model, later) == memo_key(e.model, first)
            assert ids(later)[: len(learned)] == learned
