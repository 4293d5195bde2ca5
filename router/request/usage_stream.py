"""Asking a backend for a stream's token usage the client did not ask for, and hiding the answer.

With `usage_accounting: active` (the default), a streamed chat or completion request whose client
did not set `stream_options.include_usage` goes upstream with it set (`inject()`), so the engine
ends the stream with its own counts; `UsageStrip` then removes that one usage-only event
(`"choices":[]` with a `"usage":{...}` object) from the bytes relayed, so the client gets exactly
the bytes it would have got without it. Nothing is parsed as JSON per chunk.

What the engines send with `include_usage` (their serving code, read): vLLM and SGLang add only
the final usage-only event (other chunks are unchanged: vLLM 0.32's chat and completion chunks
carry no `usage` key, with or without the option: tests_engine/test_conformance.py checks it).
OpenAI adds `"usage":null` to every other chunk as well; for `kind: openai` backends
`,"usage":null` is also removed from each chunk (one `bytes.replace` per chunk, only there). A
request with
`continuous_usage_stats` goes untouched: vLLM then puts usage in every chunk only with
`include_usage`, SGLang with or without it, so no edit is right for both (SGLang's chunks then
carry the usage anyway).

Cost per chunk of an injected stream: the relay's inline test (an attribute, the chunk's last
two bytes, one `rfind` of `"usage":{`; ~0.1 us) and nothing more for a chunk of whole events
without it. A chunk that ends inside an event keeps that partial event back until its end
arrives (an SSE client cannot use half an event anyway), so an event split across upstream
chunks is still recognised. After the usage event, chunks pass untouched.
"""

from __future__ import annotations

import json
from typing import Any

USAGE_OBJECT = b'"usage":{'
_EMPTY_CHOICES = b'"choices":[]'
_USAGE_NULL = b',"usage":null'
_WINDOW = 4096  # the usage event is the last before [DONE]: look only at a chunk's end
_MAX_HELD = 65536  # a partial "event" this long is no SSE we understand: stop holding back
_INJECTED = b',"stream_options":{"include_usage":true}'
STREAMED_PATHS = ("/v1/chat/completions", "/v1/completions")


def needs_injection(payload: dict[str, Any]) -> bool:
    """A stream whose client did not ask for usage itself. Anything but absent, null or false
    (`"true"`, 1: what an engine's lax parsing may take as true) counts as asking, and
    `stream_options` that is not an object is left for the backend to refuse: sluicegate never
    removes a usage event the client might have got, nor mends a body the backend would refuse."""
    options = payload.get("stream_options")
    if options is None:
        return True
    return (
        isinstance(options, dict)
        and options.get("include_usage") in (None, False)
        and options.get("continuous_usage_stats") in (None, False)
    )


def inject(body: bytes, payload: dict[str, Any]) -> bytes:
    """`body` with `stream_options.include_usage` set; other stream options are kept.

    Without `stream_options` in the body (the common case) the option is spliced in before the
    object's closing brace, leaving every other byte as the client sent it; otherwise the payload
    is serialised again."""
    if "stream_options" not in payload:
        end = body.rstrip()
        if end.endswith(b"}") and len(payload) > 0:
            return end[:-1] + _INJECTED + b"}"
    return json.dumps(with_usage(payload)).encode()


def with_usage(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload with `include_usage` set, its other stream options kept."""
    options = payload.get("stream_options")
    kept = options if isinstance(options, dict) else {}
    return {**payload, "stream_options": {**kept, "include_usage": True}}


class UsageStrip:
    """Removes the usage-only event from a relayed stream; `feed(chunk)` returns what to send."""

    __slots__ = ("_done", "_held", "_nulls", "slow", "stripped")

    def __init__(self, strip_nulls: bool) -> None:
        self._held = b""
        self._done = False
        self._nulls = strip_nulls  # OpenAI's shape: `"usage":null` in every other chunk
        self.stripped = False  # the usage event was found and removed
        # False while nothing is held and no nulls are removed: then a chunk of whole events
        # (ends with a blank line) without USAGE_OBJECT passes unchanged, and the caller may
        # skip `feed` (the relay tests that inline: a method call per chunk costs more).
        self.slow = strip_nulls

    def feed(self, chunk: bytes) -> bytes:
        if self._done:
            return chunk  # past the usage event: [DONE]
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        out = self._whole_events(chunk)
        self.slow = self._nulls or bool(self._held)
        # On whole events only, so an occurrence split across chunks is found too.
        return out.replace(_USAGE_NULL, b"") if self._nulls and out else out

    def _whole_events(self, chunk: bytes) -> bytes:
        at = chunk.find(USAGE_OBJECT, max(0, len(chunk) - _WINDOW))
        if at >= 0:
            return self._remove(chunk, at)
        if chunk.endswith((b"\n\n", b"\n\r\n")):
            return chunk
        cut = _last_boundary(chunk, len(chunk))
        if len(chunk) - cut > _MAX_HELD:
            self._done = True  # not SSE as we know it: relay as it comes
            return chunk
        self._held = chunk[cut:]
        return chunk[:cut]

    def _remove(self, buf: bytes, at: int) -> bytes:
        # `buf` starts at an event's start (a partial event is held back), so the event holding
        # the usage object starts after the last boundary before it.
        start = _last_boundary(buf, at)
        end = _next_boundary(buf, at)
        if end < 0:  # the event's end has not arrived yet
            self._held = buf[start:]
            return buf[:start]
        if _EMPTY_CHOICES in buf[start:end]:
            self._done = self.stripped = True
            return buf[:start] + buf[end:]
        # A usage object in an event with choices (continuous usage, another engine's shape):
        # not the usage-only event; the client gets it as it is.
        return buf

    def flush(self) -> bytes:
        """What is held back, at the end of the stream (it ended inside an event)."""
        held, self._held = self._held, b""
        return held.replace(_USAGE_NULL, b"") if self._nulls else held


def _last_boundary(buf: bytes, before: int) -> int:
    """Where the event containing position `before` starts: after the last blank line."""
    lf = buf.rfind(b"\n\n", 0, before)
    crlf = buf.rfind(b"\n\r\n", 0, before)
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _next_boundary(buf: bytes, after: int) -> int:
    """The end of the event containing position `after` (past its blank line), or -1."""
    lf = buf.find(b"\n\n", after)
    crlf = buf.find(b"\n\r\n", after)
    ends = [e for e in (lf + 2 if lf >= 0 else -1, crlf + 3 if crlf >= 0 else -1) if e >= 0]
    return min(ends) if ends else -1
