"""A real engine killed mid-stream: its streams go on on the other engine, and the client gets
the same complete text, through one stream each, that an uninterrupted run on that engine gives.

Temperature 0 and seeded dummy weights make the engines' answers identical, so the reference is
the same request run directly on the survivor. The victim is SIGKILLed by its process group (a
crash: no shutdown), after the client has read some of each answer. One kill serves a chat and a
completions stream both on the victim: each kill costs an engine restart (about 35 s) that a
later test waits for.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster
from tests_engine.support import start_router

MESSAGES = [{"role": "user", "content": "Tell the story of a router that never drops a stream"}]
PROMPT = "A long answer, token after token, from an engine that may die:"
# About 3 s of generation on a quiet machine (slower on a loaded one, where the client is slower
# too): the kill after the first few chunks lands mid-answer even when the client lags the
# router by hundreds of buffered chunks (400 tokens once finished before a starved client had
# read 24 of them).
MAX_TOKENS = 1200
READ_BEFORE_KILL = 8


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def _text(chunks: list[Any], chat: bool) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _create(client: openai.OpenAI, model: str, chat: bool, raw: bool = False) -> Any:
    extra: dict[str, Any] = {
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    if chat:
        api: Any = client.chat.completions
        args: dict[str, Any] = {"model": model, "messages": MESSAGES, **extra}
    else:
        api = client.completions
        args = {"model": model, "prompt": PROMPT, **extra}
    return (api.with_raw_response if raw else api).create(**args)


def _on(stream: Any) -> str:
    return str(stream.headers["x-sluicegate-backend"])


def test_a_killed_engines_chat_and_completion_streams_finish_on_the_other_with_the_same_text(
    fleet: Fleet, procs: Cluster
) -> None:
    router = start_router(procs, fleet, {"balancer": "round_robin"})
    model = fleet.engines[0].model
    client = sdk(router.url)
    chat = _create(client, model, chat=True, raw=True)
    victim_name = _on(chat)
    # round_robin alternates: the completion stream that lands on the chat's engine is kept, one
    # that lands on the other is closed (the engine aborts it) and asked again.
    for _ in range(len(fleet.engines)):
        completion = _create(client, model, chat=False, raw=True)
        if _on(completion) == victim_name:
            break
        completion.http_response.close()
    assert _on(completion) == victim_name
    victim = next(e for e in fleet.engines if f"engine-{e.index}" == victim_name)
    survivor = next(e for e in fleet.engines if e is not victim)
    streams = {True: chat.parse(), False: completion.parse()}
    chunks: dict[bool, list[Any]] = {True: [], False: []}
    try:
        for is_chat, stream in streams.items():  # some of each before the kill
            for chunk in stream:
                chunks[is_chat].append(chunk)
                if len(chunks[is_chat]) == READ_BEFORE_KILL:
                    break
        victim.kill()  # SIGKILL to its process group, mid-answer
        for is_chat, stream in streams.items():
            chunks[is_chat].extend(stream)
        references = {c: list(_create(sdk(survivor.url), model, c)) for c in streams}
    finally:
        victim.restart(wait=False)  # the fleet fixture waits for it before the next test
    for is_chat in streams:
        got, reference = chunks[is_chat], references[is_chat]
        assert 0 < len(got) - READ_BEFORE_KILL, ("the stream ended before the kill", is_chat)
        assert _text(got, is_chat) == _text(reference, is_chat), is_chat
        assert len({(c.id, c.created, c.model) for c in got}) == 1  # one stream
        usage, expected = got[-1].usage, reference[-1].usage
        assert usage is not None and expected is not None
        assert usage.completion_tokens == expected.completion_tokens == MAX_TOKENS
        assert usage.prompt_tokens == expected.prompt_tokens  # the prompt counted once
    page = httpx.get(router.url + "/metrics", timeout=10).text
    migrated = [
        s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == "sluicegate_migrations_total" and s.labels == {"model": model, "result": "ok"}
    ]
    assert migrated == [2.0], migrated
