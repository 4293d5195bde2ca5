"""`via: engine`'s memo of what a chat prompt's earlier messages tokenize to (router/request/
token_memo.py): its key, what it keeps of two answers, and its bounds."""

from __future__ import annotations

from typing import Any

from router.request import token_memo
from router.request.token_memo import (
    MARGIN,
    MIN_IDS,
    RELEARN,
    TURN_IDS,
    TokenMemo,
    earlier,
    memo_key,
    rest_estimate,
    shared_ids,
)


def chat(*contents: str, **extra: Any) -> dict[str, Any]:
    roles = ["system", *(["user", "assistant"] * len(contents))]
    return {
        "messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)],
        **extra,
    }


def test_the_key_is_what_renders_the_earlier_messages() -> None:
    first = memo_key("m", chat("You are terse.", "hi"))
    assert first is not None
    assert memo_key("m", chat("You are terse.", "something else entirely")) == first
    assert memo_key("other", chat("You are terse.", "hi")) != first
    assert memo_key("m", chat("You are verbose.", "hi")) != first
    assert memo_key("m", chat("You are terse.", "hi", tools=[{"type": "function"}])) != first
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert memo_key("m", chat("You are terse.", "hi", **kwargs)) != first
    # Nothing before the last message, or the last one continued (its blocks may be held).
    assert memo_key("m", chat("only a system prompt")) is None
    assert memo_key("m", chat("s", "hi", continue_final_message=True)) is None
    assert memo_key("m", chat("s", "hi", add_generation_prompt=False)) is None
    assert memo_key("m", {"prompt": "a completion"}) is None


def test_the_earlier_messages_alone_and_the_rest_of_the_length() -> None:
    payload = chat("s", "x" * 400, continue_final_message=False)
    alone = earlier(payload)
    assert alone["messages"] == payload["messages"][:1]
    assert alone["add_generation_prompt"] is False and "continue_final_message" not in alone
    assert payload["messages"][1]["content"] == "x" * 400  # the request's own body untouched
    assert rest_estimate(payload) == 100 + MARGIN + TURN_IDS


def test_what_is_kept_stops_margin_ids_before_the_answers_part() -> None:
    whole = [*range(200), 7, 7, 7]
    alone = [*range(200), 9]
    assert shared_ids(whole, alone) == list(range(200 - MARGIN))
    assert shared_ids(whole, [99, *alone]) == []  # parted at once: nothing
    assert shared_ids(list(range(10)), list(range(10))) == []  # within the margin


def test_memo_keeps_learns_again_and_is_bounded() -> None:
    memo = TokenMemo(max_ids=3 * MIN_IDS)
    ids = list(range(MIN_IDS))
    assert memo.known(b"a") is None  # never seen: learn it
    memo.learn(b"a", ids)
    assert memo.known(b"a") == ids
    # Too few ids, or no answer: the key takes the round trip, and is learned again later.
    memo.learn(b"short", ids[:-1])
    memo.learn(b"none", None)
    for _ in range(RELEARN - 1):
        assert memo.known(b"short") == [] and memo.known(b"none") == []
    assert memo.known(b"short") is None and memo.known(b"none") is None
    # Bounded by ids, least recently used out first.
    memo.learn(b"b", ids)
    memo.learn(b"c", ids)
    assert memo.known(b"a") == ids  # used: now the newest
    memo.learn(b"d", ids)
    assert memo.known(b"b") is None and memo.known(b"a") == ids
    assert memo.known(b"c") == ids and memo.known(b"d") == ids


def test_memo_is_bounded_in_keys(monkeypatch: Any) -> None:
    monkeypatch.setattr(token_memo, "MAX_KEYS", 4)
    memo = TokenMemo()
    for i in range(10):
        memo.learn(bytes([i]), None)
    assert len(memo) == 4 and memo.known(bytes([9])) == []
