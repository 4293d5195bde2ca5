"""ext_proc streams replayed straight into `sluicegate epp`'s gRPC server, in every order the
protocol allows (Envoy's FULL_DUPLEX_STREAMED body modes): the body in one chunk or many, no body,
trailers, and the stream reset at each step; after each, the in-flight counts are back to 0.
The fleet is the package's (tests/picker/conftest.py); the engines are only named here (the
gateway would send the request).
"""

from __future__ import annotations

import json

import pytest

from router.picker import messages
from router.picker.proto.base_pb2 import HeaderMap
from router.picker.proto.external_processor_pb2 import (
    HttpTrailers,
    ProcessingRequest,
)
from tests.support.harness import Proc
from tests.support.picker import (
    CHAT,
    Session,
    body,
    chat,
    destination,
    head,
    health,
    in_flight,
    replayed,
    response_body,
    response_head,
)
from tests.support.wait import wait_for


def address(mock: Proc) -> str:
    return mock.url.removeprefix("http://")


def back_to_zero(fleet: dict[str, Proc]) -> None:
    picker = fleet["picker"]
    wait_for(lambda: set(in_flight(picker).values()) == {0}, "in-flight counts back to 0")


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
    import httpx

    picker = fleet["picker"]
    r = httpx.post(picker.url + CHAT, content=chat(), timeout=5)
    assert r.status_code == 404
    assert "sluicegate_requests_total" in httpx.get(picker.url + "/metrics", timeout=5).text
