"""Token usage per client key and model in hourly buckets: what `GET /admin/usage` answers.

`record()` runs once per answered request, at its end: a few dict operations, never I/O. Two
books answer the same calls (`UsageStore`): `UsageBook` keeps the buckets in this process (7 days
of hours, at most `MAX_BUCKETS` (hour, key, model) buckets; a bucket past the cap is dropped and
counted); `SharedUsageBook` (`book_shared.py`) collects them to write to Redis, where every
replica's counts are summed. Both count into `HourlyCounts`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

HOUR = 3600
KEEP_HOURS = 7 * 24  # in memory: the last 7 days
REDIS_TTL = 8 * 24 * HOUR  # in Redis: each hour's hash lives 8 days
MAX_BUCKETS = 50_000  # (hour, key, model) buckets held in memory, kept or pending
KINDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "requests", "estimated_requests")

Bucket = tuple[int, str, str]  # hour start (unix), key label, model


class UsageStore(Protocol):
    """Per process (`UsageBook`) or shared through Redis (`book_shared.SharedUsageBook`)."""

    def record(
        self, key: str, model: str, prompt: int, completion: int, cached: int, estimated: bool
    ) -> None: ...

    async def query(
        self, key: str | None = None, model: str | None = None, since: float | None = None
    ) -> list[dict[str, Any]]:
        """Buckets from the hour holding `since` (default: 7 days ago) on, oldest first; a
        shared book raises `StoreUnavailable` while Redis cannot answer."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


class HourlyCounts:
    """(hour, key, model) -> [prompt, completion, cached, requests, estimated], at most
    MAX_BUCKETS. The first record of each hour lets go of buckets older than `keep` seconds
    (counted as dropped when `count_old`: counts never written anywhere)."""

    def __init__(
        self,
        clock: Callable[[], float],
        on_dropped: Callable[[int], None] | None,
        keep: int,
        count_old: bool,
    ) -> None:
        self._clock = clock
        self._on_dropped = on_dropped
        self._keep = keep
        self._count_old = count_old
        self._counts: dict[Bucket, list[int]] = {}
        self._hour = 0  # the hour of the last record: pruning runs when it changes

    def record(
        self, key: str, model: str, prompt: int, completion: int, cached: int, estimated: bool
    ) -> None:
        hour = int(self._clock()) // HOUR * HOUR
        if hour != self._hour:
            self._hour = hour
            self._prune(hour)
        into = self._counts
        bucket = (hour, key, model)
        counts = into.get(bucket)
        if counts is None:
            if len(into) >= MAX_BUCKETS:
                self._dropped(1)
                return
            counts = into[bucket] = [0, 0, 0, 0, 0]
        counts[0] += prompt
        counts[1] += completion
        counts[2] += cached
        counts[3] += 1
        counts[4] += estimated

    def _prune(self, hour: int) -> None:
        book, limit = self._counts, hour - self._keep
        old = [b for b in book if b[0] < limit]
        for b in old:
            del book[b]
        if self._count_old and old:
            self._dropped(len(old))

    def _dropped(self, n: int) -> None:
        if self._on_dropped is not None:
            self._on_dropped(n)

    def first_hour(self, since: float | None, now: int) -> int:
        """The first hour a query answers for: the one holding `since` (default: 7 days before
        `now`), at most as old as Redis keeps."""
        first = int(since if since is not None else now - KEEP_HOURS * HOUR) // HOUR * HOUR
        return max(first, now // HOUR * HOUR - REDIS_TTL)


class UsageBook(HourlyCounts):
    """This process's own buckets, 7 days of them."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        on_dropped: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(clock, on_dropped, keep=KEEP_HOURS * HOUR, count_old=False)

    async def query(
        self, key: str | None = None, model: str | None = None, since: float | None = None
    ) -> list[dict[str, Any]]:
        first = self.first_hour(since, int(self._clock()))
        return rows({b: c for b, c in self._counts.items() if b[0] >= first}, key, model)

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass


def rows(
    counts: dict[Bucket, list[int]], key: str | None, model: str | None
) -> list[dict[str, Any]]:
    """The buckets as `/admin/usage` answers them, filtered, oldest hour first."""
    out = []
    for (hour, k, m), c in sorted(counts.items()):
        if (key is not None and k != key) or (model is not None and m != model):
            continue
        out.append(
            {
                "key": k,
                "model": m,
                "hour": datetime.fromtimestamp(hour, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "hour_unix": hour,
                **dict(zip(KINDS, c, strict=True)),
            }
        )
    return out


def parse_since(value: str) -> float:
    """`since` as unix seconds or ISO-8601 (a naive time is UTC); ValueError otherwise."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        if not text:
            raise ValueError("empty") from None
        stamp = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=UTC)
        seconds = stamp.timestamp()
    if not 0 <= seconds < 1e11:  # NaN and infinities fail this too
        raise ValueError("out of range")
    return seconds
