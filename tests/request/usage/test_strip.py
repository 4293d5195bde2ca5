"""The usage event sluicegate asked for is taken out of a stream however the stream is cut into
chunks, leaving every other byte as the engine sent it; the request body gains include_usage."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from router.request.usage.strip import (
    MAX_HELD,
    USAGE_OBJECT,
    UsageStrip,
    inject,
    needs_injection,
)


def event(body: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def stream(texts: list[str], openai_nulls: bool, line_end: str) -> tuple[bytes, bytes]:
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
    if line_end != "\n":
        a, b = a.replace(b"\n", line_end.encode()), b.replace(b"\n", line_end.encode())
    return a, b


texts = st.lists(st.text(alphabet=st.sampled_from('ab "\\:{}[]\n\u00e9'), max_size=6), max_size=20)


@settings(max_examples=300, deadline=None)
@given(
    texts=texts,
    openai_nulls=st.booleans(),
    line_end=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(1, 10_000), max_size=30),
)
def test_client_gets_the_stream_it_would_have_got(
    texts: list[str], openai_nulls: bool, line_end: str, cuts: list[int]
) -> None:
    """Any framing SSE allows (LF, CRLF, CR-only line ends), cut anywhere."""
    sent, expected = stream(texts, openai_nulls, line_end)
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


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_cr_only_line_ends_are_not_held_to_the_end() -> None:
    """Issue 22, defect 10: CR-only framing held the whole stream, then leaked the usage."""
    sent, expected = stream(["a", "b", "c"], False, "\r")
    events = sent.split(b"\r\r")
    strip = UsageStrip(strip_nulls=False)
    # A whole event passes as soon as the next one starts (a LF may still follow its last CR).
    first = strip.feed(events[0] + b"\r\r") + strip.feed(events[1][:1])
    assert first == events[0] + b"\r\r"
    rest = strip.feed(events[1][1:] + b"\r\r")
    rest += b"".join(strip.feed(e + b"\r\r") for e in events[2:-1]) + strip.flush()
    assert first + rest == expected and strip.stripped


def test_a_usage_event_after_an_event_over_64_kib_is_still_taken_out() -> None:
    big = event({"choices": [{"delta": {"content": "x" * 100_000}}]})
    usage = event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    done = b"data: [DONE]\n\n"
    for size in (1000, 4096, 65536, 70_000, 300_000):
        strip = UsageStrip(strip_nulls=False)
        out = b"".join(strip.feed(p) for p in pieces(big + usage + done, size)) + strip.flush()
        assert out == big + done, size
        assert strip.stripped and strip.held == 0


def test_the_usage_only_event_is_found_behind_another_holding_a_usage_object() -> None:
    """Events are parsed, not matched on the first `"usage":{`: a content event carrying a
    usage object in the same read does not hide the usage-only event behind it."""
    content = event({"choices": [{"delta": {"content": "x"}}], "usage": {"prompt_tokens": 1}})
    usage = event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    done = b"data: [DONE]\n\n"
    strip = UsageStrip(strip_nulls=False)
    assert strip.feed(content + usage + done) == content + done
    assert strip.stripped


def test_an_endless_usage_event_is_relayed_not_held() -> None:
    """Issue 22, defect 8: a 16 MB `"usage":{` event in 4 KB pieces was held whole (and each
    piece re-scanned what was held). Now at most MAX_HELD is held; the rest is relayed as it
    comes, and stripping resumes after the long event ends."""
    endless = b'data: {"choices":[],"usage":{"x":"' + b"y" * (16 * 1024 * 1024)
    strip = UsageStrip(strip_nulls=False)
    relayed = 0
    most_held = 0
    for piece in pieces(endless, 4096):
        relayed += len(strip.feed(piece))
        most_held = max(most_held, strip.held)
    assert most_held <= MAX_HELD
    assert relayed == len(endless)  # nothing is held back once the event is known to be long
    usage = event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    tail = b'"}}\n\n' + usage + b"data: [DONE]\n\n"
    assert strip.feed(tail) == b'"}}\n\n' + b"data: [DONE]\n\n"
    assert strip.stripped


FP = ',"system_fingerprint":"vllm-0.32.0"'


def vllm_stream(line_end: str) -> tuple[bytes, bytes]:
    """(vLLM's stream with include_usage, without): the fingerprint on the usage event in the
    first, on the last token's event (the finish reason's) in the second."""
    head = 'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":['
    mid = head + '{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]}\n\n'
    last = head + '{"index":0,"delta":{"content":"b"},"logprobs":null,"finish_reason":"length"}]'
    usage = head + '],"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}'
    done = "data: [DONE]\n\n"
    with_usage = mid + last + "}\n\n" + usage + FP + "}\n\n" + done
    without = mid + last + FP + "}\n\n" + done
    return (
        with_usage.replace("\n", line_end).encode(),
        without.replace("\n", line_end).encode(),
    )


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["\n", "\r\n", "\r"]), st.data())
def test_the_usage_events_fingerprint_goes_back_on_the_finish_event(
    line_end: str, data: st.DataObject
) -> None:
    sent, want = vllm_stream(line_end)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(sent)), max_size=6)))
    strip = UsageStrip(strip_nulls=False)
    out = b""
    for a, b in zip([0, *cuts], [*cuts, len(sent)], strict=True):
        out += strip.feed(sent[a:b])
    out += strip.flush()
    assert out == want and strip.stripped


def test_a_finish_event_with_its_own_fingerprint_is_untouched() -> None:
    sent, _ = vllm_stream("\n")
    # OpenAI's shape: every chunk has its fingerprint (and `"usage":null`).
    sent = sent.replace(
        b'"finish_reason":"length"}]}', b'"finish_reason":"length"}]' + FP.encode() + b"}"
    )
    strip = UsageStrip(strip_nulls=False)
    out = strip.feed(sent) + strip.flush()
    assert out.count(b"system_fingerprint") == 1 and b'"usage":{' not in out


def test_a_held_finish_event_is_sent_when_the_stream_ends_without_usage() -> None:
    _, plain = vllm_stream("\n")
    strip = UsageStrip(strip_nulls=False)
    body = plain.replace(FP.encode(), b"")
    finish_end = body.index(b"data: [DONE]")
    out = strip.feed(body[:finish_end])
    assert not out.endswith(b'"length"}]}\n\n')  # the finish event waits for the next one
    out += strip.feed(body[finish_end:]) + strip.flush()
    assert out == body and not strip.stripped
