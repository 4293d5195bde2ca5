"""A lookup through the router (`/tokenize`, `/detokenize`) prefills nothing, so it teaches the
prefix index nothing: `vllm bench serve` tokenizes every prompt through the router before a run
whose tokenizer disagrees with the engine's, and each call used to record its prompt as cached
on the engine that answered it (a `prefix` hit for the real request, on a cache that held
nothing). A real router with `balancer: cache_aware` in front of 2 mock engines, the openai SDK.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from bench.kit.chat import routing_reasons
from tests.support.harness import STARVED_S, Cluster, Proc, backend


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Proc]]:
    c = Cluster()
    try:
        mocks = {n: c.mock(n) for n in ("a", "b")}
        router = c.router(
            {
                "backends": [backend(n, m) for n, m in mocks.items()],
                "balancer": "cache_aware",
                "expose_backend_header": True,
                "health": {"interval": 60},
            }
        )
        yield {**mocks, "router": router}
    finally:
        c.close()


def test_a_tokenized_prompt_is_not_taken_for_a_cached_one(fleet: dict[str, Proc]) -> None:
    url = fleet["router"].url
    # Long enough for whole blocks of the index: a shared opening, then each prompt's own.
    prompts = [f"{'shared opening ' * 300}prompt {i}" for i in range(4)]
    for p in prompts:
        r = httpx.post(url + "/tokenize", json={"model": "m", "prompt": p}, timeout=STARVED_S)
        assert r.status_code == 200, r.text
    # Placed by load alone, with no prefix or home decided for a prompt nobody computed.
    assert set(routing_reasons(url)) == {"load"}

    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=STARVED_S, max_retries=0)
    client.completions.create(model="m", prompt=prompts[0], max_tokens=1)
    reasons = routing_reasons(url)
    # The first real request of the group finds it nowhere: placed as new, at its home.
    assert reasons.get("prefix", 0) == 0 and reasons.get("home", 0) == 1, reasons
    # And the index learns from that request: the next prompt of the group follows it.
    raw = client.completions.with_raw_response.create(model="m", prompt=prompts[1], max_tokens=1)
    first = raw.headers["x-sluicegate-backend"]
    assert routing_reasons(url).get("prefix", 0) == 1
    again = client.completions.with_raw_response.create(model="m", prompt=prompts[0], max_tokens=1)
    assert again.headers["x-sluicegate-backend"] == first
