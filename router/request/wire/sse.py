"""Server-sent events as bytes: where events end, and what one carries (pure, no I/O).

An event ends at a blank line. Lines may end in LF, CRLF or a lone CR (the SSE grammar allows
all three, mixed), so a blank line is any two line ends in a row: the byte pairs `\\n\\n`, `\\r\\r`
and `\\n\\r`, the event ending after the pair (and after the LF of a CRLF that completes it).
Only `\\r\\n` alone is a single line end.

    next_boundary(buf, at)   end of the event holding `at` (past its blank line), or -1
    last_boundary(buf, at)   start of the event holding `at` (after the blank line before it)
    parse_event(raw)         Event(name, data): the `event:` field and the `data:` lines joined
    event_json(raw)          the data as a JSON object, or None (not JSON, not an object, [DONE])

Used by the usage strip (router/request/usage/strip.py) and by readers of event streams that
need a parsed event rather than a substring (OpenAI chat and completions, Responses, Anthropic).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from router.core.fastjson import loads

_PAIRS = (b"\n\n", b"\r\r", b"\n\r")
_LINE_END = re.compile(rb"\r\n|\r|\n")


def _end_of(buf: bytes, pair_at: int) -> int:
    """The end of a blank line whose two line-end bytes start at `pair_at`; -1 when it ends in
    a CR that is the last byte of `buf` (a LF may follow in the next chunk: not known yet)."""
    end = pair_at + 2
    if buf[pair_at + 1 : end] == b"\r":
        if end == len(buf):
            return -1
        if buf[end : end + 1] == b"\n":
            end += 1  # the second line end is a CRLF
    return end


def next_boundary(buf: bytes, at: int = 0) -> int:
    """Where the event holding position `at` ends (past its blank line), or -1 when it has not
    ended within `buf` (as far as its bytes tell)."""
    best = -1
    limit = len(buf)
    for pair in _PAIRS:
        # Only a pair before the best found so far can end the event sooner: the search stops
        # there, so a kind of line end that is absent does not cost a scan of the whole buffer.
        found = buf.find(pair, at, limit)
        while found >= 0 and _end_of(buf, found) < 0:
            found = buf.find(pair, found + 1, limit)
        if found >= 0 and (best < 0 or found < best):
            best = found
            limit = best + 2
    return _end_of(buf, best) if best >= 0 else -1


def last_boundary(buf: bytes, before: int) -> int:
    """Where the event holding position `before` starts: past the last blank line wholly before
    it (0 when there is none)."""
    start = 0
    for pair in _PAIRS:
        # A blank line ends at most 3 bytes past its first byte: one that starts more than that
        # before the best start found so far cannot give a later one, so the search stops there.
        low = max(0, start - 3)
        found = buf.rfind(pair, low, before)
        while found >= 0 and _end_of(buf, found) < 0:
            found = buf.rfind(pair, low, found)
        if found >= 0:
            start = max(start, min(_end_of(buf, found), before))
    return start


def ends_an_event(buf: bytes) -> bool:
    """`buf` ends exactly where an event ends (not in a CR a LF may still follow)."""
    tail = buf[-4:]
    return bool(tail) and last_boundary(tail, len(tail)) == len(tail)


@dataclass(frozen=True, slots=True)
class Event:
    name: bytes | None  # the `event:` field (Responses, Anthropic); None: a plain message
    data: bytes  # the `data:` lines, joined by LF


def parse_event(raw: bytes) -> Event:
    name: bytes | None = None
    data: list[bytes] = []
    for line in _LINE_END.split(raw):
        if not line or line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value
    return Event(name, b"\n".join(data))


def event_json(raw: bytes) -> dict[str, Any] | None:
    """The event's data as a JSON object, else None."""
    data = parse_event(raw).data
    if not data.startswith(b"{"):
        return None
    try:
        value = loads(data)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
