"""Per-key quotas, enforced in this process: `rpm`, `tpm` and `max_parallel` from a key's entry.

`Quotas.admit(limits, estimate)` is called once per request before it is proxied: it refuses
(raises `RateLimited`, a 429: `rate_limit_exceeded`, `Retry-After`, `x-ratelimit-*`; a request
whose estimate alone exceeds the key's whole `tpm` is `request_too_large`, without `Retry-After`:
no window ever admits it) or reserves one request, `estimate` tokens and one parallel slot, and
returns a `Reservation` whose `close(used)` (called in the lifecycle's `finally`) frees the slot
and corrects the token count with the tokens the response really used. Windows slide over 1 s
sub-buckets, the same as the shared form in Redis (`quota_shared.py`, which says why): a use stops
counting 61 s after its bucket began, so no 60 s ever sees more than the limit; memory is a few
dozen buckets per key whatever the traffic (a log of every request held ~360k entries at 2k
requests/s and cost CPU in cache misses and allocation). Without Redis each worker and replica
enforces the limits on its own traffic (per process); with Redis this is the fallback, fed each
process's share.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from router.core.errors import RateLimited

BUCKETS = 61  # 1 s sub-buckets a use counts in: 60 s plus the one it began in


@dataclass(frozen=True, slots=True)
class KeyLimits:
    key_id: str  # the key's name, or its sha256 when unnamed; never the key
    rpm: int | None = None
    tpm: int | None = None
    max_parallel: int | None = None
    label: str = "unnamed"  # the key's name in metrics


class Hold(Protocol):
    """What an admitted request holds: its response's `x-ratelimit-*` headers, and `close`."""

    headers: list[tuple[bytes, bytes]]

    def close(self, used_tokens: float | None) -> None: ...


class QuotaBook(Protocol):
    """Per process (`Quotas`) or shared through Redis (`quota_shared.SharedQuotas`)."""

    kind: str

    async def admit(self, limits: KeyLimits, estimate: int, request_id: str) -> Hold:
        """A hold on one request, its estimate and a slot; raises `RateLimited` (429)."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def status(self) -> dict[str, Any] | None:
        """For /readyz details (None: nothing to say)."""
        ...

    def in_use(self, key_id: str) -> tuple[float, float, int]:
        """Requests and tokens in the key's window and requests in flight, this process's view."""
        ...


class _Window:
    """(second, amount) buckets, oldest first, and their total."""

    __slots__ = ("buckets", "total")

    def __init__(self) -> None:
        self.buckets: deque[list[float]] = deque()
        self.total: float = 0

    def used(self, sec: int) -> float:
        buckets = self.buckets
        first = sec - BUCKETS + 1
        while buckets and buckets[0][0] < first:
            self.total -= buckets.popleft()[1]
        return self.total

    def add(self, sec: int, amount: float) -> None:
        buckets = self.buckets
        if buckets and buckets[-1][0] == sec:
            buckets[-1][1] += amount
        else:
            buckets.append([sec, amount])
        self.total += amount

    def correct(self, bucket: int, delta: float, sec: int) -> None:
        """Into the bucket the estimate went to while it counts (a refund never outlives the
        estimate); past it, only an overrun is charged, to the current bucket."""
        for entry in reversed(self.buckets):
            if entry[0] == bucket:
                entry[1] += delta
                self.total += delta
                return
            if entry[0] < bucket:
                break
        if delta > 0:
            self.add(sec, delta)

    def reset_after(self, now: float, need: float, limit: float) -> float:
        """Seconds until `need` more fits under `limit` (buckets leave in order)."""
        over = self.total + need - limit
        for sec, amount in self.buckets:
            over -= amount
            if over <= 0:
                return max(0.0, sec + BUCKETS - now)
        return float(BUCKETS)

    def oldest_leaves(self, now: float) -> float:
        return max(0.0, self.buckets[0][0] + BUCKETS - now) if self.buckets else 0.0


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


_NAMES = {
    kind: (
        b"x-ratelimit-limit-" + kind,
        b"x-ratelimit-remaining-" + kind,
        b"x-ratelimit-reset-" + kind,
    )
    for kind in (b"requests", b"tokens")
}


def rate_headers(kind: bytes, limit: int, used: float, reset: float) -> list[tuple[bytes, bytes]]:
    """OpenAI's three `x-ratelimit-*` headers of one limit (`kind`: requests or tokens)."""
    limit_name, remaining_name, reset_name = _NAMES[kind]
    return [
        (limit_name, b"%d" % limit),
        (remaining_name, b"%d" % max(0, int(limit - used))),
        (reset_name, _duration(reset).encode()),
    ]


def refusal(
    what: str, reset: float, headers: list[tuple[bytes, bytes]], request_id: str
) -> RateLimited:
    """The 429 of a full window: `Retry-After`, the limits' headers."""
    headers.append((b"retry-after", b"%d" % max(1, math.ceil(reset))))
    return RateLimited(
        f"Rate limit reached for {what} on this key; retry after {_duration(reset)}.",
        request_id=request_id,
        headers=headers,
    )


def too_large(limits: KeyLimits, estimate: int, request_id: str) -> RateLimited | None:
    """The 429 for a request whose estimate alone exceeds the key's whole tpm (None: it does
    not). Waiting cannot help it, so it gets no Retry-After, and `x-should-retry: false` keeps
    the OpenAI SDKs from retrying it."""
    tpm = limits.tpm
    if tpm is None or estimate <= tpm:
        return None
    return RateLimited(
        f"Request too large for this key: its estimated {estimate} tokens (prompt, stored "
        f"conversation, and max tokens x n for each prompt) exceed the key's whole limit of "
        f"{tpm} tokens per minute, so it can never be admitted. Reduce the input, the max "
        "tokens, n or the number of prompts.",
        code="request_too_large",
        request_id=request_id,
        headers=((b"x-should-retry", b"false"), (b"x-ratelimit-limit-tokens", b"%d" % tpm)),
    )


class Reservation:
    __slots__ = ("_book", "_bucket", "_estimate", "_state", "headers", "on_correct")

    def __init__(
        self,
        book: Quotas,
        state: _KeyState,
        bucket: int,
        estimate: int | None,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        self._book = book
        self._state: _KeyState | None = state
        self._bucket = bucket
        self._estimate = estimate  # None when the key has no tpm: no token window to correct
        self.headers = headers  # x-ratelimit-* for the response
        # Told of each correction (bucket, delta): the shared store's record of what its local
        # share admitted, written to Redis when it answers again.
        self.on_correct: Callable[[int, int], None] | None = None

    def close(self, used_tokens: float | None) -> None:
        """Idempotent: frees the parallel slot, corrects the token count when known."""
        state, self._state = self._state, None
        if state is None:
            return
        state.parallel -= 1
        estimate = self._estimate
        if estimate is not None and used_tokens is not None:
            delta = math.ceil(used_tokens) - estimate  # integers: a correction never rounds
            if delta:
                sec = int(self._book.clock())
                state.tokens.correct(self._bucket, delta, sec)
                if self.on_correct is not None:
                    self.on_correct(self._bucket, delta)


class Quotas:
    kind = "local"

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        self.clock = clock
        self._on_refused = on_refused  # (key label, limit): counts refusals
        self._keys: dict[str, _KeyState] = {}

    async def admit(self, limits: KeyLimits, estimate: int, request_id: str) -> Reservation:
        return self.admit_now(limits, estimate, request_id)

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def status(self) -> dict[str, Any] | None:
        return None

    def in_use(self, key_id: str) -> tuple[float, float, int]:
        """The key's requests and tokens in its current window and its requests in flight, as
        this process counts them (reads; prunes nothing)."""
        st = self._keys.get(key_id)
        if st is None:
            return 0.0, 0.0, 0
        first = int(self.clock()) - BUCKETS + 1
        return (
            sum(a for sec, a in st.requests.buckets if sec >= first),
            sum(a for sec, a in st.tokens.buckets if sec >= first),
            st.parallel,
        )

    def keys(self) -> list[tuple[str, _KeyState]]:
        """Every key's windows (key id, state), for the shared store's write-back."""
        return list(self._keys.items())

    def take(self, limits: KeyLimits, estimate: int) -> Reservation:
        """Count a request admitted elsewhere (by the shared store), unchecked: this process's
        windows then hold its own traffic when it has to enforce its share alone."""
        sec = int(self.clock())
        st = self._keys.get(limits.key_id)
        if st is None:
            st = self._keys[limits.key_id] = _KeyState()
        if limits.rpm is not None:
            st.requests.used(sec)  # drops what has left the window
            st.requests.add(sec, 1)
        if limits.tpm is not None:
            st.tokens.used(sec)
            st.tokens.add(sec, estimate)
        st.parallel += 1
        return Reservation(self, st, sec, estimate if limits.tpm is not None else None, [])

    def admit_now(
        self, limits: KeyLimits, estimate: int, request_id: str, whole_tpm: int | None = None
    ) -> Reservation:
        """`whole_tpm`: the key's whole tpm when `limits` is only this process's share of it
        (None: `limits` is the whole). Raises `RateLimited`."""
        big = too_large(
            limits if whole_tpm is None else KeyLimits(limits.key_id, tpm=whole_tpm),
            estimate,
            request_id,
        )
        if big is not None:
            if self._on_refused is not None:
                self._on_refused(limits.label, "tpm")
            raise big
        now = self.clock()
        sec = int(now)
        st = self._keys.get(limits.key_id)
        if st is None:
            st = self._keys[limits.key_id] = _KeyState()
        headers: list[tuple[bytes, bytes]] = []
        refused: tuple[str, float] | None = None
        limit = ""
        if limits.rpm is not None:
            window = st.requests
            used = window.used(sec)
            if used + 1 > limits.rpm:
                reset = window.reset_after(now, 1, limits.rpm)
                refused, limit = ("requests per minute", reset), "rpm"
            else:
                reset = window.oldest_leaves(now)
                used += 1
            headers += rate_headers(b"requests", limits.rpm, used, reset)
        if limits.tpm is not None:
            window = st.tokens
            used = window.used(sec)
            # Only a share (Redis down) can be smaller than an estimate that passed `too_large`:
            # such a request waits for the share's window to empty, not forever.
            need = min(estimate, limits.tpm)
            if used + need > limits.tpm:
                reset = window.reset_after(now, need, limits.tpm)
                if refused is None:
                    refused, limit = ("tokens per minute", reset), "tpm"
            else:
                reset = window.oldest_leaves(now)
                if refused is None:
                    used += estimate
            headers += rate_headers(b"tokens", limits.tpm, used, reset)
        if (
            refused is None
            and limits.max_parallel is not None
            and st.parallel >= limits.max_parallel
        ):
            refused, limit = ("parallel requests", 1.0), "max_parallel"
        if refused is not None:
            if self._on_refused is not None:
                self._on_refused(limits.label, limit)
            raise refusal(refused[0], refused[1], headers, request_id)
        if limits.rpm is not None:
            st.requests.add(sec, 1)
        if limits.tpm is not None:
            st.tokens.add(sec, estimate)
        st.parallel += 1
        return Reservation(self, st, sec, estimate if limits.tpm is not None else None, headers)
