"""Hourly usage written to Redis, where every replica's counts are summed: the shared usage book.

Records collect in this process (`HourlyCounts`: pending, not written yet) and the store's
heartbeat writes them every `usage_flush` seconds (and each read first writes them) in one
MULTI/EXEC round trip: `HINCRBY` into one hash per hour (`{<redis_prefix>}:usage:<hour start,
unix>`, fields `[key, model, kind]` as JSON) and `EXPIRE` 8 days. A read (`/admin/usage`) sums
every replica's hashes from Redis.

Redis slow or down (router/state/store.py: the rule every shared store has in common): a write
that fails puts its counts back (merged with newer ones) for the next round; past `MAX_BUCKETS`
pending buckets, or older than 8 days, they are dropped and counted
(`sluicegate_usage_dropped_total`). After DEGRADE_AFTER failed round trips in a row the book is
`degraded`: one warning, reads answer `StoreUnavailable` at once (`/admin/usage` 503) and the
heartbeat probes every half second; once Redis takes a write, the pending counts are written
and reads are answered again. A write whose answer is lost after Redis applied it is written
again (counts may then run high, never low). At shutdown the pending counts get one bounded
try; what Redis does not take then is lost (logged).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from router.core.errors import StoreUnavailable
from router.core.redis_client import Client, RedisTarget
from router.core.runner import Runner
from router.request.usage import book as usage_book
from router.request.usage.book import HOUR, KINDS, REDIS_TTL, Bucket, HourlyCounts, rows
from router.state.store import SharedStore

log = logging.getLogger("sluicegate.usage")


class SharedUsageBook(SharedStore[None], HourlyCounts):
    # The heartbeat is the timed write: its chore keeps the name the writer always had.
    chore = "usage_flush"
    log = log
    degraded_message = "usage not written to Redis; kept in memory until it answers"
    recovered_message = "usage written to Redis again"

    def __init__(
        self,
        target: str | RedisTarget | Client,
        *,
        prefix: str = "sluicegate",
        clock: Callable[[], float] = time.time,
        on_dropped: Callable[[int], None] | None = None,
        timeout: float = 2.0,
        flush_every: float = 5.0,
        heartbeat: bool = True,
        runner: Runner | None = None,
    ) -> None:
        tag = "{" + prefix + "}"
        SharedStore.__init__(
            self,
            target,
            timeout=timeout,
            tag=tag,
            beat_every=flush_every,
            heartbeat=heartbeat,
            runner=runner,
        )
        # The pending counts: kept until Redis takes them, 8 days at most.
        HourlyCounts.__init__(self, clock, on_dropped, keep=REDIS_TTL, count_old=True)
        self._tag = tag + ":usage:"
        self._writing = asyncio.Lock()
        self._lost: str | None = None  # why the last write failed

    def _log_fields(self) -> dict[str, Any]:
        return {"buckets": len(self._counts)}

    # --- writing ---------------------------------------------------------------------------

    async def _settle(self) -> None:
        """The pending counts, in one transaction; on failure they wait for the next round."""
        if not self._counts:
            return
        async with self._writing:
            batch, self._counts = self._counts, {}
            if not batch:
                return
            try:
                await self._direct(self._transaction(batch))
            except StoreUnavailable as exc:
                self._lost = type(exc.__cause__ or exc).__name__
                self._merge_back(batch)
                raise
            except asyncio.CancelledError:  # shutdown mid-write: aclose tries once more
                self._merge_back(batch)
                raise

    async def _transaction(self, batch: dict[Bucket, list[int]]) -> None:
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

    def _merge_back(self, batch: dict[Bucket, list[int]]) -> None:
        pending = self._counts
        lost = 0
        for bucket, counts in batch.items():
            have = pending.get(bucket)
            if have is not None:
                for i, n in enumerate(counts):
                    have[i] += n
            elif len(pending) < usage_book.MAX_BUCKETS:
                pending[bucket] = counts
            else:
                lost += 1
        if lost:
            self._dropped(lost)

    async def aclose(self) -> None:
        await super().aclose()  # what this process counted since the last write: one try
        if self._counts:
            # No later round: what Redis did not take now is gone (the metric dies with us).
            log.warning(
                "usage not written to Redis at shutdown; lost",
                extra={"fields": {"error": self._lost, "buckets": len(self._counts)}},
            )

    # --- reading ---------------------------------------------------------------------------

    async def query(
        self, key: str | None = None, model: str | None = None, since: float | None = None
    ) -> list[dict[str, Any]]:
        """Every replica's buckets, this process's pending ones written first; raises
        `StoreUnavailable` while Redis cannot answer (at once while degraded)."""
        if self.degraded:
            raise StoreUnavailable("The shared store (Redis) is unavailable (degraded).")
        now = int(self._clock())
        first = self.first_hour(since, now)
        await self._settle()
        hours = list(range(first, now // HOUR * HOUR + 1, HOUR))
        answers = await self._direct(self._read(hours))
        out: dict[Bucket, list[int]] = {}
        for hour, fields in zip(hours, answers, strict=True):
            for field, value in fields.items():
                parsed = _field(field)
                if parsed is None:
                    continue
                k, m, kind = parsed
                counts = out.setdefault((hour, k, m), [0, 0, 0, 0, 0])
                counts[KINDS.index(kind)] += int(value)
        return rows(out, key, model)

    async def _read(self, hours: list[int]) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for hour in hours:
                pipe.hgetall(f"{self._tag}{hour}")
            answers: list[Any] = await pipe.execute()
        return answers


def _field(raw: bytes | str) -> tuple[str, str, str] | None:
    """A hash field written by `_transaction`; None for anything else (a hand edit)."""
    try:
        k, m, kind = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if not (isinstance(k, str) and isinstance(m, str) and kind in KINDS):
        return None
    return k, m, kind
