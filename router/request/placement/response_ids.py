"""Response id -> the backend holding it, so Responses follow-ups reach the engine that has them.

vLLM keeps a stored response (and the conversation behind it) in the memory of the engine that
produced it: `previous_response_id`, `GET /v1/responses/{id}` and `.../cancel` must go there.
The proxy remembers each new response's id with its backend and public model name as soon as
the id passes (before the client can see it, so a follow-up through any replica finds it).

Each id is bound to its owner: a digest of the client key that made it (`owner_of`; never the key,
nor the hash the config holds), or ANONYMOUS when no client keys are configured. A lookup by
another owner finds a `Holder` the caller must treat as unknown (`Holder.owned_by`): 404, never
that engine. The first `remember` of an id wins: another key's, or the same id from another
engine (vLLM takes a client's `request_id`), does not replace it. The known size of the
conversation (the tokens its latest response used) is kept with it (`sized`), for the quota
estimate of a request that continues it.

- Local: an LRU of at most `response_ids.max_local` ids, each kept `ttl` seconds after its last
  use by its owner, and at most `response_ids.max_per_key` ids an owner made (past it the owner's
  oldest is forgotten). Always written, and read first: an id never moves, so a local hit is the
  answer.
- Shared (`redis_url` set): `<redis_prefix>:resp:<id>` = `backend 0x1f model 0x1f owner 0x1f
  tokens`, written with `SET NX EX ttl` (the first wins), read by a script that refreshes the
  ttl only for its owner; `<redis_prefix>:resp-owner:<owner>`, a sorted set of the owner's ids by
  expiry, trimmed to `max_per_key` (the ids trimmed are deleted, if still that owner's). A call
  waits at most `redis_timeout` x 4 (a follow-up that finds nothing is refused, so this read is
  worth a little more patience than a count); on a failure the local map answers, and a write
  that failed is not retried. A value without an owner (written before ids were bound) is no
  caller's: 404 until it expires.
Cost: two Redis round trips when a response is created (the id, its owner's set), one more when
its usage is known (not waited for), one per follow-up not made here; none for any other
endpoint.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from router.core.errors import STORE_FAILURES

log = logging.getLogger("sluicegate.responses")

_SEP = "\x1f"
ANONYMOUS = "-"  # the owner of every response when no client keys are configured
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


def owner_of(key_sha256: str) -> str:
    """A client key's owner tag: a digest of its configured sha256, so what Redis holds is
    neither the key nor the hash that identifies it in the config."""
    return hashlib.sha256(b"sluicegate-response-owner\x00" + key_sha256.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Holder:
    backend: str  # the backend's name
    model: str  # the public model name the response was made with
    owner: str = ANONYMOUS  # the key that made it (`owner_of`), ANONYMOUS without keys
    tokens: int = 0  # the conversation's known size (its latest usage), 0 until known

    def owned_by(self, owner: str) -> bool:
        return self.owner == owner

    def same_place(self, other: Holder) -> bool:
        return (self.backend, self.model, self.owner) == (other.backend, other.model, other.owner)

    def head(self) -> str:
        return f"{self.backend}{_SEP}{self.model}{_SEP}{self.owner}{_SEP}"


class ResponseIds:
    def __init__(
        self,
        ttl: float,
        max_local: int,
        client: Any = None,
        prefix: str = "sluicegate",
        clock: Callable[[], float] = time.monotonic,
        timeout: float | None = None,
        owns_client: bool = True,
        max_per_key: int = 10_000,
    ) -> None:
        self._ttl = ttl
        # A bound on each call; None leaves it to the client's socket timeout. The app's shared
        # client has none (and is closed by the app: `owns_client` False).
        self._timeout = timeout
        self._owns_client = owns_client
        self._max = max_local
        self._per_key = max_per_key
        self._client = client  # an asyncio Redis client, or None
        self._prefix = f"{prefix}:resp:"
        self._owner_prefix = f"{prefix}:resp-owner:"
        self._clock = clock
        self._local: OrderedDict[str, tuple[Holder, float]] = OrderedDict()
        # owner -> the ids it made that this process keeps, oldest first (the per-key cap)
        self._owned: dict[str, OrderedDict[str, None]] = {}
        self._sizing: set[asyncio.Task[None]] = set()
        self.failures = 0  # Redis calls that failed (then answered locally)
        if client is not None:
            self._find = client.register_script(_FIND)
            self._size = client.register_script(_SIZE)
            self._own = client.register_script(_OWN)
            self._drop = client.register_script(_DROP)

    @property
    def shared(self) -> bool:
        return self._client is not None

    def __len__(self) -> int:
        return len(self._local)

    def owned(self, owner: str) -> int:
        """Ids of `owner` this process keeps."""
        ids = self._owned.get(owner)
        return len(ids) if ids is not None else 0

    def _keep(self, response_id: str, holder: Holder) -> None:
        local = self._local
        local[response_id] = (holder, self._clock() + self._ttl)
        local.move_to_end(response_id)
        mine = self._owned.get(holder.owner)
        if mine is None:
            mine = self._owned[holder.owner] = OrderedDict()
        mine[response_id] = None
        while len(mine) > self._per_key:
            self._forget(next(iter(mine)))
        while len(local) > self._max:
            self._forget(next(iter(local)))

    def _forget(self, response_id: str) -> None:
        entry = self._local.pop(response_id, None)
        if entry is None:
            return
        owner = entry[0].owner
        mine = self._owned.get(owner)
        if mine is not None:
            mine.pop(response_id, None)
            if not mine:
                del self._owned[owner]

    async def remember(self, response_id: str, holder: Holder) -> bool:
        """Bind a new response's id to `holder` (its backend, model and owner); False when the
        id is held already, by another owner or on another backend: that binding stays."""
        entry = self._local.get(response_id)
        if entry is not None and entry[1] > self._clock():
            if not entry[0].same_place(holder):
                return False
            self._keep(response_id, entry[0])
            return True
        if self._client is None:
            self._keep(response_id, holder)
            return True
        try:
            async with asyncio.timeout(self._timeout):
                fresh = await self._client.set(
                    self._prefix + response_id,
                    f"{holder.head()}{holder.tokens}",
                    nx=True,
                    ex=max(1, round(self._ttl)),
                )
                if not fresh:
                    return False
                self._keep(response_id, holder)
                gone = await self._own(
                    keys=[self._owner_prefix + holder.owner],
                    args=[max(1000, round(self._ttl * 1000)), self._per_key, response_id],
                )
                for old in gone or ():
                    name = old.decode("utf-8", "replace") if isinstance(old, bytes) else str(old)
                    self._forget(name)
                    await self._drop(keys=[self._prefix + name], args=[holder.owner])
        except STORE_FAILURES as exc:
            self._failed("write", exc)
            self._keep(response_id, holder)
        return True

    async def find(self, response_id: str, owner: str = ANONYMOUS) -> Holder | None:
        """Who holds the id; a use by its `owner` keeps it. A holder of another owner is
        returned as such (`owned_by` tells), to be answered as unknown."""
        entry = self._local.get(response_id)
        if entry is not None:
            holder, until = entry
            if until > self._clock():
                if holder.owned_by(owner):
                    self._keep(response_id, holder)  # a use keeps it
                return holder
            self._forget(response_id)
        if self._client is None:
            return None
        try:
            async with asyncio.timeout(self._timeout):
                raw = await self._find(
                    keys=[self._prefix + response_id], args=[owner, max(1, round(self._ttl))]
                )
        except STORE_FAILURES as exc:
            self._failed("read", exc)
            return None
        if raw is None:
            return None
        stored = _parse(raw)
        if stored is not None and stored.owned_by(owner):
            self._keep(response_id, stored)
        return stored

    def sized(self, response_id: str, owner: str, tokens: int) -> None:
        """The conversation behind `response_id` is `tokens` long (its latest usage): what a
        request continuing it adds to its estimate. Only the owner's binding is changed; the
        Redis write is not waited for."""
        entry = self._local.get(response_id)
        if entry is None or not entry[0].owned_by(owner) or tokens <= 0:
            return
        holder = replace(entry[0], tokens=int(tokens))
        self._local[response_id] = (holder, entry[1])
        if self._client is None or len(self._sizing) >= MAX_SIZING:
            return
        task = asyncio.ensure_future(self._write_size(response_id, holder))
        self._sizing.add(task)
        task.add_done_callback(self._sizing.discard)

    async def _write_size(self, response_id: str, holder: Holder) -> None:
        head = holder.head()
        try:
            async with asyncio.timeout(self._timeout):
                await self._size(
                    keys=[self._prefix + response_id], args=[head, f"{head}{holder.tokens}"]
                )
        except STORE_FAILURES as exc:
            self._failed("size", exc)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        log.warning(
            "response id store unavailable; answering from this process",
            extra={"fields": {"call": what, "error": type(exc).__name__}},
        )

    async def aclose(self) -> None:
        for task in list(self._sizing):
            task.cancel()
        if self._sizing:
            await asyncio.gather(*self._sizing, return_exceptions=True)
        if self._client is not None and self._owns_client:
            await self._client.aclose()


def _parse(raw: Any) -> Holder | None:
    """A stored value (None: torn). One written before ids were bound (`backend 0x1f model`)
    has the owner "", which no caller is: it answers as unknown to everyone until it expires."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    fields = text.split(_SEP)
    if len(fields) == 2:
        fields += ["", "0"]
    if len(fields) != 4 or not fields[0]:
        return None
    backend, model, owner, tokens = fields
    known = tokens.isascii() and tokens.isdigit() and len(tokens) < 16
    return Holder(backend, model, owner, int(tokens) if known else 0)
