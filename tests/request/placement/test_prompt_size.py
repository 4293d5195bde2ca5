"""A prompt's size as the tokenizer guards see it (issue 46, case 11): a content given as a list
of parts (`[{"type": "text", "text": ...}]`) counts its text, as a string content does, so a
long one is tokenized off the event loop (`via: router`) and not sent whole to an engine's
`/tokenize`, twice (`via: engine`). The engine side is a mock engine on loopback."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from router.request.placement.affinity import RequestAffinity
from router.request.placement.tokens import (
    OTHER_PART,
    RouterTokenizer,
    prompt_chars,
    request_tokens,
)
from tests.support.harness import Cluster
from tests.support.kv_affinity import engine_affinity, engine_backend
from tests.support.tiny_tokenizer import write_tokenizer

LONG = "All work and no play makes Jack a dull boy. " * 3000  # 132,000 characters


def parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


def chat(system: Any, user: Any = "hi") -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def test_list_form_text_counts_as_the_string_form_does() -> None:
    assert prompt_chars(chat(parts(LONG))) == prompt_chars(chat(LONG)) == len(LONG) + 2
    assert prompt_chars(chat(parts("ab", "cde"), ["fg"])) == 7
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert prompt_chars(chat([image, *parts("abc")])) == OTHER_PART + 3 + 2
    calls = {
        "role": "assistant",
        "content": None,
        "reasoning": "r" * 10,
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "x" * 50}}],
    }
    assert prompt_chars({"messages": [calls]}) == 60
    assert prompt_chars({"prompt": ["ab", "cde", [1, 2]]}) == 7  # a completions batch
    assert prompt_chars({"prompt": [1, 2, 3]}) == 3
    assert prompt_chars({"prompt": "abcd"}) == 4


def test_a_long_list_form_prompt_is_tokenized_off_the_event_loop(tmp_path: Path) -> None:
    tk = RouterTokenizer(str(write_tokenizer(tmp_path)))
    threads: list[int] = []
    real = tk.tokens

    def tokens(payload: dict[str, Any], limit: int = 1 << 24) -> list[int] | None:
        threads.append(threading.get_ident())
        return real(payload, limit)

    tk.tokens = tokens  # type: ignore[method-assign]

    async def go() -> int:
        loop_thread = threading.get_ident()
        for payload in (chat(LONG), chat(parts(LONG))):
            ids = await request_tokens(tk, payload, 8192, 1 << 24)
            assert ids
        short = await request_tokens(tk, chat(parts("short")), 8192, 1 << 24)
        assert short
        return loop_thread

    loop_thread = asyncio.run(go())
    string_form, list_form, short = threads
    assert string_form != loop_thread
    assert list_form != loop_thread, "a 132k-character list-form prompt was tokenized inline"
    assert short == loop_thread  # a short one stays inline (no thread hop)


def test_a_long_list_form_prompt_is_not_sent_to_the_engines_tokenize(procs: Cluster) -> None:
    mock = procs.mock("tk")
    b = engine_backend("b", mock.url)
    affinity = engine_affinity([b], live=["b"])
    tk = affinity._tokenizers["m"]
    pools = tk._pools  # type: ignore[union-attr]
    sent: list[int] = []
    real = pools.request

    def request(backend: Any, path: str, headers: Any, data: bytes) -> Any:
        if path == "/tokenize":
            sent.append(len(data))
        return real(backend, path, headers, data)

    pools.request = request  # type: ignore[method-assign]
    limit = affinity.config.max_prefix_chars
    assert len(LONG) > limit

    async def ask(payload: dict[str, Any]) -> RequestAffinity:
        return await affinity.with_tokens(RequestAffinity([], None), "m", payload, [b])

    async def go() -> None:
        for payload in (chat(LONG), chat(parts(LONG)), chat(parts("x" * 40), parts(LONG))):
            got = await ask(payload)
            assert got.tokens is None  # past the bound: routed on the approximate index
        # Only the short system prompt alone went (for the memo), never the long text.
        assert sum(sent) < 1000, f"{len(sent)} /tokenize calls carried {sum(sent)} bytes"
        # A short list-form prompt still is tokenized by the engine, as a string one is.
        got = await ask(chat(parts("You are terse."), parts("hi")))
        assert got.tokens and sent

    asyncio.run(go())
