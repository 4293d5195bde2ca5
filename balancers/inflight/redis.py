"""Shared in-flight counts in Redis: one count per backend across every replica and worker.

Each backend has a sorted set `{prefix}:inflight:<backend>` of lease ids scored by expiry (ms);
its count is the number of unexpired ids. Lease ids are `<replica id>:<seq>`.

- acquire, one round trip: for a balancer that offers its policy in Lua (`RedisForm`, e.g.
  least in flight), one script purges expired ids on the candidates it looks at, runs that policy
  over the backends below `max_inflight` and adds the lease, atomically (the lease's `Choice`
  then has reason "load" and the count the script read). Balancers that ignore
  loads (round robin) pick locally and a script only checks capacity and adds; other (plugin)
  balancers read counts first: two round trips.
- release, one round trip: decrements the local view at once and hands ZREM to a task this store
  owns, with a timeout, so neither the client's cancellation nor an error can lose it.
- crash safety: a heartbeat re-stamps this replica's live leases every ttl/3 (re-adding any Redis
  lost, e.g. after a restart); a killed replica's leases expire `lease_ttl` after its last beat.
- Redis slow or down: calls give up after `timeout` and that request is counted locally
  (`fallbacks` += 1); after a few failures in a row the store switches to local counts
  (`degraded`, one warning) and the heartbeat probes Redis until it takes a write, re-registers
  the live leases and switches back to shared counts (router/state/store.py: the skeleton every
  shared store has in common; this module holds only the in-flight keys, scripts and logic).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from balancers.base import Balancer, Candidate, Choice, redis_form
from balancers.context import NO_CONTEXT, PickContext
from balancers.inflight.base import Lease, Readings
from router.core.backend import Backend
from router.core.errors import StoreUnavailable
from router.core.redis_client import Client, RedisTarget
from router.core.runner import Runner
from router.state.store import SharedStore

log = logging.getLogger("sluicegate.inflight")

# Every script takes now_ms first: 0 means "Redis's own clock" (one clock for every replica);
# tests pass an injected clock instead.
_NOW = """
local now = tonumber(ARGV[1])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# The acquire script around a balancer's Lua policy (`RedisForm`), which defines `pick`.
# ARGV: now_ms, ttl_ms, lease id, seed, then (weight, max_inflight or 0) per key.
# Returns 0 when none has room, else {index, its count before this lease}.
_ACQUIRE_AROUND = (
    _NOW
    + """
local ttl = tonumber(ARGV[2])
math.randomseed(tonumber(ARGV[4]))
local seen = {}
local function load(i)
  local v = seen[i]
  if v == nil then
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    local c = redis.call('ZCARD', KEYS[i])
    local cap = tonumber(ARGV[4 + 2 * i])
    if cap ~= 0 and c >= cap then v = false else v = c end
    seen[i] = v
  end
  return v
end
local function weight(i)
  return tonumber(ARGV[3 + 2 * i])
end
POLICY
local i = pick(#KEYS, load, weight)
if not i then return 0 end
redis.call('ZADD', KEYS[i], now + ttl, ARGV[3])
redis.call('PEXPIRE', KEYS[i], ttl * 3)
return {i, seen[i]}
"""
)

# ARGV: now_ms, ttl_ms, lease id, max_inflight or 0. Adds the lease if the backend has room.
_ADD_IF_ROOM = (
    _NOW
    + """
local ttl = tonumber(ARGV[2])
local cap = tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if cap ~= 0 and redis.call('ZCARD', KEYS[1]) >= cap then return 0 end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
redis.call('PEXPIRE', KEYS[1], ttl * 3)
return 1
"""
)

# ARGV: now_ms. Returns the count of each key.
_COUNTS = (
    _NOW
    + """
local out = {}
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  out[i] = redis.call('ZCARD', key)
end
return out
"""
)

# ARGV: now_ms, ttl_ms, then per key: how many ids follow, the ids. Adds or re-stamps each.
_REFRESH = (
    _NOW
    + """
local ttl = tonumber(ARGV[2])
local at = 3
for _, key in ipairs(KEYS) do
  local n = tonumber(ARGV[at])
  for j = at + 1, at + n do
    redis.call('ZADD', key, now + ttl, ARGV[j])
  end
  at = at + n + 1
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  redis.call('PEXPIRE', key, ttl * 3)
end
return 1
"""
)

_Owed = tuple[str, str]  # (backend, lease id): a removal Redis has not taken yet


class RedisInflight(SharedStore[_Owed]):
    chore = "inflight_heartbeat"
    log = log
    degraded_message = "redis in-flight store unavailable; counting locally until it answers"
    recovered_message = "redis in-flight store answers again; counts are shared"

    def __init__(
        self,
        url: str | RedisTarget | Client,
        *,
        timeout: float = 0.05,
        lease_ttl: float = 10.0,
        prefix: str = "sluicegate",
        clock: Callable[[], float] | None = None,
        heartbeat: bool = True,
        runner: Runner | None = None,
    ) -> None:
        # One hash tag for every key: a script's keys share a slot, so scripts run on Cluster (and
        # all counts live on that slot's shard: the price of atomic multi-backend picks).
        tag = "{" + prefix + "}"
        super().__init__(
            url,
            timeout=timeout,
            tag=tag,
            beat_every=lease_ttl / 3,
            heartbeat=heartbeat,
            runner=runner,
        )
        self._ttl_ms = int(lease_ttl * 1000)
        self._prefix = tag + ":inflight:"
        self._clock = clock
        self.replica_id = uuid.uuid4().hex[:12]
        self._seq = itertools.count(1)
        self._rng = random.Random()
        self._add_sha = self._script(_ADD_IF_ROOM)
        self._counts_sha = self._script(_COUNTS)
        self._refresh_sha = self._script(_REFRESH)
        self._policies: dict[type, str | None] = {}  # balancer class -> its acquire script
        self._live: dict[str, str] = {}  # lease id -> backend, for this replica
        self._local: dict[str, int] = {}  # this replica's own counts: the fallback view
        self.fallbacks = 0  # requests placed on local counts because Redis was unavailable

    def key(self, backend: str) -> str:
        return self._prefix + backend

    def _now_ms(self) -> int:
        return 0 if self._clock is None else int(self._clock() * 1000)

    def _log_fields(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "live": len(self._live)}

    # --- the store's part of the heartbeat -------------------------------------------------

    async def _beat(self) -> None:
        """Re-stamp (or re-add) this replica's live leases."""
        if not self._live:
            return
        by_backend: dict[str, list[str]] = {}
        snapshot = dict(self._live)
        for token, backend in snapshot.items():
            by_backend.setdefault(backend, []).append(token)
        keys = [self.key(b) for b in by_backend]
        args: list[Any] = [self._now_ms(), self._ttl_ms]
        for tokens in by_backend.values():
            args.append(len(tokens))
            args.extend(tokens)
        await self._call(self._store_tag, "EVALSHA", self._refresh_sha, len(keys), *keys, *args)
        # A lease released while the beat was on the wire may have been re-added by it.
        for token, backend in snapshot.items():
            if token not in self._live:
                self._remove_later(token, backend)

    async def _settle(self) -> None:
        """The removals Redis has not taken yet, one ZREM per backend."""
        owed = self.owed.take()
        by_backend: dict[str, list[str]] = {}
        for backend, token in owed:
            by_backend.setdefault(backend, []).append(token)
        done: set[str] = set()
        try:
            for backend, tokens in by_backend.items():
                await self._call(self._store_tag, "ZREM", self.key(backend), *tokens)
                done.add(backend)
        finally:
            self.owed.give_back(entry for entry in owed if entry[0] not in done)

    async def _closing(self) -> None:
        for token, backend in list(self._live.items()):
            self.release(Lease(backend, token))

    # --- the hot path ----------------------------------------------------------------------

    async def acquire(
        self,
        backends: Sequence[Backend],
        balancer: Balancer,
        ctx: PickContext = NO_CONTEXT,
        readings: Readings | None = None,
    ) -> Lease | None:
        exclude = ctx.exclude
        cands = [b for b in backends if b.name not in exclude] if exclude else list(backends)
        if not cands:
            return None
        if self.degraded:
            self.fallbacks += 1
            return self._acquire_local(cands, balancer, ctx, readings)
        token = f"{self.replica_id}:{next(self._seq)}"
        # The Lua form weighs loads only: a context with hints or an adapter picks here.
        script = self._policy(balancer) if ctx.plain else None
        try:
            if script is not None:
                choice = await self._acquire_atomic(cands, token, script, readings)
            else:
                choice = await self._acquire_picked(cands, balancer, ctx, token, readings)
        except StoreUnavailable:
            # The script may have run after we stopped waiting: remove the id wherever it landed.
            for b in cands:
                self.owed.add((b.name, token))
            self.fallbacks += 1
            return self._acquire_local(cands, balancer, ctx, readings)
        except BaseException:
            for b in cands:  # cancelled mid-call (the client left): same doubt, Redis is fine
                self._remove_later(token, b.name)
            raise
        if choice is None:
            return None
        return self._hold(choice, token)

    def _policy(self, balancer: Balancer) -> str | None:
        """The acquire script around the balancer's own Lua form, if it offers one."""
        cls = type(balancer)
        if cls not in self._policies:
            source = redis_form(balancer)
            sha = None
            if source is not None:
                sha = self._script(_ACQUIRE_AROUND.replace("POLICY", source))
            self._policies[cls] = sha
        return self._policies[cls]

    async def _acquire_atomic(
        self, cands: Sequence[Backend], token: str, sha: str, readings: Readings | None
    ) -> Choice | None:
        """Picked inside the script: by load alone, hence the reason."""
        args: list[Any] = [self._now_ms(), self._ttl_ms, token, self._rng.getrandbits(31)]
        for b in cands:
            args += (b.weight, b.max_inflight or 0)
        keys = [self.key(b.name) for b in cands]
        reply = await self._call(self._store_tag, "EVALSHA", sha, len(keys), *keys, *args)
        if not reply:
            return None
        b = cands[int(reply[0]) - 1]
        return Choice(
            Candidate(b.name, b.weight, int(reply[1]), readings.get(b.name) if readings else None)
        )

    async def _acquire_picked(
        self,
        cands: Sequence[Backend],
        balancer: Balancer,
        ctx: PickContext,
        token: str,
        readings: Readings | None = None,
    ) -> Choice | None:
        """Let the balancer pick, then add the lease only if that backend still has room."""
        if balancer.needs_counts:
            names = [b.name for b in cands]
            counts = await self._shared_counts(names)
        else:
            counts = self._local
        offered = [
            Candidate(
                b.name, b.weight, counts.get(b.name, 0), readings.get(b.name) if readings else None
            )
            for b in cands
            if b.max_inflight is None or counts.get(b.name, 0) < b.max_inflight
        ]
        by_name = {b.name: b for b in cands}
        tried: set[str] = set()
        pick_ctx = ctx
        for _ in range(len(offered)):
            choice = balancer.pick(offered, pick_ctx)
            if choice is None:
                return None
            b = by_name[choice.candidate.name]
            args = [self._now_ms(), self._ttl_ms, token, b.max_inflight or 0]
            if await self._call(
                self._store_tag, "EVALSHA", self._add_sha, 1, self.key(b.name), *args
            ):
                return choice
            tried.add(b.name)  # filled up since we looked
            pick_ctx = replace(ctx, exclude=frozenset(tried))  # cands are without ctx.exclude
        return None

    def _hold(self, choice: Choice, token: str) -> Lease:
        backend = choice.candidate.name
        self._live[token] = backend
        self._local[backend] = self._local.get(backend, 0) + 1
        return Lease(backend, token, choice=choice)

    def _acquire_local(
        self,
        cands: Sequence[Backend],
        balancer: Balancer,
        ctx: PickContext,
        readings: Readings | None = None,
    ) -> Lease | None:
        local = self._local
        offered = [
            Candidate(
                b.name, b.weight, local.get(b.name, 0), readings.get(b.name) if readings else None
            )
            for b in cands
            if b.max_inflight is None or local.get(b.name, 0) < b.max_inflight
        ]
        choice = balancer.pick(offered, ctx)
        if choice is None:
            return None
        return self._hold(choice, f"{self.replica_id}:{next(self._seq)}")

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        if self._live.pop(lease.token, None) is None:
            return
        n = self._local.get(lease.backend, 0) - 1
        if n > 0:
            self._local[lease.backend] = n
        else:
            self._local.pop(lease.backend, None)
        if self.degraded:
            self.owed.add((lease.backend, lease.token))
        else:
            self._remove_later(lease.token, lease.backend)

    def _remove_later(self, token: str, backend: str) -> None:
        """ZREM on the next pipeline; no task, no wait. If it is lost, the heartbeat retries it
        (and failing that the lease expires)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.owed.add((backend, token))
            return

        def lost() -> None:
            self.owed.add((backend, token))

        self._post(self._store_tag, ("ZREM", self.key(backend), token), lost)

    # --- reading ---------------------------------------------------------------------------

    async def _shared_counts(self, names: Sequence[str]) -> dict[str, int]:
        keys = [self.key(n) for n in names]
        values = await self._call(
            self._store_tag, "EVALSHA", self._counts_sha, len(keys), *keys, self._now_ms()
        )
        return {n: int(v) for n, v in zip(names, values, strict=True)}

    async def counts(self, names: Sequence[str]) -> dict[str, int]:
        """Every replica's count per backend; this replica's own while Redis is unavailable."""
        if not self.degraded and names:
            try:
                return await self._shared_counts(names)
            except StoreUnavailable:
                pass
        return {n: self._local.get(n, 0) for n in names}
