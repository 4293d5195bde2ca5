"""What the client reads through the router is what the engine itself answers (temperature 0).

The dummy weights are seeded, so two engines, or one engine twice, give the same text for the
same prompt: the engine's own answer is the reference.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from router.tools.enginefleet.fleet import Engine, Fleet
from tests.support.harness import Cluster
from tests_engine.support import start_router

PROMPT = "The router streams every token the engine generates, in order"
MESSAGES = [{"role": "user", "content": PROMPT}]
MAX_TOKENS = 48


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat_stream(c: openai.OpenAI, model: str, **extra: Any) -> tuple[list[str], str | None]:
    deltas: list[str] = []
    finish = None
    for chunk in c.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        **extra,
    ):
        for choice in chunk.choices:
            deltas.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return deltas, finish


def completion_stream(c: openai.OpenAI, model: str) -> tuple[list[str], str | None]:
    deltas: list[str] = []
    finish = None
    for chunk in c.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            deltas.append(choice.text)
            finish = choice.finish_reason or finish
    return deltas, finish


def numbers(usage: Any) -> tuple[int, int, int | None]:
    """The counts in a usage object (vLLM's streamed usage lacks the body's null fields)."""
    details = usage.prompt_tokens_details
    return usage.prompt_tokens, usage.completion_tokens, details.cached_tokens if details else None


@pytest.fixture
def pair(fleet: Fleet, procs: Cluster) -> tuple[Engine, openai.OpenAI, openai.OpenAI]:
    engine = fleet.engines[0]
    router = start_router(procs, fleet, engines=[engine])
    return engine, client(engine.url), client(router.url)


def test_whole_body_text_equals_the_engines_own(
    pair: tuple[Engine, openai.OpenAI, openai.OpenAI],
) -> None:
    engine, direct, routed = pair
    chat = [
        c.chat.completions.create(
            model=engine.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        for c in (direct, routed)
    ]
    assert chat[0].choices[0].message.content
    assert chat[1].choices[0].message.content == chat[0].choices[0].message.content
    assert chat[1].choices[0].finish_reason == chat[0].choices[0].finish_reason
    assert chat[1].usage == chat[0].usage
    text = [
        c.completions.create(
            model=engine.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        for c in (direct, routed)
    ]
    assert text[0].choices[0].text
    assert text[1].choices[0].text == text[0].choices[0].text
    assert text[1].usage == text[0].usage


def test_streamed_text_equals_the_engines_own_chunk_for_chunk(
    pair: tuple[Engine, openai.OpenAI, openai.OpenAI],
) -> None:
    engine, direct, routed = pair
    whole = direct.chat.completions.create(
        model=engine.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    mine, finish = chat_stream(direct, engine.model)
    theirs, routed_finish = chat_stream(routed, engine.model)
    # Not the same events: a busy engine puts the tokens of several steps in one event when its
    # output loop falls behind (seen here: 'ablene Streamablene' in one delta), so where the
    # events split varies from run to run, through the router or not. The text may not.
    assert "".join(theirs) == "".join(mine) == whole.choices[0].message.content
    assert routed_finish == finish == whole.choices[0].finish_reason
    # The client asked for usage: it gets the engine's, in the stream.
    usage_chunks = [
        chunk.usage
        for chunk in routed.chat.completions.create(
            model=engine.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        if chunk.usage is not None
    ]
    assert [numbers(u) for u in usage_chunks] == [numbers(whole.usage)]
    mine_text, finish = completion_stream(direct, engine.model)
    theirs_text, routed_finish = completion_stream(routed, engine.model)
    assert "".join(theirs_text) == "".join(mine_text) != ""
    assert routed_finish == finish
