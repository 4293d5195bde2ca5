"""How an attempt ends when it does not end well, as the lifecycle's steps tell one another.

Retry     it failed before anything reached the client: another backend may serve it
Broken    a migratable stream broke after it began: it may go on on another backend
NoneLeft  no backend is left to try (all excluded, full or unhealthy)
Refusal   a backend refused it in a way another model may not (a prompt over its context, a
          content policy): no other backend of its model is tried
"""

from __future__ import annotations

from router.core.errors import FailureKind, FallbackReason, ProxyError
from router.request.migration.relay import Relayed


class Retry(Exception):
    """An attempt failed before anything reached the client; another backend may serve it."""

    def __init__(
        self,
        error: ProxyError,
        kind: FailureKind,
        response: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None,
        sent: bool = False,
        prefill: str | None = None,
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.kind = kind
        self.response = response  # the upstream's own error answer, forwarded if none is left
        self.sent = sent  # the backend had the request (it broke while working on it)
        # The prefill engine whose leg (or handoff) failed: the next attempt redoes phase 1 on
        # another one, and the decode engine stays a candidate.
        self.prefill = prefill


class Broken(Exception):
    """A migratable stream broke after it began: the attempt loop may continue it elsewhere."""

    def __init__(self, kind: FailureKind, message: str, relay: Relayed, why: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.relay = relay
        self.why = why  # connection, error_event, finish_error, moved


class NoneLeft(Exception):
    """No backend is left to try (all excluded, full or unhealthy)."""


class Refusal(Exception):
    """A backend's 400 that a fallback model may meet (its `reason`), read whole: the answer
    the client gets (`response`) when no fallback model is left."""

    def __init__(
        self, reason: FallbackReason, response: tuple[int, list[tuple[bytes, bytes]], bytes]
    ) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.response = response
