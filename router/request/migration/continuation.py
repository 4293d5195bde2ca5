"""The continuation request: the original request plus the text relayed so far (pure, no I/O).

    chat:         the original messages, plus an assistant message holding the text so far, with
                  `continue_final_message: true` and `add_generation_prompt: false` (vLLM's
                  fields; SGLang takes the same), or that text appended to the final assistant
                  message when the client itself asked to continue it;
    completions:  the prompt plus the text so far.

`max_tokens` (and `max_completion_tokens`, `min_tokens`) go down by the tokens already produced.
Text, not token ids: docs/migration.md says why, and what re-tokenizing costs in drift.
"""

from __future__ import annotations

from typing import Any

_LIMITS = ("max_tokens", "max_completion_tokens", "min_tokens")


class CannotContinue(Exception):
    """This request has no continuation (str() says why, for the client's error event)."""


def build(payload: dict[str, Any], shape: str, text: str, produced: int) -> dict[str, Any]:
    """The continuation of `payload` after `text` (`produced` tokens) reached the client."""
    body = dict(payload)
    for key in _LIMITS:
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            left = limit - produced
            if key != "min_tokens" and left < 1:
                raise CannotContinue("the token limit was reached")
            body[key] = max(0, left)
    if not text:
        return body
    if shape == "completion":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise CannotContinue("only a text prompt can be continued")
        body["prompt"] = prompt + text
        return body
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise CannotContinue("the request has no messages")
    last = messages[-1] if messages else None
    own = (
        body.get("continue_final_message") is True
        and isinstance(last, dict)
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
    )
    if own:
        assert isinstance(last, dict)
        messages = [*messages[:-1], {**last, "content": last["content"] + text}]
    else:
        messages = [*messages, {"role": "assistant", "content": text}]
    body["messages"] = messages
    body["continue_final_message"] = True
    body["add_generation_prompt"] = False
    return body
