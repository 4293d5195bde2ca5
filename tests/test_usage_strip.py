"""The usage event sluicegate asked for is taken out of a stream however the stream is cut into
chunks, leaving every other byte as the engine sent it; the request body gains include_usage."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from router.request.usage_stream import USAGE_OBJECT, UsageStrip, inject, needs_injection


def event(body: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def stream(texts: list[str], openai_nulls: bool, crlf: bool) -> tuple[bytes, bytes]:
    """(what the engine sends with include_usage, what it sends without)."""
    head: dict[str, object] = {"id": "c", "object": "chat.completion.chunk", "model": "m"}
    with_usage, without = [], []
    for t in texts:
        e = {**head, "choices": [{"index": 0, "delta": {"content": t}}]}
        without.append(event(e))
        with_usage.append(event({**e, "usage": None} if openai_nulls else e))
    usage = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2}
    with_usage.append(event({**head, "choices": [], "usage": usage}))
    done = b"data: [DONE]\n\n"
    a, b = b"".join(with_usage) + done, b"".join(without) + done
    if crlf:
        a, b = a.replace(b"\n", b"\r\n"), b.replace(b"\n", b"\r\n")
    return a, b


texts = st.lists(st.text(alphabet=st.sampled_from('ab "\\:{}[]\n\u00e9'), max_size=6), max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    texts=texts,
    openai_nulls=st.booleans(),
    crlf=st.booleans(),
    cuts=st.lists(st.integers(1, 10_000), max_size=30),
)
def test_client_gets_the_stream_it_would_have_got(
    texts: list[str], openai_nulls: bool, crlf: bool, cuts: list[int]
) -> None:
    sent, expected = stream(texts, openai_nulls, crlf)
    points = sorted({c % len(sent) for c in cuts} - {0})
    chunks = [sent[a:b] for a, b in zip([0, *points], [*points, len(sent)], strict=True)]
    strip = UsageStrip(strip_nulls=openai_nulls)
    out = b"".join(strip.feed(c) for c in chunks) + strip.flush()
    assert out == expected
    assert strip.stripped
    # The relay skips `feed` for chunks its inline test passes: the same bytes result.
    strip = UsageStrip(strip_nulls=openai_nulls)
    relayed = []
    for c in chunks:
        skip = not strip.slow and c[-2:] == b"\n\n" and c.rfind(USAGE_OBJECT) < 0
        relayed.append(c if skip else strip.feed(c))
    assert b"".join(relayed) + strip.flush() == expected
    assert strip.stripped


def test_usage_in_an_event_with_choices_is_left_alone() -> None:
    # vLLM's continuous usage: every chunk carries usage; none is the usage-only event.
    body = event({"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 1}})
    strip = UsageStrip(strip_nulls=False)
    assert strip.feed(body) == body
    assert not strip.stripped


def test_a_stream_ending_inside_an_event_is_flushed_whole() -> None:
    strip = UsageStrip(strip_nulls=False)
    assert strip.feed(b'data: {"choices":[{"delta"') == b""
    assert strip.flush() == b'data: {"choices":[{"delta"'


def test_the_body_gains_include_usage_and_keeps_the_rest() -> None:
    body = b'{"model":"m","stream":true,"messages":[]} \n'
    payload = json.loads(body)
    assert needs_injection(payload)
    injected = inject(body, payload)
    assert injected.startswith(b'{"model":"m","stream":true,"messages":[]')
    assert json.loads(injected)["stream_options"] == {"include_usage": True}
    # Other stream options stay.
    payload = {"model": "m", "stream": True, "stream_options": {"include_usage": False, "x": 1}}
    again = json.loads(inject(json.dumps(payload).encode(), payload))
    assert again["stream_options"] == {"include_usage": True, "x": 1}
    # Continuous usage: vLLM and SGLang differ on what include_usage then changes; untouched.
    assert not needs_injection({"stream_options": {"continuous_usage_stats": True}})
    assert not needs_injection({"stream_options": {"include_usage": True}})
    assert not needs_injection({"stream_options": {"include_usage": "true"}})
    assert not needs_injection({"stream_options": "bad"})  # the backend's 400 stays its own
    assert needs_injection({"stream_options": None})
    assert needs_injection({"stream_options": {"include_usage": False}})
