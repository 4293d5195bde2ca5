"""Admin changes shared through Redis, so every replica and worker routes on the same set.

Records live in one hash (name -> JSON). A change is a WATCH/MULTI transaction that rewrites one
record, bumps a version counter and publishes on a channel; every process reloads the whole hash
on a message. Messages can be lost (a reconnect, a slow subscriber), so each process also reads
the version every `resync` seconds and reloads when it moved: a missed change heals within that.
The hash is the truth and outlives router restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from router.core.errors import (
    STORE_FAILURES,
    STORE_STALE_CONNECTION,
    StoreUnavailable,
    store_unavailable,
)
from router.registry.fleet import Record

log = logging.getLogger("sluicegate.registry")

_MAX_TXN_RETRIES = 20


def _parse(raw: Any) -> Record | None:
    if raw is None:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _deliver(on_records: Callable[[dict[str, Record]], None], records: dict[str, Record]) -> None:
    try:
        on_records(records)
    except Exception as exc:  # a bad rebuild must not end the sync for good
        log.error(
            "applying registry records failed", extra={"fields": {"error": type(exc).__name__}}
        )


class RedisRecords:
    kind = "redis"

    def __init__(
        self,
        url: str,
        prefix: str = "sluicegate:registry",
        resync: float = 1.0,
        timeout: float = 2.0,
    ) -> None:
        self._redis: aioredis.Redis = aioredis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True
        )
        self._hash = f"{prefix}:records"
        self._version = f"{prefix}:version"
        self._channel = f"{prefix}:changes"
        self._resync = resync

    async def _read(self) -> tuple[str | None, dict[str, Record]]:
        # One transaction: the version and the records it stands for, never two moments.
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(self._version)
            pipe.hgetall(self._hash)
            version, raw = await pipe.execute()
        records = {}
        for name, value in raw.items():
            rec = _parse(value)
            if rec is None:
                log.warning(
                    "ignoring an unreadable registry record", extra={"fields": {"name": name}}
                )
                continue
            records[name] = rec
        return version, records

    async def _read_retrying(self) -> dict[str, Record]:
        try:
            return (await self._read())[1]
        except STORE_STALE_CONNECTION:
            # A pooled connection may have died with a Redis restart: reading again is safe.
            return (await self._read())[1]

    async def load(self) -> dict[str, Record]:
        try:
            return await self._read_retrying()
        except STORE_FAILURES as exc:
            raise store_unavailable(exc) from None

    async def change(
        self, name: str, edit: Callable[[Record | None], Record | None]
    ) -> dict[str, Record]:
        sent = [False]
        try:
            try:
                await self._transaction(name, edit, sent)
            except STORE_STALE_CONNECTION:
                if sent[0]:
                    raise  # EXEC went out: it may have been applied, so never apply it twice
                await self._transaction(name, edit, sent)
            return await self._read_retrying()
        except STORE_FAILURES as exc:
            raise store_unavailable(exc) from None

    async def _transaction(
        self, name: str, edit: Callable[[Record | None], Record | None], sent: list[bool]
    ) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            for _ in range(_MAX_TXN_RETRIES):
                try:
                    await pipe.watch(self._hash)
                    new = edit(_parse(await pipe.hget(self._hash, name)))
                    pipe.multi()
                    if new is None:
                        pipe.hdel(self._hash, name)
                    else:
                        pipe.hset(self._hash, name, json.dumps(new, separators=(",", ":")))
                    pipe.incr(self._version)
                    pipe.publish(self._channel, name)
                    sent[0] = True
                    await pipe.execute()
                    return
                except WatchError:
                    sent[0] = False  # EXEC was refused: nothing applied
                    continue  # someone changed the registry between our read and write
        raise StoreUnavailable("The shared registry is too busy; retry.")

    async def watch(self, on_records: Callable[[dict[str, Record]], None]) -> None:
        backoff = 0.1
        seen: str | None = None
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                # Anything published while we were not subscribed is in the hash: read it now.
                seen, records = await self._read()
                _deliver(on_records, records)
                backoff = 0.1
                next_check = time.monotonic() + self._resync
                while True:
                    wait = max(0.0, next_check - time.monotonic())
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
                    if msg is not None:
                        # Coalesce a burst of changes into one reload.
                        while await pubsub.get_message(ignore_subscribe_messages=True, timeout=0):
                            pass
                        seen, records = await self._read()
                        _deliver(on_records, records)
                    elif time.monotonic() >= next_check:
                        version = await self._redis.get(self._version)
                        if version != seen:
                            seen, records = await self._read()
                            _deliver(on_records, records)
                        next_check = time.monotonic() + self._resync
            except STORE_FAILURES as exc:
                log.warning(
                    "registry sync lost Redis; retrying",
                    extra={"fields": {"error": type(exc).__name__}},
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._resync)
            finally:
                try:
                    await asyncio.shield(pubsub.aclose())
                except STORE_FAILURES:
                    pass

    async def aclose(self) -> None:
        await self._redis.aclose()
