"""Migration end to end, the edges: the client leaving mid-migration, a tool call in flight, the
retry budget refusing, the log line and trace event, and `kind: openai` backends left out.

Real mock engines that die mid-answer (`fail_at`), a real router, the openai SDK, an OTLP
receiver. One router serves the module:
    m     a (weight 1000: picked first), b                     migration on (the default)
    oa    p (`kind: openai`, weight 1000), b                   the default: p's streams stay
    oa-on p, b                                                 `enabled: true`: they migrate
    m2    a (weight 1000), q (`kind: openai`, b's process)     no continuation goes to q
The retry budget allows one retry at a time (`min_retries: 1`, `budget_percent: 0`): a
migration's slot left behind would refuse the next one, and a slot held refuses another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

import openai
import pytest
from openai.types.chat import (
    ChatCompletionMessageParam,
)

from tests.support.harness import (
    Cluster,
    Proc,
    backend,
    control,
    expected_text,
    in_flight,
    metric,
    stats,
)
from tests.support.otlp_receiver import Receiver, Span
from tests.support.tool_call import NAMED, TOOLS
from tests.support.wait import wait_for

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me a long story"}]
SERVER = 2  # OTLP SpanKind
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
ITL_MS = 100  # the continuation's pace when the client leaves while it streams (2.8 s left)


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster, receiver: Receiver) -> dict[str, Proc]:
    mocks = {n: module_procs.mock(n, tokens=40) for n in ("a", "b", "p")}
    a, b, p = mocks["a"], mocks["b"], mocks["p"]
    pub = {"oa": "mock-model", "oa-on": "mock-model"}
    router = module_procs.router(
        {
            "backends": [
                backend("a", a, {"m": "mock-model", "m2": "mock-model"}, weight=1000),
                backend("b", b, {"m": "mock-model", **pub}),
                backend("p", p, pub, kind="openai", api_key="sk-p-0001", weight=1000),
                backend("q", b, {"m2": "mock-model"}, kind="openai", api_key="sk-q-0002"),
            ],
            "balancer": "round_robin",
            "retries": {"attempts": 1, "budget_percent": 0, "min_retries": 1},
            "outlier": {"consecutive_failures": 1000},
            "migration": {"models": {"oa-on": {"enabled": True}}},
            "tracing": {"otlp_endpoint": receiver.url},
        },
        env=FAST_EXPORT,
    )
    return {**mocks, "router": router}


@pytest.fixture(autouse=True)
def _reset(fleet: dict[str, Proc]) -> None:
    for name in ("a", "b", "p"):
        control(fleet[name], reset_stats=True, fail_at=[], hang=False, itl_ms=0)


def sdk(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0, timeout=20)


def broken_stream(router: Proc, model: str = "m", **extra: Any) -> tuple[str, str]:
    """A stream expected to end with an error event: the text before it, and the error."""
    text = ""
    with pytest.raises(openai.APIError) as caught:
        for c in sdk(router).chat.completions.create(
            model=model, messages=MSG, stream=True, max_tokens=40, **extra
        ):
            if c.choices:
                text += c.choices[0].delta.content or ""
    return text, str(caught.value)


def whole_stream(router: Proc, model: str = "m", **extra: Any) -> str:
    chunks = sdk(router).chat.completions.create(
        model=model, messages=MSG, stream=True, max_tokens=40, **extra
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def log_lines(router: Proc, msg: str, request_id: str) -> list[dict[str, Any]]:
    lines = (json.loads(x) for x in router.log().splitlines() if x.startswith("{"))
    return [x for x in lines if x.get("msg") == msg and x.get("request_id") == request_id]


async def leave_when(
    router: Proc, leave: Callable[[str], bool], request_id: str
) -> tuple[str, bool]:
    """Stream model `m` and close the connection once `leave(text so far)` holds (polled, in a
    thread: it may block): the text read, and whether the stream had ended before that."""
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    text = ""
    stream = await client.chat.completions.create(
        model="m",
        messages=MSG,
        stream=True,
        max_tokens=40,
        extra_headers={"x-request-id": request_id},
    )

    async def read() -> None:
        nonlocal text
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""

    reading = asyncio.ensure_future(read())
    while not reading.done() and not await asyncio.to_thread(leave, text):
        await asyncio.wait({reading}, timeout=0.02)
    ended = reading.done()
    reading.cancel()
    with contextlib.suppress(asyncio.CancelledError, openai.APIError):
        await reading
    await stream.close()  # the connection goes: the router sees its client leave
    await client.close()
    return text, ended


@pytest.mark.parametrize("while_", ["sent", "streaming"])
def test_the_client_leaving_mid_migration_leaves_nothing_behind(
    fleet: dict[str, Proc], while_: str
) -> None:
    router, a, b = fleet["router"], fleet["a"], fleet["b"]
    control(a, fail_at=[10])
    if while_ == "sent":  # b takes the continuation and never answers
        control(b, hang=True)

        def leave(text: str) -> bool:
            return text == expected_text(10) and stats(b)["running"] == 1

    else:  # b streams the continuation slowly; the client leaves after two of its tokens
        control(b, itl_ms=ITL_MS)

        def leave(text: str) -> bool:
            return text.startswith(expected_text(12))

    rid = f"leaver-{while_}"
    text, ended = asyncio.run(leave_when(router, leave, rid))
    assert not ended, text
    assert text.startswith(expected_text(10))
    # The continuation's upstream request goes with its client; nothing stays counted.
    wait_for(lambda: stats(b)["running"] == 0, "the continuation ended on b")
    assert stats(b)["requests"] == 1 and stats(b)["aborted"] == 1
    assert stats(a)["running"] == 0
    wait_for(lambda: in_flight(router) == 0, "the router's in-flight count back at 0")
    wait_for(lambda: bool(log_lines(router, "request", rid)), "the request's log line")
    (line,) = log_lines(router, "request", rid)
    assert line["disconnected"] is True
    # Its retry slot came back: the next migration is allowed (one slot in all).
    control(b, hang=False, itl_ms=0, reset_stats=True)
    assert whole_stream(router) == expected_text(40)
    assert stats(b)["requests"] == 1


def test_a_spent_retry_budget_refuses_migration(fleet: dict[str, Proc]) -> None:
    router, a, b = fleet["router"], fleet["a"], fleet["b"]
    before = metric(router, "sluicegate_migrations_total", model="m", result="budget")
    control(a, fail_at=[10])
    control(b, hang=True)  # the first stream's continuation holds the budget's only slot

    async def both() -> tuple[str, str]:
        refused: tuple[str, str] = ("", "")

        def second(text: str) -> bool:
            nonlocal refused
            if stats(b)["running"] < 1:
                return False
            if not refused[1]:
                refused = broken_stream(router)  # dies on a too, while the slot is held
            return True

        await leave_when(router, second, "holder")
        return refused

    text, error = asyncio.run(both())
    assert text == expected_text(10)
    assert "Not migrated: the retry budget is spent." in error
    assert stats(a)["requests"] == 2 and stats(b)["requests"] == 1  # no second continuation
    after = metric(router, "sluicegate_migrations_total", model="m", result="budget")
    assert after == before + 1
    # The slot freed (its client left), the same failure migrates again.
    wait_for(lambda: stats(b)["running"] == 0, "the held continuation ended")
    control(b, hang=False)
    assert whole_stream(router) == expected_text(40)


def test_a_tool_call_in_flight_is_not_migrated(fleet: dict[str, Proc]) -> None:
    router, a, b = fleet["router"], fleet["a"], fleet["b"]
    refused = metric(router, "sluicegate_migrations_total", model="m", result="refused")
    control(a, fail_at=[10])
    args = ""
    names = []
    with pytest.raises(openai.APIError) as caught:
        for c in sdk(router).chat.completions.create(
            model="m",
            messages=MSG,
            stream=True,
            max_tokens=40,
            tools=TOOLS,
            tool_choice=NAMED,
            extra_headers={"x-request-id": "tool-call"},
        ):
            for call in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                assert call.function is not None
                names += [call.function.name] if call.function.name else []
                args += call.function.arguments or ""
    assert names == ["get_weather"] and args == expected_text(10)  # a tool call was streaming
    assert "Not migrated: a tool call was streaming." in str(caught.value)
    assert stats(b)["requests"] == 0
    assert metric(router, "sluicegate_migrations_total", model="m", result="refused") == refused + 1
    wait_for(lambda: bool(log_lines(router, "migration", "tool-call")), "the migration line")
    (line,) = log_lines(router, "migration", "tool-call")
    assert (line["result"], line["why"], line["backend"]) == (
        "refused",
        "a tool call was streaming",
        "a",
    )


def test_a_migration_is_logged_and_traced(fleet: dict[str, Proc], receiver: Receiver) -> None:
    router, a = fleet["router"], fleet["a"]
    control(a, fail_at=[10])
    trace_id = os.urandom(16).hex()
    headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01", "x-request-id": "mig-1"}
    assert whole_stream(router, extra_headers=headers) == expected_text(40)

    wait_for(lambda: bool(log_lines(router, "request", "mig-1")), "the request's log line")
    (request,) = log_lines(router, "request", "mig-1")
    assert (request["migrations"], request["backend"], request["attempts"]) == (1, "b", 2)
    (line,) = log_lines(router, "migration", "mig-1")
    assert (line["result"], line["why"], line["backend"], line["migration"]) == (
        "ok",
        "connection",
        "a",
        1,
    )
    assert line["model"] == "m" and line["tokens_relayed"] > 0

    def server_span(spans: list[Span]) -> bool:
        return any(s.trace_id == trace_id and s.kind == SERVER for s in spans)

    spans = receiver.wait_for(server_span)
    (server,) = [s for s in spans if s.trace_id == trace_id and s.kind == SERVER]
    event = server.event("migration")
    assert event is not None, [e[0] for e in server.events]
    assert event[2] == {
        "sluicegate.backend": "a",  # the one whose stream broke
        "sluicegate.migration": 1,
        "sluicegate.migration.result": "ok",
        "sluicegate.migration.reason": "connection",
    }
    assert server.start_ns <= event[1] <= server.end_ns
    assert server.attributes["sluicegate.backend"] == "b"


def test_a_stream_from_an_openai_backend_is_not_migrated_by_default(
    fleet: dict[str, Proc],
) -> None:
    router, p, b = fleet["router"], fleet["p"], fleet["b"]
    control(p, fail_at=[10])
    text, error = broken_stream(router, "oa")
    assert text == expected_text(10)
    assert "Not migrated: its backend is a `kind: openai` provider." in error
    assert stats(p)["requests"] == 1 and stats(b)["requests"] == 0
    # `enabled: true` includes it: the same failure then migrates (to b).
    assert whole_stream(router, "oa-on") == expected_text(40)
    assert stats(p)["requests"] == 2 and stats(b)["requests"] == 1


def test_no_continuation_goes_to_an_openai_backend_by_default(fleet: dict[str, Proc]) -> None:
    router, a, b = fleet["router"], fleet["a"], fleet["b"]
    failed = metric(router, "sluicegate_migrations_total", model="m2", result="failed")
    control(a, fail_at=[10])
    text, error = broken_stream(router, "m2")
    assert text == expected_text(10)
    assert "No backend could continue it." in error
    assert stats(b)["requests"] == 0  # q, b's process behind `kind: openai`, took nothing
    assert metric(router, "sluicegate_migrations_total", model="m2", result="failed") == failed + 1
