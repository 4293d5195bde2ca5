"""A request's token estimate, for admission's fair queue and the tpm quota: one pure function.

`estimate_tokens(payload, body_len, limit_fields, ...)` is the prompt (body bytes / 4: about 4
characters a token for English text, JSON included, plus `history`: the known size of a stored
conversation a Responses request continues with `previous_response_id`, which the engine reads
and the body does not show) plus the completion budget times the sequences the engine generates:
`n` (or `best_of` when larger) for each prompt of a completions `prompt` list (a list of texts
or of token-id lists is a batch: vLLM answers each). The budget is read from the
endpoint's own limit field(s), the ones its engine honours, first present wins (chat:
`max_completion_tokens` then `max_tokens`; completions: `max_tokens` only, so a
`max_completion_tokens` that vLLM ignores there cannot inflate the estimate); an endpoint with no
completion (embeddings) names none. Absent or null: `default_max_tokens`. An endpoint whose body
is not its prompt (an audio upload, a lookup) has no prompt part (`prompt_from_body=False`).

Every part is an integer, and each prompt and each sequence's budget are clamped to
`max_model_len` (no sequence is longer), and the whole to MAX_ESTIMATE (2^50, past any tpm a key
can have: such a request is refused whole), so an estimate stays below 2^53: exact in a float
window and in a Redis script's doubles, never past int64 in HINCRBY, and a correction (real -
estimate) never rounds the real use away. Cost: O(1) (a list's length and its first item). A
value an engine with lax parsing would read differently (`"1000"`, `1000.0`, `true`) or none
would accept (`-5`, 400 digits) is a `BadLimit`: the caller answers 400 in the client's own
format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.core.endpoints import CHAT_LIMITS, COMPLETION_LIMITS

__all__ = ["CHAT_LIMITS", "COMPLETION_LIMITS", "NO_COMPLETION", "BadLimit", "estimate_tokens"]

NO_COMPLETION: tuple[str, ...] = ()  # each endpoint's own fields: router/core/endpoints.py
SEQUENCE_FIELDS = ("n", "best_of")
# Beyond any engine's reach: larger values are refused, not clamped (an int64 still fits).
MAX_VALUE = 2**63 - 1
MAX_SEQUENCES = 1024
# Above every tpm a key may have (10^10): an estimate this large is refused, never reserved.
MAX_ESTIMATE = 2**50


class BadLimit(ValueError):
    """A limit field the router will not guess at; `str()` is the client-facing message."""

    def __init__(self, param: str, message: str, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _integer(payload: Mapping[str, Any], name: str, top: int) -> int | None:
    value = payload.get(name)
    if value is None:
        return None
    # bool is an int in Python; JSON's true is not an integer to OpenAI.
    if type(value) is not int:
        kind = {bool: "a boolean", str: "a string", float: "a number with a fraction"}.get(
            type(value), "not a number"
        )
        if type(value) is float and value.is_integer():
            kind = "a decimal number"
        raise BadLimit(
            name,
            f"Invalid type for '{name}': expected an integer, but got {kind}.",
            "invalid_type",
        )
    if value < 1:
        raise BadLimit(
            name, f"Invalid '{name}': integer below minimum value (1).", "integer_below_min_value"
        )
    if value > top:
        raise BadLimit(
            name, f"Invalid '{name}': integer above maximum value.", "integer_above_max_value"
        )
    return value


def estimate_tokens(
    payload: Mapping[str, Any],
    body_len: int,
    limit_fields: Sequence[str] = CHAT_LIMITS,
    default_max_tokens: int = 256,
    max_model_len: int = 131072,
    prompt_from_body: bool = True,
    history: int = 0,
) -> int:
    """Estimated prompt + completion tokens of one request (see the module docstring); raises
    `BadLimit` for a limit field or `n`/`best_of` that is not a sane integer. `history`: the
    tokens of the stored conversation the request continues (0: none or unknown)."""
    completion = None
    for name in limit_fields:
        value = _integer(payload, name, MAX_VALUE)  # every present field is checked
        if completion is None:
            completion = value
    sequences = 1
    if limit_fields:
        for name in SEQUENCE_FIELDS:
            value = _integer(payload, name, MAX_SEQUENCES)
            if value is not None and value > sequences:
                sequences = value
        if completion is None:
            completion = default_max_tokens
    else:
        completion = 0
    # A completions batch: a `prompt` list of texts or of token-id lists is one prompt per
    # item (a list of ids is one prompt), each generating `sequences`.
    prompts = 1
    if completion:
        batch = payload.get("prompt")
        if type(batch) is list and batch and type(batch[0]) is not int:
            prompts = len(batch)
    prompt = min(body_len // 4 + history, prompts * max_model_len) if prompt_from_body else 0
    total = prompt + prompts * sequences * min(completion, max_model_len)
    return total if total < MAX_ESTIMATE else MAX_ESTIMATE
