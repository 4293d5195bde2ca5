"""The few fields of a `multipart/form-data` body the router reads (audio uploads): `model`,
`stream`. The body is never re-framed: a field's value is found by its span, and an alias'
model id is spliced into that span, every other byte (the audio file too) left as it came.

Only the part headers are looked at; the file's bytes are skipped with `bytes.find` for the
next boundary (C speed, whatever their size). A body that is not well-formed multipart has no
fields here; the backend then answers it as it would.
"""

from __future__ import annotations

import re

_NAME = re.compile(rb'(?i)content-disposition:[^\r\n]*;\s*name="([^"]{1,64})"')


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
    """The span (start, end) of each `wanted` plain field's value in `body`."""
    delim = b"--" + boundary
    found: dict[str, tuple[int, int]] = {}
    pos = body.find(delim)
    while pos >= 0 and len(found) < len(wanted):
        start = pos + len(delim)
        if body[start : start + 2] == b"--":
            break  # the closing boundary
        head_end = body.find(b"\r\n\r\n", start)
        if head_end < 0:
            break
        value_start = head_end + 4
        end = body.find(b"\r\n" + delim, value_start)
        if end < 0:
            break
        name = _NAME.search(body, start, head_end)
        if name is not None and b"filename=" not in body[start:head_end]:
            key = name.group(1).decode("latin-1")
            if key in wanted and key not in found:
                found[key] = (value_start, end)
        pos = end + 2
    return found


def replace_span(body: bytes, span: tuple[int, int], value: bytes) -> bytes:
    return body[: span[0]] + value + body[span[1] :]
