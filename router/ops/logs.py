"""Structured logging: one JSON object per line, fields passed as `extra={"fields": {...}}`.

Logging never blocks the request path: a log call only puts the record on a bounded queue; a
writer thread formats it and writes it to stderr. When the queue is full (stderr stalled, as a
slow container log driver does) the record is dropped and counted (`dropped`, exported as
`sluicegate_log_dropped_total`), never waited for. `stop()` (also at exit) flushes what is queued,
waiting at most a few seconds for a stalled stderr. Records are formatted in the writer, up to
`WRITE_EVERY` later: pass `fields` a fresh dict, not one the caller changes afterwards.

Every line, ours and uvicorn's, goes through `JsonFormatter`, which redacts secrets as the last
step: the exact values the router knows (backend keys, admin token, client keys, Redis password,
collected by `secrets_of(settings)`), values under secret-looking field names, `Bearer` tokens,
`sk-...` keys and passwords in URLs. A secret can reach a log line only by being none of these.

A backend's extra `headers` are mostly ordinary (`x-ms-client-request-source: sluicegate`), so a
header value counts as a secret only when (`secret_header`) its name looks secret (auth, key,
token, secret, password, credential, cookie, signature, session) or the value looks like a
credential: a `Bearer`/`Basic` token, an `sk-` key, or an opaque string of 16+ characters with
no spaces that mixes letters and digits.
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import logging
import os
import re
import select
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, SecretStr

REDACTED = "***"

_SECRET_FIELD = re.compile(
    r"(?i)^(authorization|proxy-authorization|cookie|set-cookie"
    r"|(.*[_-])?(api[_-]?key|token|secret|password|credentials?))$"
)


@functools.lru_cache(maxsize=1024)  # field names come from code: a small, fixed set
def _secret_field(name: str) -> bool:
    return _SECRET_FIELD.match(name) is not None


_SECRET_HEADER_NAME = re.compile(
    r"(?i)(auth|key|token|secret|passw|credential|cookie|signature|session)"
)
_CREDENTIAL_VALUE = re.compile(r"(?i)^(bearer|basic)\s+\S|^sk-[A-Za-z0-9_-]{8,}$")
_OPAQUE_VALUE = re.compile(r"^(?=.*[A-Za-z])(?=.*[0-9])\S{16,}$")


def secret_header(name: str, value: str) -> bool:
    """Is a configured header's value a secret to redact? (The rule is in the docstring.)"""
    return bool(
        _SECRET_HEADER_NAME.search(name)
        or _CREDENTIAL_VALUE.search(value)
        or _OPAQUE_VALUE.match(value)
    )


# (cheap substring that must be present, pattern, replacement): the substring test keeps the
# regex off the ordinary line, which has none of these.
_PATTERNS = (
    ("bearer", re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]{4,}"), r"\1 " + REDACTED),
    ("basic", re.compile(r"(?i)\b(basic)\s+[A-Za-z0-9._~+/=-]{4,}"), r"\1 " + REDACTED),
    ("sk-", re.compile(r"\bsk-[A-Za-z0-9_-]{8,}"), REDACTED),
    ("@", re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]*:[^/\s@]+@"), r"\1" + REDACTED + "@"),
)
# Short values (e.g. "1", "true") would shred ordinary text; real keys are longer than this.
_MIN_SECRET_LEN = 6

# Loggers whose lines we own; third-party ones stay at WARNING (httpx logs full URLs at INFO).
# uvicorn.access is left as uvicorn sets it (off: the router writes its own line per request).
_OWN_LOGGERS = ("sluicegate", "uvicorn", "uvicorn.error")


class JsonFormatter(logging.Formatter):
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets: list[str] = []
        self.add(*secrets)

    def add(self, *secrets: str) -> None:
        known = {*self.secrets, *(s for s in secrets if s and len(s) >= _MIN_SECRET_LEN)}
        # json.dumps escapes some characters; look for the escaped form too.
        known |= {e for s in known if (e := json.dumps(s)[1:-1]) != s}
        self.secrets = sorted(known, key=len, reverse=True)  # longest first: no partial hits

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,  # which worker, when there are several
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                out[key] = REDACTED if value and _secret_field(str(key)) else value
        if record.exc_info and record.exc_info[0] is not None:
            # Type and where, never the message: exception text can carry URLs, headers, bodies.
            out["exc_type"] = record.exc_info[0].__name__
            out["exc_at"] = [
                f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                for f in traceback.extract_tb(record.exc_info[2], limit=-6)
            ]
        return self.redact(json.dumps(out, default=str))

    def redact(self, line: str) -> str:
        for secret in self.secrets:
            if secret in line:
                line = line.replace(secret, REDACTED)
        lower = line.lower()
        for needle, pattern, repl in _PATTERNS:
            if needle in lower:
                line = pattern.sub(repl, line)
        return line


def secrets_of(settings: BaseModel) -> list[str]:
    """Every secret value in the settings: SecretStr fields anywhere, backend keys (also those
    read from `api_key_env`), secret-looking backend header values, and the password of any
    URL."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, SecretStr):
            raw = value.get_secret_value()
            found.append(raw)
            match = re.search(r"://[^/\s:@]*:([^/\s@]+)@", raw)
            if match:
                found.append(match.group(1))
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name, None))
            resolved = getattr(value, "resolved_key", None)
            if callable(resolved):
                key = resolved()
                if isinstance(key, str):
                    found.append(key)
            headers = getattr(value, "headers", None)
            if isinstance(headers, dict):
                found.extend(str(v) for k, v in headers.items() if secret_header(str(k), str(v)))
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list | tuple | set | frozenset):
            for v in value:
                walk(v)

    walk(settings)
    return [s for s in found if s]


def register_secret(*values: str) -> None:
    """Redact secrets learned at run time too (e.g. a backend key given to the admin API)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            handler.formatter.add(*values)


# Records waiting for the writer: about a minute of a busy router's lines, a few MB at most.
QUEUE_SIZE = 10_000
FLUSH_TIMEOUT = 3.0
# The writer wakes this often and writes everything waiting in one go: no thread wake-up or
# write per record (handing each record to a waiting thread cost ~14 % more router CPU per
# request than writing inline; batches cost less than inline).
WRITE_EVERY = 0.05


class _QueuedHandler(logging.Handler):
    """Appends records to a bounded deque without waiting (drops and counts what does not
    fit); a writer thread formats and writes them in batches straight to a file descriptor, so a
    write stuck on a stalled pipe holds no Python-level lock and the interpreter can still exit."""

    def __init__(self, fd: int | None, stream: Any = None, maxsize: int = QUEUE_SIZE) -> None:
        super().__init__()
        self.pending: collections.deque[logging.LogRecord] = collections.deque()
        self.maxsize = maxsize
        self.dropped = 0
        self.on_drop: Callable[[], None] | None = None
        self._fd = fd
        self._stream = stream
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluicegate-log", daemon=True)
        self._thread.start()

    def createLock(self) -> None:
        # deque.append is atomic; without a lock, logging.shutdown() cannot hang on one.
        self.lock = None

    def emit(self, record: logging.LogRecord) -> None:
        if self._stopping.is_set() and not self._thread.is_alive():
            self._write_now(record)
            return
        if len(self.pending) >= self.maxsize:
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop()
            return
        # Pin the message now: its arguments may change after the call returns.
        record.msg = record.getMessage()
        record.args = None
        self.pending.append(record)

    def _run(self) -> None:
        while not self._stopping.wait(WRITE_EVERY):
            self._write_pending()
        self._write_pending()

    def _write_pending(self) -> None:
        while self.pending:
            lines: list[str] = []
            while self.pending and len(lines) < 1000:
                record = self.pending.popleft()
                try:
                    lines.append(self.format(record))
                except Exception:
                    self.handleError(record)
            if not lines:
                continue
            data = ("\n".join(lines) + "\n").encode("utf-8", "replace")
            try:
                if self._fd is not None:
                    while data:
                        data = data[os.write(self._fd, data) :]
                else:
                    self._stream.write(data.decode("utf-8"))
                    self._stream.flush()
            except OSError:
                pass  # stderr is gone: nowhere left to say so

    def _write_now(self, record: logging.LogRecord) -> None:
        # After stop(): the process is on its way out (a uvicorn worker may then end by its
        # re-raised SIGTERM, with no atexit), so write at once, if that cannot block.
        try:
            line = (self.format(record) + "\n").encode("utf-8", "replace")
            if self._fd is None:
                self._stream.write(line.decode("utf-8"))
                self._stream.flush()
            elif len(line) <= select.PIPE_BUF and select.select([], [self._fd], [], 0)[1]:
                os.write(self._fd, line)  # writable: at least PIPE_BUF free, written whole
            else:
                self.dropped += 1
        except Exception:
            self.dropped += 1

    def stop(self) -> None:
        """Write what is queued, waiting at most FLUSH_TIMEOUT for a stalled stderr; records
        logged afterwards are written at once when that cannot block, else dropped."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(FLUSH_TIMEOUT)
        if not self._thread.is_alive():
            # Appended by another thread after the writer's last pass: written, not lost.
            while self.pending:
                self._write_now(self.pending.popleft())


def count_drops(callback: Callable[[], None]) -> None:
    """Call `callback` for every record dropped from now on, after once per earlier drop."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _QueuedHandler):
            for _ in range(handler.dropped):
                callback()
            handler.on_drop = callback


def stop() -> None:
    """Flush and stop the writer (bounded wait); later records are written at once when that
    cannot block (the process is ending), else dropped. At exit, and at the app's shutdown."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _QueuedHandler):
            handler.stop()


def configure(level: str, secrets: Iterable[str] = ()) -> None:
    """JSON lines on stderr for our loggers and uvicorn's; `level` applies to both."""
    stop()  # a previous configure() in this process (e.g. `serve`, then the app factory)
    formatter = JsonFormatter(secrets)
    try:
        sys.stderr.flush()
        handler = _QueuedHandler(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # not a real file (e.g. captured)
        handler = _QueuedHandler(None, sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in _OWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.setLevel(level.upper())
        logger.propagate = True
    logging.Formatter.converter = time.gmtime
    # What the JSON line never shows, not gathered per record (the logging HOWTO's
    # "Optimization"): the caller's file and line (a stack walk), thread and process names.
    # `pid` stays. Half of a record's cost on the event loop: ~20 us -> ~11 us a line.
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False


atexit.register(stop)
