"""Each API's usage read from the bytes a real vLLM 0.32.0 sent (captured once, kept here), the
multipart form fields, the response-id map's expiry, the endpoint table and Anthropic's errors.
In process: no servers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from starlette.responses import Response

from router.core.endpoints import BY_ROUTE, ENDPOINTS, match_follow
from router.core.errors import NoCapacity, answer
from router.core.fastjson import with_member
from router.request.admit.estimate import estimate_tokens
from router.request.placement.prefix import prefix_hashes
from router.request.placement.response_ids import Holder, ResponseIds
from router.request.usage.parse import ResponseUsage
from router.request.wire.multipart import boundary_of, form_fields, replace_span

DATA = Path(__file__).resolve().parents[2] / "support" / "data"

# vLLM 0.32.0, POST /v1/messages with stream (max_tokens 3), as it came.
MESSAGES_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-84532cb20ef1'
    b'14de","type":"message","role":"assistant","content":[],"model":"tiny","stop_reason":null,'
    b'"stop_sequence":null,"usage":{"input_tokens":13,"output_tokens":0}}}\n\n'
    b'event: content_block_start\ndata: {"type":"content_block_start","content_block":{"type":'
    b'"text","text":""},"index":0}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delt'
    b'a","text":" lists"},"index":0}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delt'
    b'a","text":" trailing"},"index":0}\n\n'
    b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delt'
    b'a","text":"info"},"index":0}\n\n'
    b'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens","s'
    b'top_sequence":null},"usage":{"input_tokens":13,"output_tokens":3,"cache_creation_input_tok'
    b'ens":0,"cache_read_input_tokens":0}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)
MESSAGE_BODY = (
    b'{"id":"chatcmpl-b6b43ae737aa96f8","type":"message","role":"assistant","content":[{"type":'
    b'"text","text":"truemanager limPSI"}],"model":"tiny","stop_reason":"max_tokens","usage":{"'
    b'input_tokens":13,"output_tokens":4,"cache_creation_input_tokens":0,"cache_read_input_toke'
    b'ns":0}}'
)


def feed(shape: str, data: bytes, stream: bool, size: int = 97) -> ResponseUsage:
    u = ResponseUsage(shape)
    for i in range(0, len(data), size):  # cut anywhere, as upstream reads are
        (u.feed if stream else u.keep)(data[i : i + size])
    u.close(True)
    return u


@pytest.mark.parametrize("size", [7, 97, 100_000])
def test_responses_stream_usage_from_real_vllm(size: int) -> None:
    u = feed("responses", (DATA / "vllm-0.32.0-responses-stream.txt").read_bytes(), True, size)
    assert (u.input_tokens, u.output_tokens, u.cached_tokens) == (14, 3, 0)
    assert u.events == 2  # two output_text.delta events (a token's text held back)
    assert u.first_token_at is not None


def test_messages_usage_from_real_vllm() -> None:
    u = feed("messages", MESSAGES_STREAM, True, 13)
    assert (u.input_tokens, u.output_tokens, u.events) == (13, 3, 3)
    whole = feed("messages", MESSAGE_BODY, False)
    assert (whole.input_tokens, whole.output_tokens) == (13, 4)


def test_messages_usage_adds_the_cached_part_and_falls_back_to_message_start() -> None:
    # Anthropic's input_tokens leaves out cache reads: the prompt is their sum.
    cached = MESSAGES_STREAM.replace(b'"cache_read_input_tokens":0', b'"cache_read_input_tokens":5')
    u = feed("messages", cached, True)
    assert (u.input_tokens, u.cached_tokens) == (18, 5)
    # Anthropic's own API sends only output_tokens in message_delta.
    short = MESSAGES_STREAM.replace(
        b'"usage":{"input_tokens":13,"output_tokens":3,"cache_creation_input_tokens":0,'
        b'"cache_read_input_tokens":0}',
        b'"usage":{"output_tokens":3}',
    )
    u = feed("messages", short, True)
    assert (u.input_tokens, u.output_tokens) == (13, 3)


def test_multipart_fields_and_alias_splice() -> None:
    boundary = b"XyZ"
    audio = b"\r\n--Xy not the boundary\r\n" * 100
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="model"\r\n'
        b"Content-Type: audio/wav\r\n\r\n" + audio + b"\r\n"
        b'--XyZ\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
        b'--XyZ\r\nContent-Disposition: form-data; name="stream"\r\n\r\ntrue\r\n--XyZ--\r\n'
    )
    assert boundary_of('multipart/form-data; boundary="XyZ"') == boundary
    assert boundary_of("application/json") is None
    spans = form_fields(body, boundary, frozenset({"model", "stream"}))
    assert body[slice(*spans["model"])] == b"m" and body[slice(*spans["stream"])] == b"true"
    spliced = replace_span(body, spans["model"], b"backend-model")
    assert spliced.replace(b"backend-model", b"m", 1) == body  # every other byte kept


def test_an_alias_rewrites_the_model_member_and_keeps_every_other_byte() -> None:
    body = b'{"model": "m", "x": [1, 2.50, 1e400, "\\u00e9"], "s": {"a":  true}}'
    out = with_member(body, "model", "backend/é")
    assert out is not None and json.loads(out)["model"] == "backend/é"
    assert b'[1, 2.50, 1e400, "\\u00e9"]' in out and b'{"a":  true}' in out
    assert json.loads(with_member(b'{"model":"a","model":"b","k":1}', "model", "t") or b"") == {
        "model": "t",
        "k": 1,
    }
    assert json.loads(with_member(b'{"k":1}', "model", "t") or b"") == {"k": 1, "model": "t"}
    for refused in (b"[1]", b'{"a": NaN}', b'{"a": 1} x', b'"s"'):
        assert with_member(refused, "model", "t") is None, refused


def test_response_ids_expire_and_are_bounded() -> None:
    asyncio.run(_expire_and_bound())


async def _expire_and_bound() -> None:
    now = [0.0]
    ids = ResponseIds(ttl=10, max_local=2, clock=lambda: now[0])
    await ids.remember("r1", Holder("a", "m"))
    now[0] = 9.0
    assert await ids.find("r1") == Holder("a", "m")  # a use keeps it another ttl
    now[0] = 18.0
    assert await ids.find("r1") == Holder("a", "m")
    now[0] = 40.0
    assert await ids.find("r1") is None
    for name in ("r2", "r3", "r4"):
        await ids.remember(name, Holder("b", "m"))
    assert len(ids) == 2 and await ids.find("r2") is None


def test_endpoint_table() -> None:
    assert len({(e.method, e.path) for e in ENDPOINTS}) == len(ENDPOINTS)
    matched = match_follow("POST", "/v1/responses/resp_1/cancel")
    assert matched == (BY_ROUTE[("POST", "/v1/responses/{response_id}/cancel")], "resp_1")
    assert match_follow("GET", "/v1/responses/resp_1")[1] == "resp_1"  # type: ignore[index]
    assert match_follow("DELETE", "/v1/responses/resp_1") is None
    assert match_follow("GET", "/v1/responses/a/b") is None
    # The quota estimate reads each API's own limit field.
    responses = BY_ROUTE[("POST", "/v1/responses")]
    assert estimate_tokens({"max_output_tokens": 7}, 400, responses.limit_fields, 256) == 107
    assert estimate_tokens({"max_tokens": 7}, 400, responses.limit_fields, 256) == 356
    tokenize = BY_ROUTE[("POST", "/tokenize")]
    assert (
        estimate_tokens(
            {}, 400, tokenize.limit_fields, 256, prompt_from_body=tokenize.prompt_from_body
        )
        == 0
    )


def test_anthropic_error_keeps_status_headers_and_message() -> None:
    ours = NoCapacity("Every backend is busy.", retry_after=2)
    ours.request_id = "r"
    theirs: Response = answer(ours, anthropic=True)
    assert theirs.status_code == 503
    assert theirs.headers["retry-after"] == "2" and theirs.headers["x-request-id"] == "r"
    assert json.loads(bytes(theirs.body)) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Every backend is busy."},
    }


def test_cache_aware_prefix_of_responses_and_messages() -> None:
    text = "Summarise our contract, clause by clause. " * 20
    as_string = prefix_hashes({"input": text}, 64, 4096, responses=True)
    as_items = prefix_hashes({"input": [{"role": "user", "content": text}]}, 64, 4096, True)
    as_chat = prefix_hashes({"messages": [{"role": "user", "content": text}]}, 64, 4096)
    assert as_string and as_string == as_items == as_chat
    # Instructions / a system prompt lead the prefix: another one shares no block.
    told = prefix_hashes({"instructions": "be brief", "input": text}, 64, 4096, True)
    system = prefix_hashes(
        {"system": "be brief", "messages": [{"role": "user", "content": text}]}, 64, 4096
    )
    assert told == system and not set(told) & set(as_string)
