"""`via: engine`: the token ids a chat prompt's earlier messages render to, remembered, so that a
request whose earlier messages were seen before costs no `/tokenize` round trip.

A chat prompt's blocks that an engine can hold are those of the messages before the last (the
system prompt, the conversation so far): the last message is new. So the memo is keyed by
everything that renders those (the model, the messages before the last, the tools and the
template's arguments) and holds the ids they render to within the whole prompt. A request
that learns a key asks the engine for the whole prompt and, at the same time, for the earlier
messages alone (`add_generation_prompt: false`); where the two answers part, less MARGIN ids (a
tokenizer may merge across that boundary as it does not alone), is what every later prompt of
the key begins with. One earlier message (a system prompt, which many users share) is learned
by its first request; more (a conversation so far) by its second: a conversation's next turn
never sends the same earlier messages again, and a first sight then costs one round trip, as
without the memo. A later request takes those ids and an estimate of the rest of its length
(its last message's characters / CHARS_PER_TOKEN, plus MARGIN and TURN_IDS), and is routed on
the blocks of the earlier messages only, which is all an engine can hold of it.
Fewer than MIN_IDS learned (a template that renders the earlier messages otherwise when alone,
or an engine that refused them) leaves the key to the round trip for RELEARN requests. Bounded
by MAX_IDS ids and MAX_KEYS keys, the least recently used out first. A key costs one JSON dump
and one blake2b of the earlier messages per request: 23 us for a 6 kB system prompt, 0.14 us
to look up (`timeit`, 2026-12-05), against the 1-5 ms of a `/tokenize` round trip.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

from router.request.placement.tokens import prompt_chars

MAX_IDS = 1_000_000  # ids over all keys: ~8-40 MB
MARGIN = 16  # ids before where the two answers part that are not trusted
MIN_IDS = 64  # fewer learned: not worth keeping (routing works in blocks of 16-128)
MAX_KEYS = 16_384  # keys, also those seen once or with nothing kept: ~3 MB
RELEARN = 64  # requests of a key with nothing kept before it is learned again
CHARS_PER_TOKEN = 4  # the rest of a prompt's length, estimated from its characters
TURN_IDS = 8  # and a turn's role header and the generation prompt, in ids
# What a chat template reads beside the messages (vLLM's chat request fields).
_RENDER_KEYS = ("tools", "chat_template", "chat_template_kwargs", "documents")


def shared_prefix(payload: dict[str, Any]) -> bool:
    """One message before the last: a system prompt (or a first instruction) many share."""
    return len(payload["messages"]) == 2


def memo_key(model: str, payload: dict[str, Any], max_chars: int = 1 << 24) -> bytes | None:
    """What renders the earlier messages of `payload` (None: not a chat of two messages or more,
    earlier messages of more than `max_chars` characters of text, or not JSON)."""
    messages = payload.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return None
    if prompt_chars({"messages": messages[:-1]}) > max_chars:
        return None  # not tokenized either (router/request/placement/tokens.py EngineTokenizer)
    if payload.get("continue_final_message") or payload.get("add_generation_prompt") is False:
        return None  # the last message is continued, not new: its blocks may be held
    parts = [model, messages[:-1], *(payload.get(k) for k in _RENDER_KEYS)]
    try:
        data = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def earlier(payload: dict[str, Any]) -> dict[str, Any]:
    """`payload`'s earlier messages as a prompt of their own, for the engine to tokenize."""
    out = {k: v for k, v in payload.items() if k != "continue_final_message"}
    out["messages"] = payload["messages"][:-1]
    out["add_generation_prompt"] = False
    return out


def rest_estimate(payload: dict[str, Any]) -> int:
    """Ids a prompt has beyond its earlier messages' (an estimate: its last message's)."""
    chars = prompt_chars({"messages": payload["messages"][-1:]})
    return chars // CHARS_PER_TOKEN + MARGIN + TURN_IDS


def shared_ids(whole: list[int], alone: list[int]) -> list[int]:
    """The ids of the earlier messages within the whole prompt: where the answers part, less
    MARGIN."""
    n = 0
    for a, b in zip(whole, alone, strict=False):
        if a != b:
            break
        n += 1
    return whole[: max(0, n - MARGIN)]


class TokenMemo:
    """Key -> the ids its earlier messages render to, LRU-bounded. A key with nothing worth
    keeping (fewer than MIN_IDS, or the engine did not answer) is asked again after RELEARN
    requests: a timeout once must not cost a busy system prompt its memo for good."""

    def __init__(self, max_ids: int = MAX_IDS) -> None:
        # [] is a key seen once, or one with nothing kept (then in `_empty` too)
        self._entries: OrderedDict[bytes, list[int]] = OrderedDict()
        self._empty: dict[bytes, int] = {}  # key with nothing kept -> requests until asked again
        self._ids = 0
        self._max_ids = max_ids

    def __len__(self) -> int:
        return len(self._entries)

    def look(self, key: bytes, eager: bool = False) -> tuple[list[int] | None, bool]:
        """(the ids learned for `key`, or None; whether this request should learn them).
        `eager`: learn on the key's first sight."""
        ids = self._entries.get(key)
        if ids is None:  # first sight
            self._entries[key] = []
            self._bound()
            return None, eager
        self._entries.move_to_end(key)
        if ids:
            return ids, False
        left = self._empty.get(key)
        if left is None:  # second sight
            return None, True
        if left <= 1:
            self._forget(key)
        else:
            self._empty[key] = left - 1
        return None, False

    def learn(self, key: bytes, ids: list[int] | None) -> None:
        kept = ids if ids is not None and len(ids) >= MIN_IDS else []
        self._forget(key)
        self._entries[key] = kept
        self._ids += len(kept)
        if not kept:
            self._empty[key] = RELEARN
        self._bound()

    def _bound(self) -> None:
        while self._entries and (self._ids > self._max_ids or len(self._entries) > MAX_KEYS):
            self._forget(next(iter(self._entries)))

    def _forget(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._ids -= len(old)
        self._empty.pop(key, None)
