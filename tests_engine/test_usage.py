"""The tokens the router counts are the tokens the engines say they processed.

The router's `sluicegate_tokens_total{kind=prompt|completion}` moves by exactly what the engines'
own `vllm:prompt_tokens_total` and `vllm:generation_tokens_total` move by (and `kind=cached` by
`vllm:prompt_tokens_cached_total`), over a mix of
whole-body and streamed requests, with and without the client's `include_usage`, on both
engines. Nothing else talks to these engines during the test (the fixture waits for them idle).
"""

from __future__ import annotations

from typing import Any

import openai

from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster
from tests.support.wait import wait_for
from tests_engine.support import Words, kv_capacity_blocks, metrics, router_metrics, start_router

ENGINE_PROMPT, ENGINE_GEN = "vllm:prompt_tokens_total", "vllm:generation_tokens_total"
ENGINE_CACHED = "vllm:prompt_tokens_cached_total"
CACHED = "sluicegate_tokens_total{kind=cached}"
REQUESTS = "sluicegate_requests_total"
PROMPT, COMPLETION = (
    "sluicegate_tokens_total{kind=prompt}",
    "sluicegate_tokens_total{kind=completion}",
)


def engine_totals(fleet: Fleet) -> tuple[float, float, float]:
    ms = [metrics(e) for e in fleet.engines]
    return (
        sum(m[ENGINE_PROMPT] for m in ms),
        sum(m[ENGINE_GEN] for m in ms),
        sum(m[ENGINE_CACHED] for m in ms),
    )


def test_router_usage_equals_the_engines_own_counters(fleet: Fleet, procs: Cluster) -> None:
    router = start_router(procs, fleet, {"balancer": "round_robin"})
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=60)
    model = fleet.engines[0].model
    before_engines = engine_totals(fleet)
    before = router_metrics(router)
    # A prompt longer than a KV block, sent again: the repeats are served partly from cache.
    long = Words(fleet, seed=30).text(2 * kv_capacity_blocks(fleet.engines[0])[1])
    for i in range(4):  # round robin: each shape reaches both engines; 5 requests each
        messages = [{"role": "user", "content": f"count the tokens of request {i} " * (i + 1)}]
        if i >= 2:
            messages = [{"role": "user", "content": long + f" request {i}"}]
        common: dict[str, Any] = {"model": model, "max_tokens": 7 + 5 * i, "temperature": 0}
        whole = c.chat.completions.create(messages=messages, **common)  # type: ignore[arg-type]
        # A stream without include_usage: the router asks for it and counts it (the client
        # sees no usage chunk), and one with it (the client sees the engine's).
        chunks = list(
            c.chat.completions.create(messages=messages, stream=True, **common)  # type: ignore[arg-type]
        )
        assert all(ch.usage is None for ch in chunks)
        chunks = list(
            c.chat.completions.create(
                messages=messages,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
                **common,
            )
        )
        # vLLM's streamed usage leaves out fields its whole-body usage has as null: compare counts.
        streamed = [ch.usage for ch in chunks if ch.usage is not None]
        assert [(u.prompt_tokens, u.completion_tokens) for u in streamed] == [
            (whole.usage.prompt_tokens, whole.usage.completion_tokens)  # type: ignore[union-attr]
        ]
        text = list(c.completions.create(prompt=f"complete {i}", stream=True, **common))
        assert all(ch.usage is None for ch in text)
        assert c.completions.create(prompt=f"complete {i}", **common).usage is not None
    # Counted as each response ends, which may trail the client a little (the SDK closes at
    # [DONE]): every request answered is counted before the figures are compared.
    sent = 4 * 5
    wait_for(
        lambda: router_metrics(router).get(REQUESTS, 0) - before.get(REQUESTS, 0) >= sent,
        "the router counted every response",
        10.0,
    )
    after_engines = engine_totals(fleet)
    engine_prompt = after_engines[0] - before_engines[0]
    engine_gen = after_engines[1] - before_engines[1]
    engine_cached = after_engines[2] - before_engines[2]
    assert engine_prompt > 0 and engine_gen > 0 and engine_cached > 0
    after = router_metrics(router)
    counted = {k: after.get(k, 0) - before.get(k, 0) for k in (PROMPT, COMPLETION, CACHED)}
    assert counted == {PROMPT: engine_prompt, COMPLETION: engine_gen, CACHED: engine_cached}
