"""Per-key quotas, enforced in this process: `rpm`, `tpm` and `max_parallel` from a key's entry.

`Quotas.admit(limits, estimate)` is called once per request before it is proxied: it refuses with
429 in OpenAI's shape (`rate_limit_exceeded`, `Retry-After`, `x-ratelimit-*`) or reserves one
request, `estimate` tokens and one parallel slot, and returns a `Reservation` whose `close(used)`
(called in the lifecycle's `finally`) frees the slot and corrects the token count with the
tokens the response really used. Windows are sliding 60 s logs of (time, amount) per key: exact,
and bounded (an entry is added only for an admitted request). With several workers or replicas
each enforces the limits on its own traffic (per process); a shared Redis window is future work.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response

from router.core.errors import error_response

WINDOW = 60.0


@dataclass(frozen=True, slots=True)
class KeyLimits:
    key_id: str  # the key's name, or its sha256 when unnamed; never the key
    rpm: int | None = None
    tpm: int | None = None
    max_parallel: int | None = None
    label: str = "unnamed"  # the key's name in metrics


class _Window:
    __slots__ = ("log", "total")

    def __init__(self) -> None:
        self.log: deque[tuple[float, float]] = deque()
        self.total = 0.0

    def used(self, now: float) -> float:
        log = self.log
        while log and log[0][0] <= now - WINDOW:
            self.total -= log.popleft()[1]
        return self.total

    def add(self, now: float, amount: float) -> None:
        self.log.append((now, amount))
        self.total += amount

    def reset_after(self, now: float, need: float, limit: float) -> float:
        """Seconds until `need` more fits under `limit` (entries leave in order)."""
        over = self.total + need - limit
        for t, amount in self.log:
            over -= amount
            if over <= 0:
                return max(0.0, t + WINDOW - now)
        return WINDOW


class _KeyState:
    __slots__ = ("parallel", "requests", "tokens")

    def __init__(self) -> None:
        self.requests = _Window()
        self.tokens = _Window()
        self.parallel = 0


def _duration(seconds: float) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `20ms`."""
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    s = math.ceil(seconds)
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


class Reservation:
    __slots__ = ("_book", "_estimate", "_state", "headers")

    def __init__(
        self, book: Quotas, state: _KeyState, estimate: float, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self._book = book
        self._state: _KeyState | None = state
        self._estimate = estimate
        self.headers = headers  # x-ratelimit-* for the response

    def close(self, used_tokens: float | None) -> None:
        """Idempotent: frees the parallel slot, corrects the token count when known."""
        state, self._state = self._state, None
        if state is None:
            return
        state.parallel -= 1
        if used_tokens is not None and used_tokens != self._estimate:
            state.tokens.add(self._book.clock(), used_tokens - self._estimate)


class Quotas:
    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        self.clock = clock
        self._on_refused = on_refused  # (key label, limit): counts refusals
        self._keys: dict[str, _KeyState] = {}

    def admit(self, limits: KeyLimits, estimate: float, request_id: str) -> Reservation | Response:
        now = self.clock()
        st = self._keys.get(limits.key_id)
        if st is None:
            st = self._keys[limits.key_id] = _KeyState()
        headers: list[tuple[bytes, bytes]] = []
        refusal: tuple[str, float] | None = None
        limit = ""
        if limits.rpm is not None:
            used = st.requests.used(now)
            reset = st.requests.reset_after(now, 1, limits.rpm) if used + 1 > limits.rpm else 0
            if used + 1 > limits.rpm:
                refusal, limit = ("requests per minute", reset), "rpm"
            headers += _headers("requests", limits.rpm, used + (refusal is None), reset, now, st)
        if limits.tpm is not None:
            used = st.tokens.used(now)
            # A request bigger than the whole limit waits for an empty window, not forever.
            need = min(estimate, limits.tpm)
            over = used + need > limits.tpm
            reset = st.tokens.reset_after(now, need, limits.tpm) if over else 0
            if over and refusal is None:
                refusal, limit = ("tokens per minute", reset), "tpm"
            taken = used + (estimate if refusal is None else 0)
            headers += _headers("tokens", limits.tpm, taken, reset, now, st)
        if (
            refusal is None
            and limits.max_parallel is not None
            and st.parallel >= limits.max_parallel
        ):
            refusal, limit = ("parallel requests", 1.0), "max_parallel"
        if refusal is not None:
            what, reset = refusal
            if self._on_refused is not None:
                self._on_refused(limits.label, limit)
            headers.append((b"retry-after", str(max(1, math.ceil(reset))).encode()))
            headers.append((b"x-request-id", request_id.encode()))
            out = error_response(
                429,
                f"Rate limit reached for {what} on this key; retry after {_duration(reset)}.",
                "rate_limit_exceeded",
                "rate_limit_exceeded",
            )
            out.raw_headers.extend(headers)
            return out
        if limits.rpm is not None:
            st.requests.add(now, 1)
        if limits.tpm is not None:
            st.tokens.add(now, estimate)
        st.parallel += 1
        return Reservation(self, st, estimate, headers)


def _headers(
    kind: str, limit: int, used: float, reset: float, now: float, st: _KeyState
) -> list[tuple[bytes, bytes]]:
    window = st.requests if kind == "requests" else st.tokens
    if not reset and window.log:
        reset = max(0.0, window.log[0][0] + WINDOW - now)  # when the oldest use stops counting
    return [
        (f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
        (f"x-ratelimit-remaining-{kind}".encode(), str(max(0, int(limit - used))).encode()),
        (f"x-ratelimit-reset-{kind}".encode(), _duration(reset).encode()),
    ]
