"""Structured logging: one JSON object per line, fields passed as `extra={"fields": {...}}`.

Every line, ours and uvicorn's, goes through `JsonFormatter`, which redacts secrets as the last
step: the exact values the router knows (backend keys, admin token, client keys, Redis password,
collected by `secrets_of(settings)`), values under secret-looking field names, `Bearer` tokens,
`sk-...` keys and passwords in URLs. A secret can reach a log line only by being none of these.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Iterable
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
    read from `api_key_env`), backend header values, and the password of any URL."""
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
                found.extend(str(v) for v in headers.values())
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


def configure(level: str, secrets: Iterable[str] = ()) -> None:
    """JSON lines on stderr for our loggers and uvicorn's; `level` applies to both."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in _OWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.setLevel(level.upper())
        logger.propagate = True
    logging.Formatter.converter = time.gmtime
