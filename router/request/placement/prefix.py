"""A request's prompt as a chain of block hashes: what the prefix index and `cache_aware` match.

The prompt is serialised canonically (chat `tools` when present, then each message's role and
content, a non-string content or `tool_calls` as its compact sorted JSON; or a completion
`prompt`; the Responses API's `instructions` and `input`, the Messages API's `system` and
`messages`), cut to at most `affinity.max_prefix_chars` characters, then into full blocks of
`affinity.block_chars` characters (a partial tail block is not hashed: engines cache whole
blocks too). Block i's hash is blake2b-64 over block i-1's hash and block i's bytes, so two
prompts share hash i exactly when they share their first i+1 blocks: a match is a true prefix.
A body with neither `messages` nor `prompt` (or a prompt shorter than one block) has no hashes:
no affinity, never an error. A request for a LoRA adapter starts its chain from a key of the
adapter's name (`seed`): the same prompt under an adapter and under the base model (or another
adapter) shares no block, as the engine caches them apart.
Cost: ~0.13 ms CPU for a 32k-character prompt (bench/oneoff/prefix.py);
xxhash's xxh3 would hash the blocks ~5x faster (0.02 against 0.1 ms in one run), but blake2b
is well within the 0.3 ms budget and needs no new dependency.
"""

from __future__ import annotations

import json
from hashlib import blake2b
from typing import Any

_SEP_MSG = "\x1e"  # record separator: cannot be confused with a role or content boundary
_SEP_ROLE = "\x1f"


def _json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):  # a parsed JSON body always serialises; be safe anyway
        return repr(value)


def prompt_text(payload: dict[str, Any], limit: int, responses: bool = False) -> str:
    """The canonical prompt, at most `limit` characters (stops serialising once past it);
    `responses`: a Responses API body (its `input`; an embeddings `input` is no prompt)."""
    parts: list[str] = []
    size = 0
    messages = payload.get("messages")
    if responses and not isinstance(messages, list):
        given = payload.get("input")  # the Responses API: a string, or a list of items
        messages = [{"role": "user", "content": given}] if isinstance(given, str) else given
    if isinstance(messages, list):
        tools = payload.get("tools")
        if tools:
            parts.append("\x02" + _json(tools))
            size += len(parts[-1])
        # Responses' `instructions`, Messages' `system`: ahead of the conversation.
        system = payload.get("instructions") or payload.get("system")
        if system:
            parts.append("\x03" + (system if isinstance(system, str) else _json(system)))
            size += len(parts[-1])
        for m in messages:
            room = limit - size
            if room <= 0:
                break
            if not isinstance(m, dict):
                part = _SEP_MSG + _json(m)
            else:
                content = m.get("content")
                role = m.get("role")
                # Clipped before joining: a pasted 4 MB document is not copied whole twice.
                part = (
                    _SEP_MSG
                    + (role if isinstance(role, str) else _json(role))
                    + _SEP_ROLE
                    + (content[:room] if isinstance(content, str) else _json(content))
                )
                calls = m.get("tool_calls")
                if calls is not None:
                    part += _SEP_ROLE + _json(calls)
            parts.append(part)
            size += len(part)
    else:
        prompt = payload.get("prompt")
        if prompt is None:
            return ""
        parts.append(prompt[:limit] if isinstance(prompt, str) else _json(prompt))
    text = "".join(parts)
    return text[:limit] if len(text) > limit else text


def block_hashes(text: str, block_chars: int, seed: str = "") -> list[bytes]:
    """Chained 8-byte hashes of `text`'s full blocks of `block_chars` characters; `seed`: the
    LoRA adapter they are computed under ("" for the base model)."""
    n = len(text) // block_chars
    out: list[bytes] = []
    h = blake2b(b"lora:" + seed.encode("utf-8", "replace"), digest_size=8).digest() if seed else b""
    if text.isascii():  # one encode, then byte slices line up with character blocks
        data = text.encode("ascii")
        for i in range(0, n * block_chars, block_chars):
            h = blake2b(h + data[i : i + block_chars], digest_size=8).digest()
            out.append(h)
    else:
        for i in range(0, n * block_chars, block_chars):
            chunk = text[i : i + block_chars].encode("utf-8", "surrogatepass")
            h = blake2b(h + chunk, digest_size=8).digest()
            out.append(h)
    return out


def prefix_hashes(
    payload: dict[str, Any],
    block_chars: int,
    max_prefix_chars: int,
    responses: bool = False,
    seed: str = "",
) -> list[bytes]:
    """The request's prefix chain (empty: nothing to match on)."""
    return block_hashes(prompt_text(payload, max_prefix_chars, responses), block_chars, seed)
