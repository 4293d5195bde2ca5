"""The Batch API's files under `batch.storage_dir`: uploads, a job's checked input, its results.

Nothing here holds a whole file: an upload is written as it streams in (refused the moment it
passes `batch.max_file_bytes`), a job's input is checked line by line and leaves an index of
8-byte line offsets (`<job>.idx`) so a replica reads any line with two seeks, and results are
appended, one line per write, to a part file per replica (`<job>.<replica>.part`). A job's
output and error files are written from the parts once it ends, each custom_id once.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import AsyncIterator, Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from router.batch.upload import Form, read_form, writer
from router.core.backend import Backend
from router.core.endpoints import BATCH_URLS

URLS = frozenset(BATCH_URLS)
_OFF = struct.Struct("<Q")


class BadFile(Exception):
    """The file cannot be a job's input: `line` (1-based, 0: the file as a whole) and why."""

    def __init__(self, message: str, line: int = 0, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.param = param


class TooBig(Exception):
    """An upload past `batch.max_file_bytes`."""


@dataclass(frozen=True, slots=True)
class Checked:
    lines: int
    model: str


class Storage:
    def __init__(self, root: str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> Path:
        return self.root / name

    async def save(self, name: str, chunks: AsyncIterator[bytes], boundary: str, most: int) -> Form:
        """The form's `file` written as it comes, its other fields kept; `TooBig` past `most`
        bytes and `BadUpload` for a form it cannot read, with nothing left behind either way."""
        tmp = self.path(name + ".tmp")
        try:
            # Each chunk written as it comes (a page cache write), no thread hop per chunk.
            with open(tmp, "wb") as out:  # noqa: ASYNC230
                form = await read_form(
                    chunks,
                    boundary,
                    "file",
                    writer(out, most, lambda: TooBig(f"The file is larger than {most} bytes.")),
                )
            os.replace(tmp, self.path(name))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return form

    def share(self, name: str, as_name: str) -> None:
        """`name` also as `as_name`: a hard link, or a copy where the volume has none."""
        try:
            os.link(self.path(name), self.path(as_name))
        except OSError:
            shutil.copyfile(self.path(name), self.path(as_name))

    def remove(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def check(
        self,
        file_name: str,
        index_name: str,
        endpoint: str,
        max_lines: int,
        max_line_bytes: int,
        by_model: Mapping[str, tuple[Backend, ...]],
        allowed: Set[str] | None,
    ) -> Checked:
        """Every line a valid request to `endpoint` for one model the key may use, custom_ids
        unique; writes the index of line offsets. Raises `BadFile` naming the first bad line."""
        seen: set[str] = set()
        model: str | None = None
        n = 0
        tmp = self.path(index_name + ".tmp")
        try:
            with open(self.path(file_name), "rb") as src, open(tmp, "wb") as idx:
                offset = 0
                while True:
                    raw = src.readline(max_line_bytes + 2)
                    if not raw:
                        break
                    start, offset = offset, offset + len(raw)
                    if not raw.strip():
                        continue
                    n += 1
                    if n > max_lines:
                        raise BadFile(f"The file has more than {max_lines} requests.", n)
                    if len(raw.rstrip(b"\r\n")) > max_line_bytes:
                        raise BadFile(f"Line {n} is longer than {max_line_bytes} bytes.", n)
                    line = _parse(raw, n)
                    cid, url, body = line["custom_id"], line["url"], line["body"]
                    if url != endpoint:
                        raise BadFile(
                            f"Line {n}: url {str(url)[:100]!r} is not the batch's endpoint "
                            f"{endpoint!r}.",
                            n,
                            "url",
                        )
                    if cid in seen:
                        raise BadFile(f"Line {n}: custom_id {cid[:100]!r} is not unique.", n)
                    seen.add(cid)
                    m = body.get("model")
                    if not isinstance(m, str) or not m:
                        raise BadFile(f"Line {n}: body.model is missing.", n, "body.model")
                    if model is None:
                        model = m
                    elif m != model:
                        raise BadFile(
                            f"Line {n}: every request of a batch names one model ({model!r}).",
                            n,
                            "body.model",
                        )
                    if m not in by_model or (allowed is not None and m not in allowed):
                        raise BadFile(
                            f"Line {n}: the model {m[:100]!r} does not exist or you do not "
                            "have access to it.",
                            n,
                            "body.model",
                        )
                    if body.get("stream"):
                        raise BadFile(f"Line {n}: streaming is not supported.", n, "body.stream")
                    idx.write(_OFF.pack(start))
            if n == 0 or model is None:
                raise BadFile("The file holds no requests.")
            os.replace(tmp, self.path(index_name))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return Checked(n, model)

    def line(self, file_name: str, index_name: str, i: int, most: int) -> dict[str, Any]:
        """Line `i` (0-based) of a checked file."""
        with open(self.path(index_name), "rb") as idx:
            idx.seek(i * _OFF.size)
            (start,) = _OFF.unpack(idx.read(_OFF.size))
        with open(self.path(file_name), "rb") as src:
            src.seek(start)
            return dict(json.loads(src.readline(most + 2)))

    def append(self, part_name: str, line: bytes) -> None:
        """One result line, in one write, on disk before its claim in Redis."""
        fd = os.open(self.path(part_name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def write_results(
        self, job_id: str, file_name: str, index_name: str, marked: dict[str, Any] | None
    ) -> tuple[int, int, int, int]:
        """The output (2xx answers) and error files of a job from its parts, each custom_id
        once; with `marked`, every line that has no result gets one (that error). Returns the
        bytes of the output and the error file, and the lines in each."""
        seen: set[str] = set()
        out_name, err_name = f"{job_id}.output", f"{job_id}.errors"
        sizes = [0, 0]
        counts = [0, 0]
        with (
            open(self.path(out_name + ".tmp"), "wb") as out,
            open(self.path(err_name + ".tmp"), "wb") as err,
        ):
            for part in sorted(self.root.glob(f"{job_id}.*.part")):
                with open(part, "rb") as src:
                    for raw in src:
                        if not raw.endswith(b"\n"):
                            continue  # a write cut short by a crash: its line runs again
                        row = json.loads(raw)
                        cid = row["custom_id"]
                        if cid in seen:
                            continue
                        seen.add(cid)
                        good = row.get("error") is None and 200 <= _status(row) < 300
                        (out if good else err).write(raw)
                        sizes[0 if good else 1] += len(raw)
                        counts[0 if good else 1] += 1
            if marked is not None:
                with open(self.path(file_name), "rb") as src:
                    for raw in src:
                        if not raw.strip():
                            continue
                        cid = json.loads(raw)["custom_id"]
                        if cid in seen:
                            continue
                        row = {
                            "id": f"batch_req_{job_id[6:]}_{len(seen)}",
                            "custom_id": cid,
                            "response": None,
                            "error": marked,
                        }
                        seen.add(cid)
                        b = json.dumps(row).encode() + b"\n"
                        err.write(b)
                        sizes[1] += len(b)
                        counts[1] += 1
        os.replace(self.path(out_name + ".tmp"), self.path(out_name))
        os.replace(self.path(err_name + ".tmp"), self.path(err_name))
        for part in self.root.glob(f"{job_id}.*.part"):
            part.unlink(missing_ok=True)
        self.remove(index_name)
        return sizes[0], sizes[1], counts[0], counts[1]


def _status(row: dict[str, Any]) -> int:
    response = row.get("response")
    if isinstance(response, dict) and isinstance(response.get("status_code"), int):
        return int(response["status_code"])
    return 0


def _parse(raw: bytes, n: int) -> dict[str, Any]:
    try:
        line = json.loads(raw)
    except ValueError:
        raise BadFile(f"Line {n} is not valid JSON.", n) from None
    if not isinstance(line, dict):
        raise BadFile(f"Line {n} is not a JSON object.", n)
    cid = line.get("custom_id")
    if not isinstance(cid, str) or not cid or len(cid) > 512:
        raise BadFile(f"Line {n}: custom_id must be a string of 1 to 512 characters.", n)
    if line.get("method") != "POST":
        raise BadFile(f"Line {n}: method must be POST.", n, "method")
    url = line.get("url")
    if url not in URLS:
        raise BadFile(
            f"Line {n}: url {str(url)[:100]!r} is not one of {', '.join(sorted(URLS))}.", n, "url"
        )
    if not isinstance(line.get("body"), dict):
        raise BadFile(f"Line {n}: body must be a JSON object.", n, "body")
    return line
