"""What a response's bytes say about tokens, read as they pass without parsing them as JSON.

`ResponseUsage.feed(chunk)` runs per upstream chunk of an SSE stream. Until the first token it
looks for a non-empty content value (`content":"x`, which also matches `reasoning_content`, or
`"text":"x` for completions) and stamps `first_token_at` there: time to first token, as distinct
from the first byte (vLLM's first event carries only the role, `"content":""`). From that event
on it counts content events with one `bytes.count` per chunk (a key split across two chunks is
counted once, from the few bytes carried over), and stamps `last_token_at`. Events after the
first count even when empty: vLLM sends one per generated token, the last (finish) one included,
and holds back the text of a token that ends mid-character. `keep(chunk)` is all a non-streamed
or compressed body gets. `close()` reads the final `usage`, when present, from the body's last
bytes: the engine's completion tokens win over the event count (an event may carry several
tokens); prompt tokens come only from there.

Compact JSON is assumed (what vLLM, SGLang and OpenAI send); a body with spaces after its colons
gets token counts only from its `usage`, and no time to first token.
"""

from __future__ import annotations

import re
import time

_CHAT_KEY = b'content":"'
_TEXT_KEY = b'"text":"'
_FIRST_CHAT = re.compile(rb'content":"[^"]')
_FIRST_TEXT = re.compile(rb'"text":"[^"]')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,9})')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,9})')
_TAIL = 4096  # the final usage object sits in the last event (or at the end of a JSON body)


class ResponseUsage:
    __slots__ = (
        "_carry",
        "_first",
        "_head",
        "_key",
        "_last",
        "_prev",
        "events",
        "first_token_at",
        "input_tokens",
        "last_token_at",
        "reported_tokens",
        "response_model",
    )

    def __init__(self, path: str) -> None:
        chat = not path.endswith("/completions") or path.endswith("/chat/completions")
        self._key = _CHAT_KEY if chat else _TEXT_KEY
        self._first = _FIRST_CHAT if chat else _FIRST_TEXT
        self._carry = b""
        self._head: bytes | None = None  # the first chunk: it names the model
        self._prev = b""
        self._last = b""
        self.events = 0  # output-token events counted in the stream
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.reported_tokens: int | None = None  # completion_tokens of the final usage
        self.input_tokens: int | None = None
        self.response_model: str | None = None

    def feed(self, chunk: bytes) -> None:
        """One chunk of an uncompressed SSE stream, as it goes to the client."""
        key = self._key
        if self.first_token_at is None:
            self._before_first(chunk)
        else:
            carry = self._carry
            if carry:  # the previous chunk ended mid-event: a key may straddle the two
                self.events += (carry + chunk[: len(key) - 1]).count(key)
            n = chunk.count(key)
            if n:
                self.events += n
                self.last_token_at = time.perf_counter()
            # JSON escapes newlines: a chunk ending in one ends between lines, nothing to carry.
            if chunk[-1:] == b"\n":
                self._carry = b""
            elif len(chunk) >= len(key) - 1:
                self._carry = chunk[1 - len(key) :]
            else:  # a sliver: keep what came before it too
                self._carry = (carry + chunk)[1 - len(key) :]
        if self._head is None:
            self._head = chunk
        self._prev = self._last
        self._last = chunk

    def _before_first(self, chunk: bytes) -> None:
        buf = self._carry + chunk if self._carry else chunk
        found = self._first.search(buf)
        if found is None:
            # Whole key plus the character that says whether its value is empty.
            self._carry = b"" if chunk[-1:] == b"\n" else buf[-len(self._key) :]
            return
        self.first_token_at = self.last_token_at = time.perf_counter()
        self.events = buf.count(self._key, found.start())
        self._carry = b"" if chunk[-1:] == b"\n" else buf[1 - len(self._key) :]

    def keep(self, chunk: bytes) -> None:
        """One chunk of a body that is not counted (not a stream, or compressed)."""
        if self._head is None:
            self._head = chunk
        self._prev = self._last
        self._last = chunk

    def close(self, readable: bool) -> None:
        """The body ended; `readable` is False for a compressed body (nothing to read then)."""
        if not readable or self._head is None:
            return
        tail = (self._prev + self._last)[-_TAIL:]
        found = _MODEL.search(self._head, 0, _TAIL) or _MODEL.search(tail)
        if found is not None:
            self.response_model = found.group(1).decode("utf-8", "replace")
        completion = _last_match(_COMPLETION, tail)
        if completion is not None:
            self.reported_tokens = completion
            self.input_tokens = _last_match(_PROMPT, tail)

    @property
    def output_tokens(self) -> int | None:
        """The engine's count when it sent one, else the events counted (also of a stream cut
        short), else None."""
        if self.reported_tokens is not None:
            return self.reported_tokens
        return self.events or None

    def time_per_output_token(self) -> float | None:
        """Seconds per token after the first; None with fewer than two tokens."""
        first, last, tokens = self.first_token_at, self.last_token_at, self.output_tokens
        if first is None or last is None or tokens is None or tokens < 2:
            return None
        return (last - first) / (tokens - 1)


def _last_match(pattern: re.Pattern[bytes], data: bytes) -> int | None:
    found = pattern.findall(data)
    return int(found[-1]) if found else None
