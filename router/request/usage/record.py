"""What one request did, as one value: written by the lifecycle, read by the log line and metrics.

Filled in as the request goes (backend, status, attempts, time to first byte, bytes sent) and
emitted exactly once when it ends, whatever way it ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from router.request.usage.parse import ResponseUsage

log = logging.getLogger("sluicegate.request")


@dataclass(slots=True)
class RequestRecord:
    """What the one log line per request says."""

    request_id: str
    model: str
    path: str
    stream: bool
    started: float
    backend: str | None = None
    status: int = 0
    attempts: int = 0
    ttfb_ms: float | None = None
    bytes_out: int = 0
    disconnected: bool = False
    error: str | None = None
    key_name: str | None = None  # the client key's configured name, never the key
    # A Batch API line (router/batch/runner.py): its usage is booked by the batch runner, once
    # per line however often it ran, so the lifecycle's `account.book` leaves it out.
    batch: bool = False
    usage: ResponseUsage | None = None  # tokens and their timing, read from the response
    reason: str | None = None  # why the last attempt's backend: prefix, session, load, spill
    prefix_chars: int | None = None  # prompt characters that backend was known to hold
    tokens_estimated: bool | None = None  # usage counted without the backend's own numbers
    migrations: int = (
        0  # times the answer went on on another backend (router/request/migration/policy.py)
    )
    # Prefill/decode (router/request/placement/pd.py): the last attempt's decision (None: not a
    # split model) and the prefill engine its answer followed (None: served whole).
    pd: str | None = None
    prefill_backend: str | None = None
    fallback_from: str | None = None  # the model asked for, when a fallback model served

    def emit(self) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        log.info(
            "request",
            extra={
                "fields": {
                    "request_id": self.request_id,
                    "model": self.model,
                    "path": self.path,
                    "stream": self.stream,
                    "backend": self.backend,
                    "status": self.status,
                    "attempts": self.attempts,
                    "ttfb_ms": self.ttfb_ms,
                    "duration_ms": round((time.perf_counter() - self.started) * 1000, 2),
                    "bytes": self.bytes_out,
                    "disconnected": self.disconnected,
                    "error": self.error,
                    "reason": self.reason,
                    "prefix_chars": self.prefix_chars,
                    "tokens_estimated": self.tokens_estimated,
                    "migrations": self.migrations,
                    "fallback_from": self.fallback_from,
                    "prefill_backend": self.prefill_backend,
                    "disaggregation": self.pd,
                }
            },
        )
