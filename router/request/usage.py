"""What a response's bytes say about tokens, read as they pass without parsing them as JSON.

`ResponseUsage.feed(chunk)` runs per upstream chunk of an SSE stream: it counts output-token
events with two `bytes.count` calls (`content":"` minus the empty `content":""`, or `"text":"`
for completions; `content":"` also matches `reasoning_content`) on the chunk joined to the
previous chunk's last few bytes, so a key split across chunks is counted once. The first chunk
holding a non-empty content or text value stamps `first_token_at` (time to first token, as
distinct from the first byte: vLLM's first event carries only the role). `keep(chunk)` is all a
non-streamed or compressed body gets. `close()` reads the body's final `usage`, when present,
from its last bytes: completion tokens counted by the engine win over the event count (one event
may carry several tokens); prompt tokens come only from there.

Compact JSON is assumed for counting (what vLLM, SGLang and OpenAI send); a server that puts
spaces after colons gets its first token detected but tokens counted only from `usage`.
"""

from __future__ import annotations

import re
import time

_CHAT_KEY = b'content":"'
_CHAT_EMPTY = b'content":""'
_TEXT_KEY = b'"text":"'
_TEXT_EMPTY = b'"text":""'
_FIRST_CHAT = re.compile(rb'content"\s*:\s*"[^"]')
_FIRST_TEXT = re.compile(rb'"text"\s*:\s*"[^"]')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,9})')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,9})')
_TAIL = 4096  # the final usage object sits in the last event (or at the end of a JSON body)


class ResponseUsage:
    __slots__ = (
        "_carry",
        "_empty",
        "_first",
        "_head",
        "_keep",
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
        self._empty = _CHAT_EMPTY if chat else _TEXT_EMPTY
        self._first = _FIRST_CHAT if chat else _FIRST_TEXT
        self._keep = len(self._empty) - 1  # shorter than either pattern: no match lies within
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
        buf = self._carry + chunk
        # Start at 1: the carry is one byte longer than the key, so a key wholly inside it was
        # counted with the previous chunk.
        n = buf.count(self._key, 1) - buf.count(self._empty)
        if n:
            self.events += n
            self.last_token_at = time.perf_counter()
        if self.first_token_at is None and self.events > 0:
            # A key at a chunk's very end may open an empty value: the first token is stamped
            # when its first character is here (the carry holds a whole key).
            if self._first.search(buf) is not None:
                self.first_token_at = time.perf_counter()
        self._carry = buf[-self._keep :]
        if self._head is None:
            self._head = chunk
        self._prev = self._last
        self._last = chunk

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
