"""Asking a backend for a stream's token usage the client did not ask for, and hiding the answer.

With `usage_accounting: active` (the default), a streamed chat or completion request whose client
did not set `stream_options.include_usage` goes upstream with it set (`inject()`), so the engine
ends the stream with its own counts; `UsageStrip` then removes that one usage-only event
(`"choices":[]` with a `"usage":{...}` object) from the bytes relayed, so the client gets exactly
the bytes it would have got without it. Only events holding `"usage":{` are parsed as JSON.

What the engines send with `include_usage` (their serving code, read): vLLM and SGLang add only
the final usage-only event (other chunks are unchanged: vLLM 0.32's chat and completion chunks
carry no `usage` key, with or without the option: tests_engine/test_conformance.py checks it).
OpenAI adds `"usage":null` to every other chunk as well; for `kind: openai` backends
`,"usage":null` is also removed from each chunk (one `bytes.replace` per chunk, only there). A
request with
`continuous_usage_stats` goes untouched: vLLM then puts usage in every chunk only with
`include_usage`, SGLang with or without it, so no edit is right for both (SGLang's chunks then
carry the usage anyway).

vLLM puts `system_fingerprint` on the last token's event (the one with a finish reason), or,
with `include_usage`, on the usage event instead: the strip holds the finish event back until the
next event shows whether it is the usage event, and moves the fingerprint onto it, so the client
gets the bytes vLLM sends it without the option. An event that has a fingerprint of its own
(OpenAI's chunks all do) is left as it is.

The usage-only event is found by parsing events (router/request/wire/sse.py): LF, CRLF or CR line
ends, each complete event holding `"usage":{` parsed as JSON and judged on its fields. A partial
event is held back until its end arrives (an SSE client cannot use half an event anyway), at most
MAX_HELD bytes: a longer event is relayed as it comes and stripping resumes after it.

Cost per chunk of an injected stream: the relay's inline test (an attribute, the chunk's last
two bytes, an `rfind` of `"usage":{` and one of `"finish_reason":"`; ~0.2 us) and nothing more
for a chunk of whole events without them. After the usage event, chunks pass untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from router.request.wire.sse import ends_an_event, event_json, last_boundary, next_boundary

USAGE_OBJECT = b'"usage":{'
FINISHED = b'"finish_reason":"'  # a finish reason that is not null: a choice's last event
_FINGERPRINT = b'"system_fingerprint"'
_USAGE_NULL = b',"usage":null'
MAX_HELD = 65536  # bytes of a partial event held back; a longer event is relayed as it comes
_INJECTED = b',"stream_options":{"include_usage":true}'
STREAMED_PATHS = ("/v1/chat/completions", "/v1/completions")
# `json.dumps` with arguments builds an encoder per call (~2 us); this one is made once.
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


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


def usage_only(payload: dict[str, Any]) -> bool:
    """The chat / completions usage-only event: `"choices":[]` and a `usage` object."""
    return payload.get("choices") == [] and isinstance(payload.get("usage"), dict)


class UsageStrip:
    """Removes the usage-only event from a relayed stream; `feed(chunk)` returns what to send.

    Events are found by their blank lines (any of LF, CRLF, CR: router/request/wire/sse.py), and
    every complete event holding `"usage":{` is parsed and judged by `is_usage` (one JSON parse
    per candidate; other events are never parsed), so a content event that happens to hold the
    substring does not hide the real one. A partial event is held back until its end arrives,
    at most MAX_HELD bytes: an event longer than that is relayed as it comes, untouched, and
    stripping resumes after its end, so the strip never holds more than MAX_HELD and looks at
    each byte of a long event a bounded number of times."""

    __slots__ = ("_carry", "_done", "_held", "_is_usage", "_nulls", "_skip", "slow", "stripped")

    def __init__(
        self, strip_nulls: bool, is_usage: Callable[[dict[str, Any]], bool] = usage_only
    ) -> None:
        self._held = b""
        self._done = False
        self._skip = False  # inside an event too long to hold: relayed to its end
        self._carry = b""  # the last bytes relayed while skipping (a blank line may straddle)
        self._nulls = strip_nulls  # OpenAI's shape: `"usage":null` in every other chunk
        self._is_usage = is_usage
        self.stripped = False  # the usage event was found and removed
        # False while nothing is held and no nulls are removed: then a chunk of whole events
        # (ends with a blank line) without USAGE_OBJECT passes unchanged, and the caller may
        # skip `feed` (the relay tests that inline: a method call per chunk costs more).
        self.slow = strip_nulls

    @property
    def held(self) -> int:
        """Bytes held back now (at most MAX_HELD)."""
        return len(self._held)

    def feed(self, chunk: bytes) -> bytes:
        if self._done:
            return chunk  # past the usage event: [DONE]
        passed = b""
        if self._skip:
            passed, chunk = self._skipping(chunk)
            if self._skip:
                return passed
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        out = self._whole_events(chunk) if chunk else b""
        self.slow = self._nulls or bool(self._held) or self._skip
        # On whole events only, so an occurrence split across chunks is found too.
        if self._nulls and out:
            out = out.replace(_USAGE_NULL, b"")
        return passed + out if passed else out

    def _skipping(self, chunk: bytes) -> tuple[bytes, bytes]:
        """(what of `chunk` belongs to the long event being relayed, the rest)."""
        carry = self._carry
        end = next_boundary(carry + chunk, 0)
        if end < 0:
            self._carry = (carry + chunk)[-2:]
            return chunk, b""
        end = max(0, end - len(carry))
        self._skip = False
        self._carry = b""
        return chunk[:end], chunk[end:]

    def _whole_events(self, buf: bytes) -> bytes:
        # `buf` starts where an event starts (a partial event is held back, a long one skipped).
        pos = 0
        out: list[bytes] = []
        while (at := buf.find(USAGE_OBJECT, pos)) >= 0:
            start = last_boundary(buf, at)
            end = next_boundary(buf, at)
            if end < 0:  # this event's end has not arrived yet (a finish event waits with it)
                keep = _finish_start(buf, pos, start)
                out.append(buf[pos:keep])
                out.append(self._hold(buf[keep:]))
                return b"".join(out)
            payload = event_json(buf[start:end]) if end - start <= MAX_HELD else None
            if payload is not None and self._is_usage(payload):
                self._done = self.stripped = True
                out.append(_fingerprinted(buf[pos:start], payload.get("system_fingerprint")))
                out.append(buf[end:])
                return b"".join(out)
            # A usage object in an event with choices (continuous usage, another engine's
            # shape): not the usage-only event; the client gets it as it is.
            out.append(buf[pos:end])
            pos = end
        cut = len(buf) if ends_an_event(buf) else max(pos, last_boundary(buf, len(buf)))
        # A finish event among the last whole ones waits with the partial event after it.
        keep = _finish_start(buf, pos, cut)
        rest = buf[pos:keep] + self._hold(buf[keep:]) if keep < len(buf) else buf[pos:]
        if not out:
            return rest
        out.append(rest)
        return b"".join(out)

    def _hold(self, partial: bytes) -> bytes:
        """Hold `partial` (an event begun, not ended) back; one too long is relayed instead,
        and the rest of it after it. Returns what to send now."""
        if len(partial) <= MAX_HELD:
            self._held = partial
            return b""
        self._skip = True
        self._carry = partial[-2:]
        return partial

    def flush(self) -> bytes:
        """What is held back, at the end of the stream (it ended inside an event)."""
        held, self._held = self._held, b""
        return held.replace(_USAGE_NULL, b"") if self._nulls else held


def _finish_start(buf: bytes, pos: int, cut: int) -> int:
    """Where the last whole event in `buf[pos:cut]` starts when it carries a finish reason and
    no fingerprint (it then waits for the next event, which may be the usage event whose
    fingerprint goes on it); else `cut`."""
    at = buf.rfind(FINISHED, pos, cut)
    if at < 0:
        return cut
    start = max(pos, last_boundary(buf, at))
    # Its end is `cut`, or unknown (-1) when `buf` ends there in CR CR.
    if next_boundary(buf, at) not in (-1, cut) or buf.find(_FINGERPRINT, start, cut) >= 0:
        return cut
    return start


def _fingerprinted(events: bytes, fingerprint: object) -> bytes:
    """`events` with `"system_fingerprint"` added to the last one, when that is a finish event
    without one (where vLLM puts it when the client did not ask for usage)."""
    if not isinstance(fingerprint, str) or not events:
        return events
    at = events.rfind(FINISHED)
    # Whole events: a last one ending in CR CR reads as "not ended yet" (-1) here.
    if at < 0 or next_boundary(events, at) not in (-1, len(events)):
        return events
    start = last_boundary(events, at)
    if events.find(_FINGERPRINT, start) >= 0:
        return events
    brace = events.rfind(b"}")
    if brace < start:
        return events
    value = _COMPACT.encode(fingerprint).encode()
    return events[:brace] + b',"system_fingerprint":' + value + events[brace:]
