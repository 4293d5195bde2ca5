"""The pieces of migration, in process: what the pump records, the continuation, the stitch."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.core.settings import MigrationConfig
from router.request.migration.continuation import CannotContinue, build
from router.request.migration.policy import Migration, Plan
from router.request.migration.relay import CHOICES_END, COMPACT_AT, Relayed
from router.request.migration.stitch import Stitch
from router.request.usage.parse import ResponseUsage


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def chat_chunk(text: str | None, finish: str | None = None, **delta: Any) -> bytes:
    d: dict[str, Any] = dict(delta)
    if text is not None:
        d["content"] = text
    return event(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 7,
            "model": "m-a",
            "choices": [{"index": 0, "delta": d, "finish_reason": finish}],
        }
    )


def relay_all(relay: Relayed, chunks: list[bytes]) -> bytes:
    """What the pump would send (its inline test, or `feed`), with what it sent reaching the
    relay through the usage reader's batches, as in the pump."""
    usage = ResponseUsage("chat")
    usage.sink = relay.take
    out = b""
    for c in chunks:
        if relay.slow or c[-4:] != CHOICES_END or c.find(b'"finish_reason":"') >= 0:
            c = relay.feed(c)
        usage.feed(c)
        out += c
        if relay.broken is not None:
            break
    usage.flush()
    return out


def test_the_text_relayed_is_kept_exactly_also_past_the_fold() -> None:
    relay = Relayed("chat")
    words = ['tok "quoted" ', "\\back ", "ünï ", "😀 ", 'say "error" '] * 2000
    chunks = [chat_chunk("", role="assistant")] + [chat_chunk(w) for w in words]
    assert sum(map(len, chunks)) > 2 * COMPACT_AT
    sent = relay_all(relay, chunks)
    assert sent == b"".join(chunks)  # nothing withheld: `"error"` in a token's text is text
    assert relay.broken is None
    assert relay.size <= COMPACT_AT  # folded as it went
    summary = relay.summary()
    assert summary.text == "".join(words)
    assert summary.head is not None and summary.head["id"] == "chatcmpl-1"
    assert not summary.tool_calls and not summary.finished


def test_a_partial_event_is_held_until_its_end_arrives() -> None:
    relay = Relayed("chat")
    one, two = chat_chunk("a"), chat_chunk("b")
    joined = one + two
    cut = len(one) + 10
    assert relay_all(relay, [joined[:cut]]) == one
    assert relay.slow
    assert relay_all(relay, [joined[cut:]]) == two
    assert relay.summary().text == "ab"


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (
            event({"error": {"message": "boom", "type": "InternalServerError", "code": 500}}),
            "error_event",
        ),
        (chat_chunk("", finish="error"), "finish_error"),
    ],
)
def test_an_engine_error_is_withheld_and_breaks_the_relay(bad: bytes, why: str) -> None:
    relay = Relayed("chat")
    good = chat_chunk("x")
    sent = relay_all(relay, [good + bad + b"data: [DONE]\n\n"])
    assert sent == good
    assert relay.broken == why
    assert relay.summary().text == "x"


USAGE = event({"id": "chatcmpl-1", "choices": [], "usage": {"completion_tokens": 3}})
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    "tail",
    [
        # a choice that finishes in error, then the usage event: the error is not the last event
        [chat_chunk("", finish="error"), USAGE, DONE],
        [event({"error": {"message": "boom", "type": "InternalServerError"}}), DONE],
        [event({"error": {"message": "boom", "type": "InternalServerError"}})],
    ],
)
@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
def test_an_engine_error_ending_a_whole_stream_read_at_once_is_found(
    tail: list[bytes], eol: bytes
) -> None:
    relay = Relayed("chat")
    good = b"".join(chat_chunk(w) for w in ['say "error" ', "x"] * 50).replace(b"\n", eol)
    sent = relay_all(relay, [good + b"".join(tail).replace(b"\n", eol)])
    assert sent == good
    assert relay.broken is not None
    assert relay.summary().text == 'say "error" x' * 50


def test_error_in_token_text_of_a_whole_stream_is_text() -> None:
    relay = Relayed("chat")
    body = b"".join(chat_chunk(w) for w in ['say "error"', "x"] * 50)
    body += chat_chunk('"error"', finish="stop") + USAGE + DONE
    assert relay_all(relay, [body]) == body
    assert relay.broken is None
    assert relay.summary().finished


def test_tool_calls_and_finished_answers_are_noticed() -> None:
    relay = Relayed("chat")
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
    relay_all(relay, [chat_chunk(None, tool_calls=[call])])
    assert relay.summary().tool_calls
    done = Relayed("chat")
    relay_all(done, [chat_chunk("x", finish="stop")])
    assert done.summary().finished


def test_move_ends_the_relay_at_the_next_boundary() -> None:
    relay = Relayed("completion")
    relay_all(relay, [b'data: {"id":"cmpl-1","choices":[{"text":"a"}]}\n\n'])
    relay.move()
    sent = relay_all(relay, [b'data: {"id":"cmpl-1","choices":[{"text":"b"}]}\n\ndata: {"id'])
    assert sent.endswith(b'"b"}]}\n\n')  # whole events go out, the partial one does not
    assert relay.broken == "moved"
    assert relay.summary().text == "ab"


def test_the_chat_continuation_adds_the_assistant_text_and_lowers_the_limits() -> None:
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    body = build(payload, "chat", "tok0 tok1 ", 2)
    assert body["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 "}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["max_tokens"] == 38
    assert payload["max_tokens"] == 40  # the original is left as it was
    own = {
        **payload,
        "messages": [*payload["messages"], {"role": "assistant", "content": "Sure: "}],
    }
    own["continue_final_message"] = True
    assert build(own, "chat", "yes", 1)["messages"][-1]["content"] == "Sure: yes"
    assert build({"prompt": "p", "max_tokens": 5}, "completion", "q", 1)["prompt"] == "pq"
    with pytest.raises(CannotContinue):
        build(payload, "chat", "x", 40)


def test_the_stitch_makes_one_stream_and_counts_usage_once() -> None:
    stitch = Stitch({"id": "chatcmpl-1", "created": 7, "model": "m-a"}, carried=10)
    role = event(
        {
            "id": "chatcmpl-2",
            "created": 9,
            "model": "m-b",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        }
    )
    token = event(
        {
            "id": "chatcmpl-2",
            "created": 9,
            "model": "m-b",
            "choices": [{"index": 0, "delta": {"content": "é"}}],
        }
    )
    usage = event(
        {
            "id": "chatcmpl-2",
            "created": 9,
            "model": "m-b",
            "choices": [],
            "usage": {"prompt_tokens": 15, "completion_tokens": 30, "total_tokens": 45},
        }
    )
    out = stitch.feed(role + token + usage + b"data: [DONE]\n\n")
    events = [e for e in out.split(b"\n\n") if e]
    assert len(events) == 3 and events[-1] == b"data: [DONE]"
    first = json.loads(events[0][6:])
    assert (first["id"], first["created"], first["model"]) == ("chatcmpl-1", 7, "m-a")
    assert first["choices"][0]["delta"]["content"] == "é"
    assert json.loads(events[1][6:])["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 40,
        "total_tokens": 45,
    }


def test_the_plan_follows_the_rule_of_the_model_and_the_request() -> None:
    cfg = MigrationConfig.model_validate({"models": {"off": {"enabled": False}}})
    migration = Migration(cfg)
    msgs = {"messages": [{"role": "user", "content": "x"}]}
    plan = migration.plan("m", "chat", msgs)
    assert isinstance(plan, Plan) and plan.max_migrations == 2 and plan.skip_openai
    assert migration.plan("off", "chat", msgs) is None
    assert migration.plan("m", "responses", msgs) is None
    assert migration.plan("m", "chat", {**msgs, "n": 3}) == "it asks for n > 1"
    assert migration.plan("m", "completion", {"prompt": ["a", "b"]}) == (
        "its prompt is not a single text"
    )
    on = Migration(MigrationConfig(enabled=True, max_migrations=3)).plan("m", "chat", msgs)
    assert isinstance(on, Plan) and not on.skip_openai and on.max_migrations == 3
