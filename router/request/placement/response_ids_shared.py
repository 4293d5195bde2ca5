"""Response ids shared through Redis, so a follow-up through any replica finds the engine.

This process's map (`ResponseIds`) is always written and read first; Redis holds every
replica's ids:
- `<redis_prefix>:resp:<id>` = `backend 0x1f model 0x1f owner 0x1f tokens`, written with
  `SET NX EX ttl` (the first wins), read by a script that refreshes the ttl only for its owner;
- `<redis_prefix>:resp-owner:<owner>`, a sorted set of the owner's ids by expiry, trimmed to
  `max_per_key` (the ids trimmed are deleted, if still that owner's).
A value without an owner (written before ids were bound) is no caller's: 404 until it expires.
The keys carry no hash tag (ids spread over every Cluster slot), so the client sends each call
to its key's server itself (`SharedStore._direct`).

Redis slow or down (router/state/store.py: the rule every shared store has in common): a call
waits at most `redis_timeout` x 4 (a follow-up that finds nothing is refused, so this read is
worth a little more patience than a count); on a failure the local map answers, and a write
that failed is not retried. After DEGRADE_AFTER failed round trips in a row the store is
`degraded`: one warning, ids are kept in this process only and lookups answer from it at once
(an id made through another replica is unknown here: 404), until a probe write is taken.
Cost: two Redis round trips when a response is created (the id, its owner's set), one more when
its usage is known (not waited for), one per follow-up not made here; none for any other
endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from router.core.errors import StoreUnavailable
from router.core.redis_client import Client, RedisTarget
from router.core.runner import Runner
from router.request.placement.response_ids import ANONYMOUS, SEP, Holder, ResponseIds
from router.state.store import SharedStore

log = logging.getLogger("sluicegate.responses")

MAX_SIZING = 1024  # size writes to Redis in flight at once; past it one is dropped (a hint)

# Lua: true when the id's value `v` names the owner ARGV[1] (its third field).
_OWNS = "v and string.match(v, '^[^\\031]*\\031[^\\031]*\\031([^\\031]*)') == ARGV[1]"
# KEYS: the id's key. ARGV: owner, ttl s. The value; its ttl refreshed only when the owner's.
_FIND = f"""
local v = redis.call('GET', KEYS[1])
if {_OWNS} then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return v
"""
# KEYS: the id's key. ARGV: the value's head (backend, model, owner, each with its separator),
# the new value. Rewritten only while it is that holder's (a later id of another owner stays).
_SIZE = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
  return 1
end
return 0
"""
# KEYS: the owner's set. ARGV: ttl ms, cap, the new id. Returns the ids trimmed past the cap.
_OWN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
redis.call('PEXPIRE', KEYS[1], ttl)
local over = redis.call('ZCARD', KEYS[1]) - cap
local gone = {}
if over > 0 then
  local popped = redis.call('ZPOPMIN', KEYS[1], over)
  for i = 1, #popped, 2 do gone[#gone + 1] = popped[i] end
end
return gone
"""
# KEYS: the id's key. ARGV: owner. Deleted only while it is that owner's.
_DROP = f"""
local v = redis.call('GET', KEYS[1])
if {_OWNS} then return redis.call('DEL', KEYS[1]) end
return 0
"""


class SharedResponseIds(SharedStore[None]):
    # No beat of its own: the chore runs only to probe while degraded.
    chore = "response_ids_probe"
    log = log
    degraded_message = "response id store unavailable; answering from this process"
    recovered_message = "response id store answers again; ids are shared"

    def __init__(
        self,
        target: str | RedisTarget | Client,
        *,
        ttl: float,
        max_local: int,
        max_per_key: int = 10_000,
        prefix: str = "sluicegate",
        clock: Callable[[], float] = time.monotonic,
        timeout: float = 0.2,
        heartbeat: bool = True,
        runner: Runner | None = None,
    ) -> None:
        super().__init__(
            target,
            timeout=timeout,
            tag="{" + prefix + ":resp}",  # the probe's slot (the ids' keys carry no tag)
            beat_every=None,
            heartbeat=heartbeat,
            runner=runner,
        )
        self.local = ResponseIds(ttl, max_local, clock, max_per_key)
        self._ttl_s = max(1, round(ttl))
        self._ttl_ms = max(1000, round(ttl * 1000))
        self._prefix = f"{prefix}:resp:"
        self._owner_prefix = f"{prefix}:resp-owner:"
        # Registered with the client, which sends each to its key's server (and loads it there
        # when that server answers NOSCRIPT).
        client = self._redis
        self._find = client.register_script(_FIND)
        self._size = client.register_script(_SIZE)
        self._own = client.register_script(_OWN)
        self._drop = client.register_script(_DROP)
        self._sizing: set[asyncio.Task[None]] = set()
        self.fallbacks = 0  # calls answered by this process's map instead of Redis

    def __len__(self) -> int:
        return len(self.local)

    async def remember(self, response_id: str, holder: Holder) -> bool:
        local = self.local
        known = local.bound(response_id, holder)
        if known is not None:
            return known
        if self.degraded:
            self.fallbacks += 1
            local.keep(response_id, holder)
            return True
        try:
            value = f"{holder.head()}{holder.tokens}"
            key = self._prefix + response_id
            if not await self._direct(self._redis.set(key, value, nx=True, ex=self._ttl_s)):
                return False
            local.keep(response_id, holder)
            owner_key = self._owner_prefix + holder.owner
            args: list[int | str] = [self._ttl_ms, local.max_per_key, response_id]
            gone = await self._direct(self._own(keys=[owner_key], args=args))
            for old in gone or ():
                name = old.decode("utf-8", "replace") if isinstance(old, bytes) else str(old)
                local.forget(name)
                await self._direct(self._drop(keys=[self._prefix + name], args=[holder.owner]))
        except StoreUnavailable:
            self.fallbacks += 1
            local.keep(response_id, holder)
        return True

    async def find(self, response_id: str, owner: str = ANONYMOUS) -> Holder | None:
        holder = self.local.held(response_id, owner)
        if holder is not None:
            return holder
        if self.degraded:
            self.fallbacks += 1
            return None
        try:
            raw = await self._direct(
                self._find(keys=[self._prefix + response_id], args=[owner, self._ttl_s])
            )
        except StoreUnavailable:
            self.fallbacks += 1
            return None
        if raw is None:
            return None
        stored = _parse(raw)
        if stored is not None and stored.owned_by(owner):
            self.local.keep(response_id, stored)
        return stored

    def sized(self, response_id: str, owner: str, tokens: int) -> None:
        """The local binding now; the Redis write is not waited for."""
        holder = self.local.resize(response_id, owner, tokens)
        if holder is None or self.degraded or len(self._sizing) >= MAX_SIZING:
            return
        task = asyncio.ensure_future(self._write_size(response_id, holder))
        self._sizing.add(task)
        task.add_done_callback(self._sizing.discard)

    async def _write_size(self, response_id: str, holder: Holder) -> None:
        head = holder.head()
        args = [head, f"{head}{holder.tokens}"]
        try:
            await self._direct(self._size(keys=[self._prefix + response_id], args=args))
        except StoreUnavailable:
            self.fallbacks += 1

    async def _closing(self) -> None:
        for task in list(self._sizing):
            task.cancel()
        if self._sizing:
            await asyncio.gather(*self._sizing, return_exceptions=True)

    def _log_fields(self) -> dict[str, Any]:
        return {"ids": len(self.local)}


def _parse(raw: Any) -> Holder | None:
    """A stored value (None: torn). One written before ids were bound (`backend 0x1f model`)
    has the owner "", which no caller is: it answers as unknown to everyone until it expires."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    fields = text.split(SEP)
    if len(fields) == 2:
        fields += ["", "0"]
    if len(fields) != 4 or not fields[0]:
        return None
    backend, model, owner, tokens = fields
    known = tokens.isascii() and tokens.isdigit() and len(tokens) < 16
    return Holder(backend, model, owner, int(tokens) if known else 0)
