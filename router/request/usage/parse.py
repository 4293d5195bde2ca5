"""What a response's bytes say about tokens, read as they pass without parsing them as JSON.

`ResponseUsage.feed(chunk)` runs per upstream chunk of an SSE stream. Until the first token it
looks for a non-empty content value (`content":"x`, which also matches `reasoning_content`, or
`"text":"x` for completions) and stamps `first_token_at` there: time to first token, as distinct
from the first byte (vLLM's first event carries only the role, `"content":""`). From that event
on it counts content events with one `bytes.count` per `BATCH` chunks joined (a key split
across two batches is counted once, from the few bytes carried over), and stamps
`last_token_at` when a batch is counted. Events after the
first count even when empty: vLLM sends one per generated token, the last (finish) one included,
and holds back the text of a token that ends mid-character. `keep(chunk)` is all a non-streamed
or compressed body gets. `close()` reads the final `usage`, when present, from the body's last
bytes: the engine's completion tokens win over the event count (an event may carry several
tokens); prompt tokens and cached prompt tokens come only from there. `sink`, when set, receives
every chunk fed, in order: one at a time until the first token, then each batch joined (a
migratable stream's relay, router/request/migration/relay.py, keeps them so; `flush()` hands over
the last batch).

Each API shape (`router/core/endpoints.py`) has its own event key and usage fields: chat and
completions as above; Responses counts `response.output_text.delta` (and reasoning) events and
reads `input_tokens`, `output_tokens` and `cached_tokens` from `response.completed` or the body;
Messages counts `content_block_delta` events and reads `output_tokens` and `input_tokens` (plus
`cache_read_input_tokens` and `cache_creation_input_tokens`: Anthropic's `input_tokens` leaves the
cached part out) from `message_delta` or the body, `input_tokens` from `message_start` when the
last event lacks it.

Compact JSON is assumed (what vLLM, SGLang and OpenAI send); a body with spaces after its colons
gets token counts only from its `usage`, and no time to first token.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

_CHAT_KEY = b'content":"'
_TEXT_KEY = b'"text":"'
_FIRST_CHAT = re.compile(rb'content":"[^"]')
_FIRST_TEXT = re.compile(rb'"text":"[^"]')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,9})')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*(\d{1,9})')
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,9})')
_INPUT = re.compile(rb'"input_tokens"\s*:\s*(\d{1,9})')
_OUTPUT = re.compile(rb'"output_tokens"\s*:\s*(\d{1,9})')
_CACHE_READ = re.compile(rb'"cache_read_input_tokens"\s*:\s*(\d{1,9})')
_CACHE_CREATED = re.compile(rb'"cache_creation_input_tokens"\s*:\s*(\d{1,9})')
# shape -> (the key counted once per content event, the first non-empty content)
_EVENTS: dict[str, tuple[bytes, re.Pattern[bytes]]] = {
    "chat": (_CHAT_KEY, _FIRST_CHAT),
    "completion": (_TEXT_KEY, _FIRST_TEXT),
    # `"type":"response.output_text.delta"` (and reasoning_text): the `event:` line has no quote
    "responses": (b'_text.delta"', re.compile(rb'_text\.delta"')),
    "messages": (b'block_delta"', re.compile(rb'block_delta"')),
}
_TAIL = 4096  # the final usage object sits in the last event (or at the end of a JSON body)
BATCH = 16  # chunks counted together after the first token


class ResponseUsage:
    __slots__ = (
        "_carry",
        "_end",
        "_events",
        "_first",
        "_head",
        "_key",
        "_last",
        "_pending",
        "_prev",
        "_shape",
        "_tail",
        "cached_tokens",
        "first_token_at",
        "input_tokens",
        "last_token_at",
        "on_count",
        "reported_tokens",
        "sink",
    )

    def __init__(self, shape: str = "chat") -> None:
        """`shape`: an endpoint's `usage` (`router/core/endpoints.py`)."""
        self._shape = shape
        self._key, self._first = _EVENTS.get(shape, _EVENTS["chat"])
        self._carry = b""
        self._head: bytes | None = None  # the first chunk: it names the model
        self._pending: list[bytes] = []  # chunks since the first token, not yet counted
        self._tail = b""  # the last bytes counted (streams)
        self._prev = b""  # the last two chunks (bodies not counted, streams before content)
        self._last = b""
        self._events = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.reported_tokens: int | None = None  # completion_tokens of the final usage
        self.input_tokens: int | None = None
        self.cached_tokens: int | None = None  # prompt_tokens_details.cached_tokens
        self._end = b""  # the last bytes, kept at close for response_model
        self.sink: Callable[[bytes], None] | None = None
        # Told each batch's count of content events (the token load's decode tokens left).
        self.on_count: Callable[[int], None] | None = None

    def feed(self, chunk: bytes) -> None:
        """One chunk of an uncompressed SSE stream, as it goes to the client."""
        if self.first_token_at is not None:
            # Counted in batches: one join and one count per BATCH chunks costs less than a
            # count per chunk.
            pending = self._pending
            pending.append(chunk)
            if len(pending) >= BATCH:
                self._count()
            return
        if self.sink is not None:
            self.sink(chunk)
        if self._head is None:
            self._head = chunk
        elif len(self._head) < _TAIL:  # the opening events (Messages: message_start's usage)
            self._head += chunk
        self._prev = self._last  # a stream with no content at all reads its usage from these
        self._last = chunk
        buf = self._carry + chunk if self._carry else chunk
        found = self._first.search(buf)
        if found is None:
            # A whole key plus the character that says whether its value is empty.
            self._carry = buf[-len(self._key) :]
            return
        self.first_token_at = self.last_token_at = time.perf_counter()
        self._events = buf.count(self._key, found.start())
        if self.on_count is not None:
            self.on_count(self._events)
        # Shorter than the key: a key wholly inside it was counted here, not again.
        self._carry = buf[1 - len(self._key) :]
        self._tail = buf[-_TAIL:]

    def _count(self) -> None:
        pending = self._pending
        if not pending:
            return
        joined = b"".join(pending)
        buf = self._carry + joined
        pending.clear()
        if self.sink is not None:
            self.sink(joined)
        n = buf.count(self._key)
        if n:
            self._events += n
            # The batch's last chunk: for TPOT, close enough (engines end with the finish event
            # and [DONE] right after the last token).
            self.last_token_at = time.perf_counter()
            if self.on_count is not None:
                self.on_count(n)
        self._carry = buf[1 - len(self._key) :]
        self._tail = (self._tail + joined)[-_TAIL:] if len(joined) < _TAIL else joined[-_TAIL:]

    def flush(self) -> None:
        """Count (and hand `sink`) the chunks fed since the last batch."""
        self._count()

    @property
    def events(self) -> int:
        """Content events from the first non-empty one on (all of them counted so far)."""
        self._count()
        return self._events

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
        self._count()
        tail = self._tail if self.first_token_at is not None else (self._prev + self._last)
        tail = tail[-_TAIL:]
        # Regexes cost: they read only the last usage object (a few hundred bytes, not the
        # whole tail), and only after a plain substring test (most streams carry no usage).
        at = tail.rfind(b'"usage"')
        found = tail[at:] if at >= 0 else b""
        if b'"prompt_tokens"' in found:
            # Embeddings report prompt tokens only.
            self.reported_tokens = _last_match(_COMPLETION, found)
            self.input_tokens = _last_match(_PROMPT, found)
            self.cached_tokens = _last_match(_CACHED, found)
        elif b'"output_tokens"' in found or b'"input_tokens"' in found:
            self._read_input_output(found)
        self._end = tail

    def _read_input_output(self, found: bytes) -> None:
        """Responses' and Messages' usage: `input_tokens` / `output_tokens`."""
        self.reported_tokens = _last_match(_OUTPUT, found)
        prompt = _last_match(_INPUT, found)
        if self._shape == "messages":
            if prompt is None and self._head is not None:
                # `message_delta` may carry only output_tokens: `message_start` has the input.
                prompt = _last_match(_INPUT, self._head[:_TAIL])
            read = _last_match(_CACHE_READ, found)
            created = _last_match(_CACHE_CREATED, found)
            if prompt is not None:
                prompt += (read or 0) + (created or 0)
            self.cached_tokens = read
        else:
            self.cached_tokens = _last_match(_CACHED, found)
        self.input_tokens = prompt

    @property
    def response_model(self) -> str | None:
        """The model id the backend answered with (read when asked: only traces want it)."""
        head, tail = self._head, self._end
        if head is None:
            return None
        found = _MODEL.search(head, 0, _TAIL) or (_MODEL.search(tail) if tail else None)
        return found.group(1).decode("utf-8", "replace") if found is not None else None

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
