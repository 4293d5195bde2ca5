"""A continuation's events, made part of the stream the client began (migration only).

Every event of a continuation is parsed and written again (compact JSON, as vLLM writes it):
- `id`, `created` and `model` become the first stream's, so the client sees one stream;
- the continuation's role-only first event (`"delta":{"role":"assistant","content":""}`) is
  dropped: the client has had its role event;
- a `usage` object counts the prompt once and every token produced: the continuation's prompt
  held the `carried` tokens relayed before it, so they move from prompt to completion (the total
  is the continuation's own).
Chunks of a stream that never failed never come here: they stay byte-exact.
Input: whole events (router/request/migration/relay.py holds partial ones back).
"""

from __future__ import annotations

import json
from typing import Any

from router.request.wire.sse import event_json, next_boundary

_KEPT = ("id", "created", "model")


class Stitch:
    __slots__ = ("_carried", "_head")

    def __init__(self, head: dict[str, object], carried: int) -> None:
        self._head = {k: head[k] for k in _KEPT if k in head}
        self._carried = carried

    def feed(self, chunk: bytes) -> bytes:
        out: list[bytes] = []
        pos = 0
        while pos < len(chunk):
            end = next_boundary(chunk, pos)
            end = len(chunk) if end < 0 else end
            out.append(self._event(chunk[pos:end]))
            pos = end
        return b"".join(out)

    def _event(self, raw: bytes) -> bytes:
        event = event_json(raw)
        if event is None:
            return raw  # [DONE], a comment
        choices = event.get("choices")
        if isinstance(choices, list) and choices and all(_role_only(c) for c in choices):
            return b""
        for key, value in self._head.items():
            if key in event:
                event[key] = value
        usage = event.get("usage")
        if isinstance(usage, dict):
            _carry(usage, self._carried)
        return (
            b"data: "
            + json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
            + (b"\n\n")
        )


def _role_only(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return (
        isinstance(delta, dict)
        and "role" in delta
        and not delta.get("content")
        and not delta.get("tool_calls")
        and choice.get("finish_reason") is None
    )


def _carry(usage: dict[str, Any], carried: int) -> None:
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        moved = min(carried, prompt)
        usage["prompt_tokens"] = prompt - moved
        usage["completion_tokens"] = completion + moved
