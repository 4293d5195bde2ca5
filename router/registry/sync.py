"""Admin changes shared through Redis, so every replica and worker routes on the same set.

Records live in one hash (name -> JSON). A change is a WATCH/MULTI transaction that rewrites one
record and bumps a version counter, then a message on a channel; every process reloads the whole
hash on a message. The hash and the counter share a hash tag (`{<redis_prefix>:registry}:...`), so
the transaction runs on Redis Cluster too; there the message is an ordinary PUBLISH (Cluster relays
it to every node; registry changes are rare), received on the node that owns the tag's slot.
Messages can be lost (a reconnect, a slow subscriber), so each process also reads the version
every `resync` seconds and reloads when it moved: a missed change heals within that.
The hash is the truth and outlives router restarts. Each call is bounded by `timeout` here: the
app's shared client (router/core/redis_client.py) has no socket timeout of its own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.asyncio import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import WatchError

from router.core.errors import (
    STORE_FAILURES,
    STORE_STALE_CONNECTION,
    StoreUnavailable,
    store_unavailable,
)
from router.core.redis_client import (
    Client,
    RedisTarget,
    client_for,
    follow_master,
    off_master,
    ready,
)
from router.registry.fleet import Record

log = logging.getLogger("sluicegate.registry")

_MAX_TXN_RETRIES = 20
DEFAULT_PREFIX = "sluicegate:registry"

# Before the keys shared a hash tag they were `<prefix>:records` and `<prefix>:version`, and before
# `redis_prefix` reached the registry every deployment used `{sluicegate:registry}:...` whatever its
# prefix. The first replica of this version to start copies the first of those that exists (once;
# the old keys stay for old replicas). The new version counter marks "done": the hash itself
# vanishes when its last record is deleted.
_ADOPT_LEGACY = """
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
local flat = redis.call('HGETALL', KEYS[3])
for i = 1, #flat, 2 do redis.call('HSET', KEYS[1], flat[i], flat[i + 1]) end
redis.call('INCR', KEYS[2])
return #flat / 2
"""


def _text(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


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
        url: str | RedisTarget | Client,
        prefix: str = DEFAULT_PREFIX,
        resync: float = 1.0,
        timeout: float = 2.0,
    ) -> None:
        self._redis, self._owns_client = client_for(url, timeout)
        self._cluster = isinstance(self._redis, RedisCluster)
        tag = "{" + prefix + "}"
        self._hash = f"{tag}:records"
        self._version = f"{tag}:version"
        self._channel = f"{tag}:changes"
        legacy = [f"{prefix}:records"]
        if prefix != DEFAULT_PREFIX:
            legacy.append("{" + DEFAULT_PREFIX + "}:records")
        self._legacy = tuple(legacy)
        self._adopted = False
        self._resync = resync
        self._timeout = timeout

    async def _read(self) -> tuple[str | None, dict[str, Record]]:
        # One transaction: the version and the records it stands for, never two moments.
        async with asyncio.timeout(self._timeout), self._redis.pipeline(transaction=True) as pipe:
            pipe.get(self._version)
            pipe.hgetall(self._hash)
            version, raw = await pipe.execute()
        records: dict[str, Record] = {}
        for name, value in raw.items():
            # An unreadable record is passed on as one the fleet refuses, logs and counts.
            rec = _parse(value)
            records[_text(name)] = {"unreadable": True} if rec is None else rec
        return None if version is None else _text(version), records

    async def _read_retrying(self) -> dict[str, Record]:
        try:
            return (await self._read())[1]
        except STORE_STALE_CONNECTION:
            # A pooled connection may have died with a Redis restart: reading again is safe.
            return (await self._read())[1]

    async def _adopt_legacy(self) -> None:
        # Not on Cluster: nothing older ran there, and the old keys are in other slots.
        if not self._adopted and not self._cluster:
            for legacy in self._legacy:
                keys = [self._hash, self._version, legacy]
                async with asyncio.timeout(self._timeout):
                    copied = await self._redis.eval(_ADOPT_LEGACY, len(keys), *keys)
                if copied:
                    log.info(
                        "registry records copied to the hash-tagged keys",
                        extra={"fields": {"records": copied, "from": legacy}},
                    )
                    break
        self._adopted = True

    async def load(self) -> dict[str, Record]:
        try:
            await self._adopt_legacy()
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
            try:
                # After EXEC (a Cluster transaction cannot carry PUBLISH); if it is lost, the
                # others' version check picks the change up within `resync`.
                async with asyncio.timeout(self._timeout):
                    await self._redis.publish(self._channel, name)
            except STORE_FAILURES as exc:
                log.warning(
                    "registry change stored but not announced; replicas resync",
                    extra={"fields": {"error": type(exc).__name__}},
                )
            return await self._read_retrying()
        except STORE_FAILURES as exc:
            raise store_unavailable(exc) from None

    async def _transaction(
        self, name: str, edit: Callable[[Record | None], Record | None], sent: list[bool]
    ) -> None:
        async with asyncio.timeout(self._timeout), self._redis.pipeline(transaction=True) as pipe:
            for _ in range(_MAX_TXN_RETRIES):
                try:
                    await pipe.watch(self._hash)
                    new = edit(_parse(await pipe.hget(self._hash, name)))
                    pipe.multi()  # type: ignore[no-untyped-call]  # ClusterPipeline: unannotated
                    if new is None:
                        pipe.hdel(self._hash, name)
                    else:
                        pipe.hset(self._hash, name, json.dumps(new, separators=(",", ":")))
                    pipe.incr(self._version)
                    sent[0] = True
                    await pipe.execute()
                    return
                except WatchError:
                    sent[0] = False  # EXEC was refused: nothing applied
                    continue  # someone changed the registry between our read and write
        raise StoreUnavailable("The shared registry is too busy; retry.")

    async def watch(self, on_records: Callable[[dict[str, Record]], None]) -> None:
        """One subscription: deliver every change until Redis is lost, then raise (the runner
        starts it again after its backoff; a new subscription reads the whole hash first)."""
        pubsub = None
        try:
            async with asyncio.timeout(self._timeout):
                await ready(self._redis)
                pubsub = self._redis.pubsub()
                await pubsub.subscribe(self._channel)
            # Anything published while we were not subscribed is in the hash: read it now.
            await self._adopt_legacy()  # if Redis was away when load() ran
            seen, records = await self._read()
            _deliver(on_records, records)
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
                    await follow_master(self._redis, self._timeout)
                    # The master this process's client knows, whichever part learnt it first.
                    if off_master(self._redis, pubsub.connection):
                        # Our subscription is on the former master, which hears nothing now.
                        raise RedisConnectionError("the master changed")
                    async with asyncio.timeout(self._timeout):
                        raw = await self._redis.get(self._version)
                    version = None if raw is None else _text(raw)
                    if version != seen:
                        seen, records = await self._read()
                        _deliver(on_records, records)
                    next_check = time.monotonic() + self._resync
        finally:
            try:
                if pubsub is not None:
                    await asyncio.shield(pubsub.aclose())
            except STORE_FAILURES:
                pass

    async def aclose(self) -> None:
        if self._owns_client:  # else the app's, closed by the app
            await self._redis.aclose()
