"""What one attempt of a migratable stream relayed to the client
(router/request/migration/policy.py).

The pump asks `Relayed` about a chunk only when migration is on for the call, and only when the
chunk may hold more than tokens: one that ends inside an event, in an event that is not a
choices event (CHOICES_END), or holds a finish reason. `feed(chunk)` returns what may be sent
now:
- whole events only: a partial event is held until its end arrives (at most MAX_HELD bytes), so
  the client never holds half an event when a continuation takes over; an event ends at a blank
  line of any SSE line end (LF, CRLF, lone CR: router/request/wire/sse.py), and `flush()` gives what
  is held when the stream ends (the client gets it, as it would with migration off);
- never an engine's error event (`{"error": ...}`) nor a choice with `finish_reason: "error"`:
  they and what follows them are withheld and `broken` says why;
- after `move()` (the backend is being removed: router/request/migration/policy.py), the whole
  events of the chunk, then `broken = "moved"`.

The events relayed reach `take()` from the usage reader (router/request/usage/parse.py), which joins
the stream's chunks in batches anyway: the pump spends no statement per chunk on keeping them.
Memory: the raw events, until they pass COMPACT_AT bytes; then they are folded into their text
pieces (one regex pass), so a stream holds at most COMPACT_AT bytes of events plus its text, and
all of it goes with the call. `summary()` folds what is left, once, when a continuation is built.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from router.request.wire.sse import event_json, last_boundary, next_boundary

COMPACT_AT = 256 * 1024  # bytes of raw events kept before they are folded into text (a batch
# taken is at most the usage reader's BATCH chunks of the transport's 256 KiB high-water mark)
MAX_HELD = 65536  # a partial event longer than this cannot be held: the stream is not migratable
# In an error event (`{"error":`) and in `"finish_reason":"error"`; a token's text holding it
# reads `\"error\"`. The closing quote also makes the search cheaper (about 3x, measured).
ERROR_MARK = b'"error"'
# How every choices event of a chat or completion stream ends (vLLM's, SGLang's, the mock's): a
# chunk ending so, with no finish reason in it, holds no error (an engine sends its error event
# last, then at most [DONE]), so the pump may skip the relay's parsing for it.
CHOICES_END = b"]}\n\n"
# The text of a chat delta or a completion choice, as its JSON string's escaped bytes.
_TEXT = {
    "chat": re.compile(rb'"content":"([^"\\]*(?:\\.[^"\\]*)*)"'),
    "completion": re.compile(rb'"text":"([^"\\]*(?:\\.[^"\\]*)*)"'),
}
_TOOL_CALL = b'"tool_calls":[{'
_FINISH = b'"finish_reason":"'
_DONE = b"[DONE]\n\n"  # the end of the stream's last event, after any error
_HEAD_BYTES = 4096  # the first event is kept apart: it names the stream's id, created, model
_BLANK_ENDS = (b"\n\n", b"\r\r", b"\n\r")  # a chunk ending so ends an event


@dataclass(frozen=True, slots=True)
class Summary:
    """What a continuation needs from the events relayed."""

    text: str
    head: dict[str, object] | None  # the first event's JSON (its id, created, model)
    tool_calls: bool  # a tool call was being streamed
    finished: bool  # a choice had finished (stop, length): nothing is left to generate


class Relayed:
    __slots__ = (
        "_finished",
        "_held",
        "_pieces",
        "_shape",
        "_tools",
        "broken",
        "chunks",
        "head",
        "size",
        "slow",
        "spoiled",
    )

    def __init__(self, shape: str) -> None:
        self._shape = shape
        self.chunks: list[bytes] = []  # raw whole events relayed since the last fold
        self.size = 0  # their bytes
        self.spoiled = False  # an event too long to hold went out in parts: no continuation
        self.head = b""  # the first event relayed
        self._held = b""  # a partial event, not yet relayed
        self._pieces: list[bytes] = []  # folded text, as escaped JSON string content
        self._tools = False
        self._finished = False
        self.broken: str | None = None  # why the stream is over: error_event, finish_error, moved
        # The next chunk must go through `feed` (a partial event is held, or a move was asked).
        self.slow = False

    def move(self) -> None:
        """End the relay at the next event boundary (the backend is being removed)."""
        if self.broken is None:
            self.broken = "moved"
            self.slow = True

    def take(self, events: bytes) -> None:
        """Whole events the client was sent (one chunk, or a batch of them)."""
        if not self.head:
            self.head = events[:_HEAD_BYTES]
        self.chunks.append(events)
        self.size += len(events)
        if self.size > COMPACT_AT:
            self._fold()

    def feed(self, chunk: bytes) -> bytes:
        """What of `chunk` to relay now (whole events, none past a break)."""
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        # It ends in a blank line (LF LF: what engines write; CR CR, LF CR: a lone CR ends a
        # line, and a LF after it would only complete a CRLF): nothing to hold.
        if chunk.endswith(_BLANK_ENDS):
            whole, partial = chunk, b""
        else:
            cut = last_boundary(chunk, len(chunk))
            whole, partial = chunk[:cut], chunk[cut:]
        if len(partial) > MAX_HELD:
            # Relayed in parts as it comes; a continuation could not follow half an event.
            self.spoiled = True
            whole, partial = chunk, b""
        if whole:
            whole = self._before_error(whole)
        if self.broken is None:
            self._held = partial
        self.slow = bool(self._held) or self.broken is not None
        return whole

    def flush(self) -> bytes:
        """What is held when the stream ends (its last event had no blank line after it): it
        goes to the client as it would without migration."""
        held, self._held = self._held, b""
        self.slow = self.broken is not None
        return self._before_error(held) if held else held

    def _before_error(self, whole: bytes) -> bytes:
        """`whole` up to the engine's error. An engine sends it last (then at most [DONE]): a
        choice finishing in error (the last finish reason: a migratable call has one choice),
        or an error event. So only from there is `"error"` searched, and each hit parsed (it
        may be in a token's text): a stream of many events costs a few short searches."""
        # At or before the start of the last event (before [DONE]: `data:`, at least 5 bytes
        # more): past the blank line before it. A stream with CR line ends finds none and is
        # searched whole, which is slower, not wrong.
        end = len(whole) - (len(_DONE) + 7 if whole.endswith(_DONE) else 2)
        low = max(0, whole.rfind(b"\n\n", 0, max(0, end)))
        at = whole.rfind(_FINISH)
        if at >= 0 and whole.startswith(b'error"', at + len(_FINISH)):
            low = min(low, at)
        pos = low
        while (at := whole.find(ERROR_MARK, pos)) >= 0:
            start = last_boundary(whole, at)
            end = next_boundary(whole, at)
            end = len(whole) if end < 0 else end
            event = event_json(whole[start:end])
            if event is not None:
                why = _error_in(event)
                if why is not None:
                    self.broken = why
                    self._held = b""
                    return whole[:start]
            pos = end
        return whole

    def _fold(self) -> None:
        """Raw events into their text pieces (and the flags a continuation needs)."""
        if not self.chunks:
            return
        joined = b"".join(self.chunks)
        self.chunks.clear()
        self.size = 0
        self._pieces.extend(_TEXT[self._shape].findall(joined))
        self._tools = self._tools or joined.find(_TOOL_CALL) >= 0
        self._finished = self._finished or _finished(joined)

    def summary(self) -> Summary:
        self._fold()
        raw = b"".join(self._pieces)
        text = json.loads(b'"' + raw + b'"') if raw else ""
        head = event_json(self.head[: max(0, next_boundary(self.head, 0))] or self.head)
        return Summary(text, head, self._tools, self._finished)


def _finished(joined: bytes) -> bool:
    """A choice finished (stop, length, tool_calls; an error finish is a break, not an end)."""
    at = joined.find(_FINISH)
    while at >= 0:
        if not joined.startswith(b'error"', at + len(_FINISH)):
            return True
        at = joined.find(_FINISH, at + 1)
    return False


def _error_in(event: dict[str, object]) -> str | None:
    if "error" in event and "choices" not in event:
        return "error_event"
    choices = event.get("choices")
    if isinstance(choices, list):
        for c in choices:
            if isinstance(c, dict) and c.get("finish_reason") == "error":
                return "finish_error"
    return None
