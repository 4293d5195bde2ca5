"""Issue 23 against real vLLM 0.32.0 engines: the OpenAI SDK's Responses API through sluicegate
with a previous_response_id chain that lands on the engine holding it through either of 2
replicas sharing Redis, and the Anthropic SDK's Messages API streamed and not, usage counted,
an abort stopping generation. One router pair for the file's tests (~20 s of engine time)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from router.tools.enginefleet.fleet import Engine, Fleet
from tests.support.harness import Cluster, Proc
from tests.support.wait import wait_for
from tests_engine.support import metrics, start_router


@pytest.fixture(scope="module")
def pair(engine_fleet: Fleet) -> Iterator[tuple[Proc, Proc]]:
    """Two replicas sharing one Redis, for both tests (each test still gets `fleet`: healthy,
    idle engines)."""
    c = Cluster()
    try:
        redis = c.redis()
        env = {"SLUICEGATE_REDIS_URL": redis.url}
        config: dict[str, Any] = {"balancer": "round_robin"}
        yield (
            start_router(c, engine_fleet, config, env=env),
            start_router(c, engine_fleet, config, env=env),
        )
    finally:
        c.close()


def holder(engines: list[Engine], response_id: str) -> int:
    """The engine that stored the response (asked directly, not through the router)."""
    found = [
        e.index
        for e in engines
        if httpx.get(f"{e.url}/v1/responses/{response_id}", timeout=5).status_code == 200
    ]
    assert len(found) == 1, found
    return found[0]


def tokens(router: Proc, kind: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sluicegate_tokens_total{") and f'kind="{kind}"' in line
    )


def test_responses_chain_lands_on_the_engine_holding_it(
    fleet: Fleet, pair: tuple[Proc, Proc]
) -> None:
    model = fleet.engines[0].model
    clients = [
        openai.OpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for r in pair
    ]
    first = clients[0].responses.create(
        model=model, input="Tell me a story.", max_output_tokens=8, temperature=0
    )
    assert first.usage is not None and first.usage.output_tokens > 0
    home = holder(fleet.engines, first.id)
    previous = first.id
    # Round robin alone alternates engines; an engine without the previous response answers
    # 404, so each success is the chain reaching its home, through either replica.
    for turn in range(4):
        client = clients[(turn + 1) % 2]
        if turn % 2:
            with client.responses.stream(
                model=model,
                input=f"And then? ({turn})",
                max_output_tokens=8,
                temperature=0,
                previous_response_id=previous,
            ) as s:
                nxt = s.get_final_response()
        else:
            nxt = client.responses.create(
                model=model,
                input=f"And then? ({turn})",
                max_output_tokens=8,
                temperature=0,
                previous_response_id=previous,
            )
        assert nxt.previous_response_id == previous
        assert holder(fleet.engines, nxt.id) == home
        previous = nxt.id
    assert clients[1].responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        clients[0].responses.cancel(first.id)


def test_anthropic_messages_usage_and_abort(fleet: Fleet, pair: tuple[Proc, Proc]) -> None:
    model = fleet.engines[0].model
    router = pair[0]
    client = anthropic.Anthropic(base_url=router.url, api_key="none", max_retries=0, timeout=60)
    before = tokens(router, "completion"), tokens(router, "prompt")
    msg = client.messages.create(
        model=model, max_tokens=6, messages=[{"role": "user", "content": "hello"}]
    )
    assert msg.content and msg.usage.output_tokens > 0 and msg.usage.input_tokens > 0
    with client.messages.stream(
        model=model, max_tokens=6, messages=[{"role": "user", "content": "hello again"}]
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.usage.output_tokens > 0
    # Counted from each answer's own usage (message_delta for the stream).
    assert tokens(router, "completion") - before[0] == msg.usage.output_tokens + (
        final.usage.output_tokens
    )
    assert tokens(router, "prompt") - before[1] >= msg.usage.input_tokens

    def counted() -> float:
        return sum(metrics(e).get("vllm:generation_tokens_total", 0.0) for e in fleet.engines)

    # The engine's count is read just before the client leaves: a starved engine's API server
    # sends its outputs late and in bulk, so the engine may be far ahead of the events read.
    for _ in range(3):
        generated = counted()
        with client.messages.stream(
            model=model, max_tokens=1800, messages=[{"role": "user", "content": "go on and on"}]
        ) as s:
            for n, _ in enumerate(s.text_stream):
                if n == 5:
                    break
            ahead = counted()
        wait_for(
            lambda: all(
                metrics(e).get("vllm:num_requests_running", 0.0) == 0 for e in fleet.engines
            ),
            "generation stopped after the client left",
            10.0,
        )
        time.sleep(0.3)  # a step that was under way ends; nothing more may follow
        after = counted()
        if ahead - generated < 1800:  # else it had ended before the client left: again
            break
    assert after - generated < 1800, "the engine generated to the end after the client left"
    assert after - ahead < 900  # stopped soon after the close
