"""Token counts read from a stream's bytes equal what parsing every event as JSON gives, however
the stream is cut into chunks; the first token is found past vLLM's role-only first event."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from router.request.usage.parse import ResponseUsage


def vllm_stream(texts: list[str], chat: bool, usage: int | None, empty_finish: bool) -> list[bytes]:
    """Events shaped as vLLM sends them: role first (chat), one per token, finish, usage, DONE."""

    def event(body: dict[str, object]) -> bytes:
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "llama-8b"}
    if not chat:
        head["object"] = "text_completion"
    out = []
    if chat:
        role = {"role": "assistant", "content": ""}
        out.append(event({**head, "choices": [{"index": 0, "delta": role}]}))
    for t in texts:
        choice = {"index": 0, "delta": {"content": t}} if chat else {"index": 0, "text": t}
        out.append(event({**head, "choices": [choice]}))
    last: dict[str, object] = {"index": 0, "finish_reason": "stop"}
    if chat:
        last["delta"] = {"content": ""} if empty_finish else {}
    elif empty_finish:
        last["text"] = ""
    out.append(event({**head, "choices": [last]}))
    if usage is not None:
        counts = {"prompt_tokens": 11, "completion_tokens": usage, "total_tokens": usage + 11}
        out.append(event({**head, "choices": [], "usage": counts}))
    out.append(b"data: [DONE]\n\n")
    return out


def parsed_count(events: list[bytes], chat: bool) -> int:
    """The reference: content events from the first non-empty one on."""
    count, started = 0, False
    for e in events:
        if not e.startswith(b"data: {"):
            continue
        for choice in json.loads(e[6:])["choices"]:
            value = choice["delta"].get("content") if chat else choice.get("text")
            started = started or bool(value)
            count += started and value is not None
    return count


texts = st.lists(
    st.text(alphabet=st.sampled_from('ab "\\:{}\n\u00e9\U0001f600'), max_size=8), max_size=30
)


@settings(max_examples=300, deadline=None)
@given(
    texts=texts,
    chat=st.booleans(),
    usage=st.none() | st.integers(0, 5000),
    empty_finish=st.booleans(),
    cuts=st.lists(st.integers(1, 10_000), max_size=40),
)
def test_counts_match_parsing_every_event(
    texts: list[str], chat: bool, usage: int | None, empty_finish: bool, cuts: list[int]
) -> None:
    events = vllm_stream(texts, chat, usage, empty_finish)
    body = b"".join(events)
    points = sorted({c % len(body) for c in cuts} - {0})
    chunks = [body[a:b] for a, b in zip([0, *points], [*points, len(body)], strict=True)]
    u = ResponseUsage("chat" if chat else "completion")
    for chunk in chunks:
        u.feed(chunk)
    u.close(True)
    expected = parsed_count(events, chat)
    assert u.events == expected
    assert (u.first_token_at is not None) == any(texts)
    # Engines write whole events: the model is read from the first chunk, usage from the last two.
    if events[0] in chunks[0]:
        assert u.response_model == "llama-8b"
    if usage is not None and events[-2] in b"".join(chunks[-2:]):
        assert (u.output_tokens, u.input_tokens) == (usage, 11)
    if usage is None:
        assert u.output_tokens == (expected or None)


def test_first_token_is_the_first_content_not_the_first_byte() -> None:
    events = vllm_stream(["Hel", "lo"], True, None, False)
    u = ResponseUsage("chat")
    u.feed(events[0])  # role only
    assert u.first_token_at is None
    u.feed(events[1])
    assert u.first_token_at is not None
    for e in events[2:]:
        u.feed(e)
    u.close(True)
    assert u.output_tokens == 2


def test_non_streamed_body_reads_usage_from_its_end() -> None:
    body = json.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 9000}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46},
        }
    ).encode()
    u = ResponseUsage("chat")
    for i in range(0, len(body), 4096):
        u.keep(body[i : i + 4096])
    u.close(True)
    assert (u.output_tokens, u.input_tokens) == (34, 12)
    assert u.response_model == "gpt-4o-mini-2024-07-18"
    assert u.first_token_at is None  # no time to first token without a stream
