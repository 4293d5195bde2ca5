"""The migration relay frames events by every line end SSE allows (LF, CRLF, lone CR).

Issue 46, case 12: with CR-only framing (`\\r` line ends, `\\r\\r` between events) a stream
relayed with migration on reached the client with the usage event sluicegate asked for, and
without `[DONE]`: the relay held each event ending in CR (a LF might follow) and never let the
last one go. Real mock engines writing each framing (`line_end`), a real router, raw httpx for
the bytes and the openai SDK for a stream that breaks and goes on elsewhere.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from router.request.migration.relay import Relayed
from tests.support.harness import Cluster, Proc, backend, control, expected_text, stats

LINE_ENDS = ["\n", "\r\n", "\r"]
TOKENS = 12
BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "tell me a story"}],
    "stream": True,
    "max_tokens": TOKENS,
}


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    mocks = {n: module_procs.mock(n, tokens=TOKENS) for n in ("a", "b")}
    router = module_procs.router(
        {
            "backends": [
                backend(n, m, {"m": "mock-model", "off": "mock-model"}) for n, m in mocks.items()
            ],
            "balancer": "round_robin",
            "retries": {"attempts": 1},
            "outlier": {"consecutive_failures": 1000},
            "migration": {"models": {"off": {"enabled": False}}},
        }
    )
    return {**mocks, "router": router}


def raw_stream(router: Proc, model: str, request_id: str) -> bytes:
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        json={**BODY, "model": model},
        headers={"x-request-id": request_id},
        timeout=20,
    ) as r:
        assert r.status_code == 200
        return r.read()


@pytest.mark.parametrize("line_end", LINE_ENDS, ids=["lf", "crlf", "cr"])
def test_the_relay_is_byte_exact_with_migration_off_in_every_framing(
    fleet: dict[str, Proc], line_end: str
) -> None:
    for name in ("a", "b"):
        control(fleet[name], line_end=line_end, fail_at=[])
    try:
        # The same request id on both: the mock names the stream by it (id, created: 0).
        off = raw_stream(fleet["router"], "off", "framing-1")
        on = raw_stream(fleet["router"], "m", "framing-1")
    finally:
        for name in ("a", "b"):
            control(fleet[name], line_end="\n")
    eol = line_end.encode()
    assert off.endswith(b"data: [DONE]" + eol + eol)
    assert b'"usage":{' not in off  # the injected usage event is taken out
    assert on == off


def test_a_cr_framed_stream_that_breaks_goes_on_whole(fleet: dict[str, Proc]) -> None:
    for name in ("a", "b"):
        control(fleet[name], line_end="\r", fail_at=[5], reset_stats=True)
    try:
        client = openai.OpenAI(
            base_url=fleet["router"].url + "/v1", api_key="k", max_retries=0, timeout=20
        )
        chunks = list(
            client.chat.completions.create(
                model="m", messages=BODY["messages"], stream=True, max_tokens=TOKENS
            )
        )
    finally:
        for name in ("a", "b"):
            control(fleet[name], line_end="\n", fail_at=[])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(TOKENS)
    assert not any(c.usage for c in chunks)  # the client did not ask for usage
    assert stats(fleet["a"])["requests"] + stats(fleet["b"])["requests"] == 2


def test_an_event_ended_by_a_blank_line_of_cr_is_relayed_at_once() -> None:
    relay = Relayed("chat")
    event = b'data: {"choices":[{"delta":{"content":"x"}}]}\r\r'
    done = b"data: [DONE]\r\r"
    assert relay.feed(event) == event
    assert not relay.slow
    assert relay.feed(done) == done
    # CRLF framing cut inside a blank line: its CR ends the event; the LF passes with the next.
    relay = Relayed("chat")
    assert relay.feed(b"data: x\r\n\r") == b"data: x\r\n\r"
    assert relay.feed(b"\ndata: y\r\n\r\n") == b"\ndata: y\r\n\r\n"


def test_what_is_held_when_the_stream_ends_is_released() -> None:
    relay = Relayed("chat")
    assert relay.feed(b"data: [DONE]") == b""  # no blank line: the event may go on
    assert relay.slow
    assert relay.flush() == b"data: [DONE]"
    assert relay.flush() == b""
