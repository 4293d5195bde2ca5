"""A `multipart/form-data` upload read as it streams: the `file` part goes straight to a file,
the other fields (`purpose`) are kept, each at most `MAX_FIELD` bytes.

What a client can make this hold is bounded: the bytes kept between chunks are at most a part's
header block (`MAX_PART_HEADER`) or the boundary's length, a form has at most `MAX_PARTS` parts,
and the file's bytes are refused past the caller's limit (`TooBig`, raised by its writer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import BinaryIO

from router.request.wire.multipart import MAX_PART_HEADER, MAX_PARTS

MAX_FIELD = 1024


class BadUpload(ValueError):
    """Not a form this endpoint reads: why, for the client's 400."""


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0


def _disposition(head: bytes) -> tuple[str, str | None]:
    """The part's `name` and `filename` from its headers."""
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() != b"content-disposition":
            continue
        params: dict[str, str] = {}
        for item in value.decode("utf-8", "replace").split(";")[1:]:
            k, _, v = item.strip().partition("=")
            params[k.strip().lower()] = v.strip().strip('"')
        if "name" not in params:
            break
        return params["name"], params.get("filename")
    raise BadUpload("A form part has no Content-Disposition name.")


async def read_form(
    chunks: AsyncIterator[bytes],
    boundary: str,
    file_field: str,
    write: Callable[[bytes], None],
) -> Form:
    """Read the form from `chunks`; the `file_field` part's bytes go to `write`."""
    delim = b"\r\n--" + boundary.encode("latin-1")
    form = Form()
    buf = b"\r\n"  # the first boundary has no CRLF before it: one is lent
    state = "preamble"
    part: str | None = None
    value = bytearray()
    parts = 0
    async for chunk in chunks:
        buf += chunk
        while True:
            if state in ("preamble", "data"):
                at = buf.find(delim)
                if at < 0:
                    keep = len(delim)
                    if state == "data" and len(buf) > keep:
                        _take(form, part, file_field, buf[:-keep], write, value)
                    buf = buf[-keep:]
                    break
                if state == "data":
                    _take(form, part, file_field, buf[:at], write, value)
                    if part is not None and part != file_field:
                        form.fields[part] = value.decode("utf-8", "replace")
                buf = buf[at + len(delim) :]
                state = "boundary"
            if state == "boundary":
                if len(buf) < 2:
                    break
                if buf.startswith(b"--"):
                    if form.filename is None:
                        raise BadUpload(f"The form has no `{file_field}` file.")
                    return form
                if not buf.startswith(b"\r\n"):
                    raise BadUpload("The form's boundary is not followed by a line end.")
                buf = buf[2:]
                state = "headers"
            if state == "headers":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_PART_HEADER:
                        raise BadUpload("A form part's headers are too long.")
                    break
                parts += 1
                if parts > MAX_PARTS:
                    raise BadUpload("The form has too many parts.")
                part, filename = _disposition(buf[:end])
                if part == file_field:
                    if form.filename is not None:
                        raise BadUpload(f"The form has two `{file_field}` parts.")
                    form.filename = (filename or "upload.jsonl")[:256]
                value = bytearray()
                buf = buf[end + 4 :]
                state = "data"
    raise BadUpload("The form ended before its closing boundary.")


def _take(
    form: Form,
    part: str | None,
    file_field: str,
    data: bytes,
    write: Callable[[bytes], None],
    value: bytearray,
) -> None:
    if not data:
        return
    if part == file_field:
        form.size += len(data)
        write(data)
        return
    value += data
    if len(value) > MAX_FIELD:
        raise BadUpload(f"The form field `{part}` is longer than {MAX_FIELD} bytes.")


def boundary_from(content_type: str | None) -> str:
    if content_type is None or not content_type.lower().startswith("multipart/form-data"):
        raise BadUpload("Upload the file as multipart/form-data.")
    for item in content_type.split(";")[1:]:
        k, _, v = item.strip().partition("=")
        if k.lower() == "boundary" and 0 < len(v.strip('"')) <= 200:
            return v.strip('"')
    raise BadUpload("The form has no boundary.")


def writer(out: BinaryIO, most: int, too_big: Callable[[], Exception]) -> Callable[[bytes], None]:
    """Writes to `out`, raising `too_big()` once more than `most` bytes came."""
    total = 0

    def write(data: bytes) -> None:
        nonlocal total
        total += len(data)
        if total > most:
            raise too_big()
        out.write(data)

    return write
