"""The few fields of a `multipart/form-data` body the router reads (audio uploads): `model`,
`stream`. The body is never re-framed: a field's value is found by its span, and an alias'
model id is spliced into that span, every other byte (the audio file too) left as it came.

Only the part headers are looked at; the file's bytes are skipped with `bytes.find` for the
next boundary (C speed, whatever their size). A body that is not well-formed multipart has no
fields here past the point where it stops being so; the backend then answers it as it would.

What a client can make this spend is bounded, as an HTTP server bounds a request head: a part's
header block is at most `MAX_PART_HEADER` bytes (8 KiB, nginx's and uvicorn's line limit), its
`Content-Disposition` at most `MAX_PARAMS` parameters, and a form at most `MAX_PARTS` parts
(Starlette's own default: 1000 fields). Past any of them the form is refused (`BadForm`): the
work per part is then a few C-speed scans of at most 8 KiB and a loop of at most 16 steps.

The engine reads the form with another parser (python-multipart, whose parameters are the
standard library's `email` rules), so a form these two could read differently is refused, not
routed by the router's reading: a wanted field given twice (common parsers keep the last, the
router would route by the first), a part with two `Content-Disposition` headers or two `name`
parameters, and a `name*` (RFC 2231) name.
"""

from __future__ import annotations

import re

MAX_PART_HEADER = 8192
MAX_PARAMS = 16
MAX_PARTS = 1000

# A header line starts after CRLF: python-multipart ends a header value at CR only, so a bare LF
# does not start a line for it, nor here. Searched for in the lowercased header.
_DISPOSITION = b"\r\ncontent-disposition:"
# `email.utils.rfc2231_continuation`: `name*`, `name*0`, `name*0*` all set `name`.
_RFC2231 = re.compile(r"^(\w+)\*((?P<num>[0-9]+)\*?)?$", re.ASCII)


class BadForm(ValueError):
    """A form the router refuses to read: `code` for the client's error."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def boundary_of(content_type: str | None) -> bytes | None:
    """The boundary of a `multipart/form-data` content type, else None."""
    if not content_type:
        return None
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        return None
    for param in params.split(";"):
        name, _, value = param.strip().partition("=")
        if name.lower() == "boundary":
            value = value.strip().strip('"')
            if 0 < len(value) <= 70:
                return value.encode("latin-1", "replace")
    return None


def form_fields(body: bytes, boundary: bytes, wanted: frozenset[str]) -> dict[str, tuple[int, int]]:
    """The span (start, end) of each `wanted` plain field's value in `body`. Raises `BadForm`
    for a form past the bounds, or one another parser could read otherwise."""
    delim = b"--" + boundary
    found: dict[str, tuple[int, int]] = {}
    seen: set[str] = set()
    parts = 0
    pos = body.find(delim)
    while pos >= 0:
        start = pos + len(delim)
        if body[start : start + 2] == b"--":
            break  # the closing boundary
        parts += 1
        if parts > MAX_PARTS:
            raise BadForm(f"The form has more than {MAX_PARTS} parts.", "too_many_parts")
        head_end = body.find(b"\r\n\r\n", start, start + MAX_PART_HEADER + 4)
        if head_end < 0:
            if len(body) - start < MAX_PART_HEADER + 4:
                break  # cut short: not a form
            raise BadForm(
                f"A part's header exceeds {MAX_PART_HEADER} bytes.", "part_header_too_large"
            )
        value_start = head_end + 4
        end = body.find(b"\r\n" + delim, value_start)
        if end < 0:
            break
        named = _part_name(body, start, head_end)
        if named is not None:
            name, is_file = named
            if name in wanted:
                if name in seen:
                    raise BadForm(f"The form has more than one `{name}` field.", "duplicate_field")
                seen.add(name)
                if not is_file:
                    found[name] = (value_start, end)
        pos = end + 2
    return found


def _part_name(body: bytes, start: int, head_end: int) -> tuple[str, bool] | None:
    """The part's name and whether it is a file (it has a `filename`), None without a name.
    Its `Content-Disposition` parameters are read as python-multipart reads them, by the
    standard library's `email` rules (`_parseparam`, `decode_params`, `unquote`), in one pass.
    `start` is where the boundary line's CRLF (or padding) begins: every header line of the
    part starts after a CRLF."""
    head = body[start:head_end].lower()  # at most 8 KiB; then C-speed searches of it
    at = head.find(_DISPOSITION)
    if at < 0:
        return None
    if head.find(_DISPOSITION, at + 1) >= 0:
        raise BadForm("A part has more than one Content-Disposition header.", "invalid_form")
    at += len(_DISPOSITION)
    end = head.find(b"\r", at)  # python-multipart ends a header value at CR
    value = body[start + at : start + end if end >= 0 else head_end].decode("latin-1")
    if value.count(";") > MAX_PARAMS:
        raise BadForm(
            f"A part's Content-Disposition has more than {MAX_PARAMS} parameters.",
            "invalid_form",
        )
    # A ';' inside a quoted string does not end a parameter; the quotes are counted as
    # `email._parseparam` counts them (an escaped quote is none). The first is the type.
    pieces: list[str] = []
    held: str | None = None
    odd = False
    escapes = "\\" in value
    for raw in value.split(";"):
        held = raw if held is None else held + ";" + raw
        quotes = raw.count('"') - (raw.count('\\"') if escapes else 0)
        odd ^= quotes % 2 == 1
        if not odd:
            pieces.append(held)
            held = None
    if held is not None:
        pieces.append(held)  # an unclosed quote runs to the end
    name: str | None = None
    is_file = False
    for piece in pieces[1:]:
        key, eq, val = piece.partition("=")
        key = key.strip().lower() if eq else piece.strip()  # a bare attribute keeps its case
        encoded = _RFC2231.match(key) if "*" in key else None
        if encoded is not None:
            key = encoded.group(1)
        if key == "name":
            if name is not None or encoded is not None:
                raise BadForm("A part's name is given more than once or encoded.", "invalid_form")
            name = _unquote(val.strip())
        elif key == "filename":
            is_file = True
    return (name, is_file) if name is not None else None


def _unquote(value: str) -> str:
    """`email.utils.unquote`."""
    if len(value) > 1:
        if value.startswith('"') and value.endswith('"'):
            return value[1:-1].replace("\\\\", "\\").replace('\\"', '"')
        if value.startswith("<") and value.endswith(">"):
            return value[1:-1]
    return value


def replace_span(body: bytes, span: tuple[int, int], value: bytes) -> bytes:
    return body[: span[0]] + value + body[span[1] :]
