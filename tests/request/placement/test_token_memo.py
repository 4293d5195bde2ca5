"""`via: engine`'s memo of what a chat prompt's earlier messages tokenize to (router/request/
token_memo.py): its key, what it keeps of two answers, and its bounds."""

from __future__ import annotations

from typing import Any

from router.request.placement import token_memo
from router.request.placement.token_memo import (
    MARGIN,
    MIN_IDS,
    RELEARN,
    TURN_IDS,
    TokenMemo,
    earlier,
    memo_key,
    rest_estimate,
    shared_ids,
    shared_prefix,
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
    # Earlier messages longer than the router would tokenize: not dumped and hashed either.
    assert memo_key("m", chat("x" * 100, "hi"), max_chars=99) is None
    assert memo_key("m", chat("x" * 100, "hi"), max_chars=100) is not None


def test_one_earlier_message_is_a_shared_prefix_more_are_a_conversation() -> None:
    assert shared_prefix(chat("You are terse.", "hi"))
    assert not shared_prefix(chat("You are terse.", "hi", "Hello.", "and now?"))


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


def test_a_key_is_learned_on_its_second_sight_and_kept() -> None:
    memo = TokenMemo()
    ids = list(range(MIN_IDS))
    # First sight: nothing to learn yet (a new turn's earlier messages may never come again).
    assert memo.look(b"a") == (None, False)
    assert memo.look(b"a") == (None, True)  # second: learn
    memo.learn(b"a", ids)
    assert memo.look(b"a") == (ids, False)
    assert memo.look(b"a") == (ids, False)
    # A system prompt alone before the last message (many users share it): its first sight.
    assert memo.look(b"system", eager=True) == (None, True)


def test_nothing_worth_keeping_is_learned_again_later() -> None:
    memo = TokenMemo()
    for key, got in ((b"short", list(range(MIN_IDS - 1))), (b"none", None)):
        memo.look(key)
        memo.look(key)
        memo.learn(key, got)
        for _ in range(RELEARN):
            assert memo.look(key) == (None, False)  # the round trip, nothing learned
        assert memo.look(key) == (None, False)  # forgotten: a first sight again
        assert memo.look(key) == (None, True)


def test_memo_is_bounded_in_ids_least_recently_used_out() -> None:
    memo = TokenMemo(max_ids=3 * MIN_IDS)
    ids = list(range(MIN_IDS))
    for key in (b"a", b"b", b"c"):
        memo.learn(key, ids)
    assert memo.look(b"a") == (ids, False)  # used: now the newest
    memo.learn(b"d", ids)
    assert memo.look(b"b") == (None, False)  # the least recently used went out
    assert all(memo.look(k) == (ids, False) for k in (b"a", b"c", b"d"))


def test_memo_is_bounded_in_keys(monkeypatch: Any) -> None:
    monkeypatch.setattr(token_memo, "MAX_KEYS", 4)
    memo = TokenMemo()
    for i in range(10):
        memo.look(bytes([i]))
    assert len(memo) == 4 and memo.look(bytes([9])) == (None, True)
    assert memo.look(bytes([0])) == (None, False)  # gone: a first sight again


def test_a_failed_request_leaves_no_question_running() -> None:
    """The earlier messages are asked beside the whole prompt: when the request's own question
    fails (or the request is cancelled), the other is cancelled, not left to its timeout."""
    import asyncio

    from router.request.placement.affinity import RequestAffinity
    from tests.support.kv_affinity import engine_affinity, engine_backend

    up = engine_backend("up", "http://127.0.0.1:9")
    affinity = engine_affinity([up], live=["up"])
    ended: list[str] = []

    async def tokens(body: dict[str, Any], *args: Any) -> list[int] | None:
        if body.get("add_generation_prompt") is False:  # the earlier messages alone: slow
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise
            return None
        await asyncio.sleep(0.01)
        raise RuntimeError("a fault tokens() does not expect")

    affinity._tokenizers["m"].tokens = tokens  # type: ignore[method-assign]

    async def go() -> None:
        async with asyncio.timeout(5):
            try:
                await affinity.with_tokens(RequestAffinity([], None), "m", chat("s", "hi"), [up])
            except RuntimeError:
                pass
            await asyncio.sleep(0)  # the cancel lands
        assert ended == ["cancelled"]
        assert asyncio.all_tasks() == {asyncio.current_task()}  # nothing else runs

    asyncio.run(go())
