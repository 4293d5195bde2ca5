"""Token usage per client key and model in hourly buckets: what `GET /admin/usage` answers.

`UsageBook.record()` runs once per answered request, at its end: a few dict operations, never
I/O. Without Redis the buckets live in this process (7 days of hours, at most `MAX_BUCKETS`
(hour, key, model) buckets; a bucket past the cap is dropped and counted). With Redis, records
collect in a pending map that `flush()` (a background task, every `usage_flush` seconds, and
before each read) writes in one MULTI/EXEC round trip: `HINCRBY` into one hash per hour
(`{<redis_prefix>}:usage:<hour start, unix>`, fields `[key, model, kind]` as JSON) and `EXPIRE`
8 days. Redis down: the pending counts stay in memory (merged with newer ones) and are written
when Redis answers again; past `MAX_BUCKETS` pending buckets, or older than 8 days, they are
dropped and counted (`sluicegate_usage_dropped_total`). A flush whose answer is lost after Redis
applied it is written again (counts may then run high, never low).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from router.core.errors import STORE_FAILURES
from router.core.redis_client import Client

HOUR = 3600
KEEP_HOURS = 7 * 24  # in memory: the last 7 days
REDIS_TTL = 8 * 24 * HOUR  # in Redis: each hour's hash lives 8 days
MAX_BUCKETS = 50_000  # (hour, key, model) buckets held in memory, kept or pending
KINDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "requests", "estimated_requests")

log = logging.getLogger("sluicegate.usage")

Bucket = tuple[int, str, str]  # hour start (unix), key label, model


class UsageBook:
    def __init__(
        self,
        redis: Client | None = None,
        prefix: str = "sluicegate",
        clock: Callable[[], float] = time.time,
        on_dropped: Callable[[int], None] | None = None,
        timeout: float = 2.0,
        owns_client: bool = True,  # False: the app's shared client, closed by the app
    ) -> None:
        self._redis = redis
        self._owns_client = owns_client
        self._tag = "{" + prefix + "}:usage:"
        self._clock = clock
        self._on_dropped = on_dropped
        self._timeout = timeout
        self._buckets: dict[Bucket, list[int]] = {}  # without Redis: what /admin/usage reads
        self._pending: dict[Bucket, list[int]] = {}  # with Redis: not written yet
        self._hour = 0  # the hour of the last record: pruning runs when it changes
        self._flushing: asyncio.Lock | None = None
        self._failing = False  # logged once when writes start failing, once when they recover

    @property
    def shared(self) -> bool:
        return self._redis is not None

    def record(
        self, key: str, model: str, prompt: int, completion: int, cached: int, estimated: bool
    ) -> None:
        hour = int(self._clock()) // HOUR * HOUR
        if hour != self._hour:
            self._hour = hour
            self._prune(hour)
        into = self._pending if self._redis is not None else self._buckets
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
        oldest = hour - KEEP_HOURS * HOUR
        for book, limit in ((self._buckets, oldest), (self._pending, hour - REDIS_TTL)):
            old = [b for b in book if b[0] < limit]
            for b in old:
                del book[b]
            if book is self._pending and old:
                self._dropped(len(old))

    def _dropped(self, n: int) -> None:
        if self._on_dropped is not None:
            self._on_dropped(n)

    async def flush(self) -> None:
        """Write the pending counts to Redis in one transaction; on failure keep them."""
        if self._redis is None or not self._pending:
            return
        if self._flushing is None:
            self._flushing = asyncio.Lock()
        async with self._flushing:
            batch, self._pending = self._pending, {}
            if not batch:
                return
            try:
                async with asyncio.timeout(self._timeout):
                    async with self._redis.pipeline(transaction=True) as pipe:
                        hours: set[int] = set()
                        for (hour, key, model), counts in batch.items():
                            name = f"{self._tag}{hour}"
                            hours.add(hour)
                            for kind, n in zip(KINDS, counts, strict=True):
                                if n:
                                    pipe.hincrby(name, json.dumps([key, model, kind]), n)
                        for hour in hours:
                            pipe.expire(f"{self._tag}{hour}", REDIS_TTL)
                        await pipe.execute()
            except STORE_FAILURES as exc:
                self._merge_back(batch)
                if not self._failing:
                    self._failing = True
                    log.warning(
                        "usage not written to Redis; kept in memory until it answers",
                        extra={"fields": {"error": type(exc).__name__, "buckets": len(batch)}},
                    )
                raise
            except asyncio.CancelledError:  # shutdown mid-write: aclose() tries once more
                self._merge_back(batch)
                raise
            if self._failing:
                self._failing = False
                log.info("usage written to Redis again", extra={"fields": {"buckets": len(batch)}})

    def _merge_back(self, batch: dict[Bucket, list[int]]) -> None:
        pending = self._pending
        lost = 0
        for bucket, counts in batch.items():
            have = pending.get(bucket)
            if have is not None:
                for i, n in enumerate(counts):
                    have[i] += n
            elif len(pending) < MAX_BUCKETS:
                pending[bucket] = counts
            else:
                lost += 1
        if lost:
            self._dropped(lost)

    async def flush_round(self) -> None:
        """One round of the background writer (every `usage_flush` s, on the app's runner): a
        Redis failure is logged once by `flush` and its counts wait for the next round."""
        with contextlib.suppress(*STORE_FAILURES):
            await self.flush()

    async def aclose(self) -> None:
        if self._redis is None:
            return
        try:
            await self.flush()  # what this process counted since the last write
        except STORE_FAILURES as exc:
            # No later round: what Redis did not take now is gone (the metric dies with us).
            log.warning(
                "usage not written to Redis at shutdown; lost",
                extra={"fields": {"error": type(exc).__name__, "buckets": len(self._pending)}},
            )
        if self._owns_client:
            await self._redis.aclose()

    async def query(
        self, key: str | None = None, model: str | None = None, since: float | None = None
    ) -> list[dict[str, Any]]:
        """Buckets from the hour holding `since` (default: 7 days ago) on, oldest first."""
        now = int(self._clock())
        first = int(since if since is not None else now - KEEP_HOURS * HOUR) // HOUR * HOUR
        first = max(first, now // HOUR * HOUR - REDIS_TTL)
        rows: dict[Bucket, list[int]] = {}
        if self._redis is None:
            rows = {b: c for b, c in self._buckets.items() if b[0] >= first}
        else:
            await self.flush()
            hours = list(range(first, now // HOUR * HOUR + 1, HOUR))
            async with asyncio.timeout(self._timeout):
                async with self._redis.pipeline(transaction=False) as pipe:
                    for hour in hours:
                        pipe.hgetall(f"{self._tag}{hour}")
                    answers = await pipe.execute()
            for hour, fields in zip(hours, answers, strict=True):
                for field, value in fields.items():
                    parsed = _field(field)
                    if parsed is None:
                        continue
                    k, m, kind = parsed
                    counts = rows.setdefault((hour, k, m), [0, 0, 0, 0, 0])
                    counts[KINDS.index(kind)] += int(value)
        out = []
        for (hour, k, m), counts in sorted(rows.items()):
            if (key is not None and k != key) or (model is not None and m != model):
                continue
            out.append(
                {
                    "key": k,
                    "model": m,
                    "hour": datetime.fromtimestamp(hour, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "hour_unix": hour,
                    **dict(zip(KINDS, counts, strict=True)),
                }
            )
        return out


def _field(raw: bytes | str) -> tuple[str, str, str] | None:
    """A hash field written by `flush()`; None for anything else (a hand edit)."""
    try:
        k, m, kind = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not (isinstance(k, str) and isinstance(m, str) and kind in KINDS):
        return None
    return k, m, kind


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
