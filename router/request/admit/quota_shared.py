"""Per-key quotas shared by every replica and worker through Redis, with a local fallback.

Algorithm: a sliding window of 1 s sub-buckets, one Redis hash per key and limit (bucket second
-> requests or tokens), summed over the last 61 buckets by one Lua script that also checks the
parallel slots and reserves, atomically. Chosen over GCRA (a token bucket) because a bucket as
big as the limit lets a flood take the whole limit and then the refill, up to twice `tpm` in one
minute; the sliding window never admits more than the limit in any 60 s (a use stops counting
61 s after its bucket began, so the window is at most 1/60 stricter, never looser). Sub-buckets
rather than a log: a few dozen fields per key whatever the traffic, and a correction lands in the
bucket its reservation went to, so a refund never outlives the estimate it corrects.

- admit, one round trip (`redis_timeout` at most): 1 request, the token estimate and a parallel
  slot (a sorted-set member scored by expiry) are reserved, or the script says which limit is
  full and when it frees. Reservation.close(used) hands the correction (real - estimate, either
  sign) and the slot's removal to this store: gathered for 10 ms, then one command per key on a
  pipeline the store owns (no task per request, never cancelled with the client); a lost one is
  retried by the heartbeat, and a crashed replica's slots expire `redis_lease_ttl` after its
  last heartbeat (which re-stamps live slots every ttl/3).
- keys `{<prefix>:quota:<key id>}:r|t|p`: one hash tag per client key (Cluster spreads keys
  over shards; one key's script touches one slot). The key id is the entry's name or its
  sha256, never the key.
- Redis slow or down: a request waits `redis_timeout` at most, then this process enforces its
  share (each limit / the number of processes last seen registered in Redis, 1 before any) on
  its own traffic; after a few failures in a row the store is `degraded` (a warning, the
  `sluicegate_quota_degraded` gauge, `/readyz` details) and the heartbeat probes until Redis
  takes a write, then shared enforcement resumes (router/state/store.py: the skeleton every
  shared store has in common; this module holds only the quota keys, scripts and logic).
- Across an outage: the local windows also count what Redis admitted for this process (so the
  share does not start from empty windows), and what the share admitted (with its corrections)
  is written into the shared windows' buckets when Redis answers again (so the shared window
  does not start without it). No 60 s window then admits more than about `limit x (1 +
  1/processes)` (the slack: a process's share beside what others admitted just before).
- A script error (an argument Redis cannot take) refuses that request with 429; it is not an
  outage, so it cannot move the key to the (smaller, fresh) local share.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from router.core.errors import RETRY_SOON, RateLimited, StoreUnavailable
from router.core.redis_client import Client, RedisTarget
from router.core.runner import Runner
from router.request.admit.quota import (
    BUCKETS,
    KeyLimits,
    Quotas,
    Reservation,
    rate_headers,
    refusal,
    too_large,
)
from router.state.store import ScriptFailed, SharedStore

log = logging.getLogger("sluicegate.quota")

_NOW = """
local now = tonumber(ARGV[1])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local sec = math.floor(now / 1000)
local first = sec - BUCKETS + 1
"""

# KEYS: requests hash, tokens hash, slots zset. ARGV: now_ms (0: Redis's clock), rpm, tpm,
# max_parallel (0: no limit), estimate, slot id (or ''), slot ttl ms. Returns "refused (0 ok,
# 1 rpm, 2 tpm, 3 parallel) requests-used tokens-used requests-reset-ms tokens-reset-ms bucket"
# ("used" includes this request when admitted).
_ADMIT = (
    _NOW
    + """
local function window(key, limit, need)
  local all = redis.call('HGETALL', key)
  local live, stale, total = {}, {}, 0
  for i = 1, #all, 2 do
    local b = tonumber(all[i])
    if b < first then
      stale[#stale + 1] = all[i]
    else
      local v = tonumber(all[i + 1])
      total = total + v
      live[#live + 1] = {b, v}
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  table.sort(live, function(x, y) return x[1] < y[1] end)
  local reset = 0
  if total + need > limit then
    -- when enough leaves for `need` (never more than the limit: a larger estimate is refused
    -- before this script, `quota.too_large`)
    local over = total + need - limit
    reset = BUCKETS * 1000
    for _, e in ipairs(live) do
      over = over - e[2]
      if over <= 0 then reset = (e[1] + BUCKETS) * 1000 - now break end
    end
    return total, reset, false
  end
  if #live > 0 then reset = (live[1][1] + BUCKETS) * 1000 - now end
  return total, reset, true
end
local rpm, tpm, par = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local est = tonumber(ARGV[5])
local refused = 0
local r_used, r_reset, t_used, t_reset = 0, 0, 0, 0
if rpm > 0 then
  local ok
  r_used, r_reset, ok = window(KEYS[1], rpm, 1)
  if not ok then refused = 1 end
end
if tpm > 0 then
  local ok
  t_used, t_reset, ok = window(KEYS[2], tpm, est)
  if not ok and refused == 0 then refused = 2 end
end
if refused == 0 and par > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= par then refused = 3 end
end
local function reply(code)
  -- one bulk string: a client parses it in one read, an array costs one per element
  return table.concat({code, r_used, t_used, r_reset, t_reset, sec}, ' ')
end
if refused ~= 0 then return reply(refused) end
local keep = BUCKETS * 1000 + 1000
if rpm > 0 then
  redis.call('HINCRBY', KEYS[1], sec, 1)
  redis.call('PEXPIRE', KEYS[1], keep)
  r_used = r_used + 1
end
if tpm > 0 then
  redis.call('HINCRBY', KEYS[2], sec, est)
  redis.call('PEXPIRE', KEYS[2], keep)
  t_used = t_used + est
end
if par > 0 then
  local ttl = tonumber(ARGV[7])
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[6])
  redis.call('PEXPIRE', KEYS[3], ttl * 3)
end
return reply(0)
"""
)

# KEYS: tokens hash, slots zset. ARGV: now_ms, then per request: its bucket, tokens delta, slot
# id (or ''). A correction goes to the bucket the estimate went to while that still counts (a
# refund never outlives its estimate); past it, only an overrun is charged, to the current one.
_RELEASE = (
    _NOW
    + """
local touched = false
for i = 2, #ARGV, 3 do
  if ARGV[i + 2] ~= '' then redis.call('ZREM', KEYS[2], ARGV[i + 2]) end
  local delta = tonumber(ARGV[i + 1])
  local b = tonumber(ARGV[i])
  if b < first then
    b = sec
    if delta < 0 then delta = 0 end
  end
  if delta ~= 0 then
    if redis.call('HINCRBY', KEYS[1], b, delta) <= 0 then redis.call('HDEL', KEYS[1], b) end
    touched = true
  end
end
if touched then redis.call('PEXPIRE', KEYS[1], BUCKETS * 1000 + 1000) end
return 1
"""
)

# KEYS: one slots zset. ARGV: now_ms, ttl ms, slot ids: re-stamps (or re-adds) each.
_REFRESH = (
    _NOW
    + """
local ttl = tonumber(ARGV[2])
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], now + ttl, ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl * 3)
return 1
"""
)

# KEYS: the processes zset, the epoch key. ARGV: now_ms, ttl ms, this process's id, a new epoch.
# Returns "<how many live> <epoch>": the epoch changes when Redis lost its data (a restart
# without persistence), and the windows with it.
_REGISTER = (
    _NOW
    + """
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl * 3)
local epoch = redis.call('GET', KEYS[2])
if not epoch then
  epoch = ARGV[4]
  redis.call('SET', KEYS[2], epoch)
end
return redis.call('ZCARD', KEYS[1]) .. ' ' .. epoch
"""
)

# KEYS: requests hash, tokens hash. ARGV: now_ms, then per bucket: its age in seconds, requests,
# tokens. What the local share admitted during an outage, into the buckets it went to; what has
# left the window is dropped, except a token overrun, charged to the current bucket.
_RESTORE = (
    _NOW
    + """
local keep = BUCKETS * 1000 + 1000
for i = 2, #ARGV, 3 do
  local b = sec - tonumber(ARGV[i])
  local r, t = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  if b < first then
    b, r = sec, 0
    if t < 0 then t = 0 end
  end
  if r ~= 0 then redis.call('HINCRBY', KEYS[1], b, r) redis.call('PEXPIRE', KEYS[1], keep) end
  if t ~= 0 then
    if redis.call('HINCRBY', KEYS[2], b, t) <= 0 then redis.call('HDEL', KEYS[2], b) end
    redis.call('PEXPIRE', KEYS[2], keep)
  end
end
return 1
"""
)

_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
RELEASE_DELAY = 0.01  # seconds releases are gathered before one command per key goes out
_LEDGER_MAX = 100_000  # (key, second) entries the local share wrote down; past this, dropped
_Owed = tuple[str, int, int, str]  # (key tag, bucket, tokens delta, slot id)


def key_tag(prefix: str, key_id: str) -> str:
    """`{prefix:quota:<id>}`: the key's own hash tag; ids that could break a tag are hashed."""
    kid = key_id if _SAFE_ID.fullmatch(key_id) else hashlib.sha256(key_id.encode()).hexdigest()
    return "{" + prefix + ":quota:" + kid + "}"


__all__ = ["ScriptFailed", "SharedQuotas", "SharedReservation", "key_tag"]


class SharedReservation:
    """What one admitted request holds in Redis; `close(used)` gives it back (idempotent)."""

    __slots__ = ("_book", "_bucket", "_estimate", "_mirror", "_slot", "_tag", "headers")

    def __init__(
        self,
        book: SharedQuotas,
        tag: str,
        bucket: int,
        estimate: int,
        slot: str,
        headers: list[tuple[bytes, bytes]],
        mirror: Reservation,
    ) -> None:
        self._book: SharedQuotas | None = book
        self._tag = tag
        self._bucket = bucket
        self._estimate = estimate  # 0 when the key has no tpm: nothing to correct
        self._slot = slot  # '' when the key has no max_parallel
        self.headers = headers
        self._mirror = mirror  # the same request in this process's own windows

    def close(self, used_tokens: float | None) -> None:
        book, self._book = self._book, None
        if book is None:
            return
        self._mirror.close(used_tokens)
        delta = 0
        if self._estimate and used_tokens is not None:
            delta = math.ceil(used_tokens) - self._estimate
        if self._slot:
            book._live.pop(self._slot, None)
        if delta or self._slot:
            book._release((self._tag, self._bucket, delta, self._slot))


class SharedQuotas(SharedStore[_Owed]):
    chore = "quota_heartbeat"
    log = log
    degraded_message = "redis unavailable for quotas; each process enforces its share locally"
    recovered_message = "redis answers again; quotas are shared"

    def __init__(
        self,
        target: str | RedisTarget | Client,
        *,
        timeout: float = 0.05,
        slot_ttl: float = 10.0,
        prefix: str = "sluicegate",
        clock: Callable[[], float] | None = None,
        heartbeat: bool = True,
        on_refused: Callable[[str, str], None] | None = None,
        on_degraded: Callable[[bool], None] | None = None,
        runner: Runner | None = None,
    ) -> None:
        super().__init__(
            target,
            timeout=timeout,
            tag="{" + prefix + ":quota}",
            beat_every=slot_ttl / 3,
            heartbeat=heartbeat,
            runner=runner,
            on_degraded=on_degraded,
        )
        self._ttl_ms = int(slot_ttl * 1000)
        self._prefix = prefix
        self._clock = clock
        self._on_refused = on_refused
        self.process_id = uuid.uuid4().hex[:12]
        self._seq = itertools.count(1)
        self._admit_sha = self._script(_ADMIT.replace("BUCKETS", str(BUCKETS)))
        self._release_sha = self._script(_RELEASE.replace("BUCKETS", str(BUCKETS)))
        self._refresh_sha = self._script(_REFRESH.replace("BUCKETS", str(BUCKETS)))
        self._register_sha = self._script(_REGISTER.replace("BUCKETS", str(BUCKETS)))
        self._restore_sha = self._script(_RESTORE.replace("BUCKETS", str(BUCKETS)))
        self._members_key = self._store_tag + ":processes"
        self._epoch_key = self._store_tag + ":epoch"
        self._epoch: str | None = None  # as last read: another one means the windows were lost
        self._tags: dict[str, str] = {}  # key id -> its hash tag
        self._live: dict[str, str] = {}  # slot id -> key tag, for this process
        self._releasing: list[_Owed] = []  # gathered for the next release command
        self._release_timer: asyncio.TimerHandle | None = None
        self._key_names: dict[str, tuple[bytes, bytes, bytes]] = {}
        # The fallback: this process's share of each limit, in this process (its windows also
        # count what Redis admitted here).
        self.local = Quotas(clock=clock or time.monotonic, on_refused=on_refused)
        # What the local share admitted, not yet in Redis: (key tag, local second) -> [requests,
        # tokens], written back by the heartbeat once Redis answers.
        self._ledger: dict[tuple[str, int], list[int]] = {}
        self._script_errors = 0
        self._script_logged = -math.inf
        self._shares: dict[KeyLimits, KeyLimits] = {}
        self.processes = 1  # processes enforcing quotas, as last seen registered in Redis
        self.fallbacks = 0  # requests decided locally because Redis did not answer in time

    def _tag(self, key_id: str) -> str:
        tag = self._tags.get(key_id)
        if tag is None:
            tag = self._tags[key_id] = key_tag(self._prefix, key_id)
        return tag

    def _keys(self, tag: str) -> tuple[bytes, bytes, bytes]:
        """The key's requests hash, tokens hash and slots set, as bytes (packed as they are)."""
        names = self._key_names.get(tag)
        if names is None:
            names = self._key_names[tag] = (
                (tag + ":r").encode(),
                (tag + ":t").encode(),
                (tag + ":p").encode(),
            )
        return names

    def _now_ms(self) -> int:
        return 0 if self._clock is None else int(self._clock() * 1000)

    def _log_fields(self) -> dict[str, Any]:
        return {"processes": self.processes}

    # --- the store's part of the heartbeat -------------------------------------------------

    async def _beat(self) -> None:
        """Register this process, re-stamp its live slots, write back what the local share
        admitted."""
        snapshot = dict(self._live)
        by_tag: dict[str, list[str]] = {}
        for slot, tag in snapshot.items():
            by_tag.setdefault(tag, []).append(slot)
        now = self._now_ms()
        key = self._members_key
        args = (now, self._ttl_ms, self.process_id)
        epoch_key, fresh = self._epoch_key, uuid.uuid4().hex[:16]
        reply = await self._call(
            self._store_tag, "EVALSHA", self._register_sha, 2, key, epoch_key, *args, fresh
        )
        members, epoch = (v.decode() if isinstance(v, bytes) else v for v in reply.split())
        lost = self._epoch is not None and epoch != self._epoch
        self._epoch = epoch
        for tag, slots in by_tag.items():
            stamp = (now, self._ttl_ms, *slots)
            await self._call(tag, "EVALSHA", self._refresh_sha, 1, tag + ":p", *stamp)
        await self._write_back(everything=lost)
        self.processes = max(1, int(members))
        self._shares.clear()
        # A slot released while the beat was on the wire may have been re-added by it.
        for slot, tag in snapshot.items():
            if slot not in self._live:
                self._release((tag, 0, 0, slot))

    async def _settle(self) -> None:
        """Owed releases, one command per key."""
        owed = self.owed.take()
        settled: set[int] = set()
        try:
            for tag, mine in _by_tag(owed).items():
                await self._call(tag, *self._release_command(tag, mine))
                settled.update(map(id, mine))
        finally:
            self.owed.give_back(entry for entry in owed if id(entry) not in settled)

    async def _closing(self) -> None:
        # Requests still running past the drain give their slots back now, not a slot ttl later
        # (as in-flight leases do); their own late `close` then sends nothing.
        for slot, tag in list(self._live.items()):
            self._release((tag, 0, 0, slot))
        self._live.clear()
        with contextlib.suppress(StoreUnavailable):  # the others' share grows at once
            await self._call(self._store_tag, "ZREM", self._members_key, self.process_id)

    async def flush(self, within: float = 5.0) -> None:
        """Send the releases gathered so far and wait (bounded) for every queued command."""
        if self._release_timer is not None:
            self._release_timer.cancel()
            self._send_releases()
        await super().flush(within)

    def in_use(self, key_id: str) -> tuple[float, float, int]:
        """This process's own traffic on the key (its local windows count what Redis admitted
        here too); the replicas' sum lives in Redis."""
        return self.local.in_use(key_id)

    def status(self) -> dict[str, Any]:
        """For /readyz: shared or each process its share, and how many processes share."""
        return {
            "mode": "local_share" if self.degraded else "shared",
            "processes": self.processes,
        }

    async def _write_back(self, everything: bool = False) -> None:
        """What the local share admitted, into the shared windows (one command per key); with
        `everything` (Redis came back empty) all this process admitted in the window, which its
        own windows hold."""
        if everything:
            self._ledger = {}
            for key_id, state in self.local.keys():
                tag = self._tag(key_id)
                for sec, requests in state.requests.buckets:
                    self._note(tag, int(sec), int(requests), 0)
                for sec, tokens in state.tokens.buckets:
                    self._note(tag, int(sec), 0, math.ceil(tokens))
        if not self._ledger:
            return
        now = int(self.local.clock())
        ledger, self._ledger = self._ledger, {}
        by_tag: dict[str, list[int]] = {}
        for (tag, sec), (requests, tokens) in ledger.items():
            if now - sec < BUCKETS or tokens > 0:  # the rest has left the window
                by_tag.setdefault(tag, []).extend((now - sec, requests, tokens))
        sent: set[str] = set()
        try:
            for tag, args in by_tag.items():
                keys = self._keys(tag)
                restore = ("EVALSHA", self._restore_sha, 2, keys[0], keys[1], self._now_ms())
                await self._call(tag, *restore, *args)
                sent.add(tag)
        finally:
            for (tag, sec), (requests, tokens) in ledger.items():
                if tag in by_tag and tag not in sent:  # kept for the next heartbeat
                    self._note(tag, sec, requests, tokens)

    def _note(self, tag: str, sec: int, requests: int, tokens: int) -> None:
        entry = self._ledger.get((tag, sec))
        if entry is None:
            if len(self._ledger) >= _LEDGER_MAX:
                return
            entry = self._ledger[(tag, sec)] = [0, 0]
        entry[0] += requests
        entry[1] += tokens

    # --- the hot path ----------------------------------------------------------------------

    async def admit(
        self, limits: KeyLimits, estimate: int, request_id: str
    ) -> SharedReservation | Reservation:
        big = too_large(limits, estimate, request_id)
        if big is not None:  # no window of the key ever admits it: Redis need not be asked
            if self._on_refused is not None:
                self._on_refused(limits.label, "tpm")
            raise big
        if self.degraded:
            return self._admit_local(limits, estimate, request_id)
        tag = self._tag(limits.key_id)
        est = math.ceil(estimate) if limits.tpm is not None else 0
        slot = f"{self.process_id}:{next(self._seq)}" if limits.max_parallel is not None else ""
        try:
            out = await self._call(
                tag,
                "EVALSHA",
                self._admit_sha,
                3,
                *self._keys(tag),
                self._now_ms(),
                limits.rpm or 0,
                limits.tpm or 0,
                limits.max_parallel or 0,
                est,
                slot,
                self._ttl_ms,
            )
        except ScriptFailed:
            self._script_error(limits)
            raise RateLimited(
                "The quota of this key could not be checked for this request; retry later.",
                request_id=request_id,
                headers=RETRY_SOON,
            ) from None
        except StoreUnavailable:
            if slot:  # the script may have run after we stopped waiting
                self.owed.add((tag, 0, 0, slot))
            return self._admit_local(limits, estimate, request_id)
        except BaseException:
            if slot:  # cancelled mid-call: same doubt, Redis is fine
                self._release((tag, 0, 0, slot))
            raise
        refused, r_used, t_used, r_reset, t_reset, bucket = (int(v) for v in out.split())
        headers: list[tuple[bytes, bytes]] = []
        if limits.rpm is not None:
            headers += rate_headers(b"requests", limits.rpm, r_used, r_reset / 1000)
        if limits.tpm is not None:
            headers += rate_headers(b"tokens", limits.tpm, t_used, t_reset / 1000)
        if refused:
            limit, what, reset = (
                ("rpm", "requests per minute", r_reset / 1000),
                ("tpm", "tokens per minute", t_reset / 1000),
                ("max_parallel", "parallel requests", 1.0),
            )[refused - 1]
            if self._on_refused is not None:
                self._on_refused(limits.label, limit)
            raise refusal(what, reset, headers, request_id)
        if slot:
            self._live[slot] = tag
        mirror = self.local.take(limits, est)
        return SharedReservation(self, tag, bucket, est, slot, headers, mirror)

    def _script_error(self, limits: KeyLimits) -> None:
        self._script_errors += 1
        if self._on_refused is not None:
            self._on_refused(limits.label, "error")
        now = time.monotonic()
        if now - self._script_logged >= 60:  # a client cannot turn it into a log flood
            self._script_logged = now
            log.warning(
                "quota script failed; request refused",
                extra={"fields": {"key": limits.label, "errors": self._script_errors}},
            )

    def _admit_local(self, limits: KeyLimits, estimate: int, request_id: str) -> Reservation:
        self.fallbacks += 1
        share = self._shares.get(limits)
        if share is None:
            share = self._shares[limits] = _share(limits, self.processes)
        held = self.local.admit_now(share, estimate, request_id, limits.tpm)
        tag = self._tag(limits.key_id)
        sec = int(self.local.clock())
        self._note(tag, sec, 1 if limits.rpm is not None else 0, estimate if limits.tpm else 0)
        if limits.tpm is not None:
            held.on_correct = lambda bucket, delta: self._note(tag, bucket, 0, delta)
        return held

    # --- releases ----------------------------------------------------------------------------

    def _release_command(self, tag: str, entries: list[_Owed]) -> tuple[Any, ...]:
        args: list[Any] = []
        for _, bucket, delta, slot in entries:
            args += (bucket, delta, slot)
        keys = self._keys(tag)
        return ("EVALSHA", self._release_sha, 2, keys[1], keys[2], self._now_ms(), *args)

    def _release(self, entry: _Owed) -> None:
        """Soon, with the others of its key in one command; never waited for. Releases are
        gathered for RELEASE_DELAY so a burst costs a command per key, not one per request (a
        slot is held that much longer). A lost one is retried by the heartbeat."""
        if self._closed:  # its slot went back with `aclose`; the connection is gone
            return
        if self.degraded:
            self.owed.add(entry)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.owed.add(entry)
            return
        self._releasing.append(entry)
        if self._release_timer is None:
            self._release_timer = loop.call_later(RELEASE_DELAY, self._send_releases)

    def _send_releases(self) -> None:
        self._release_timer = None
        entries, self._releasing = self._releasing, []
        if self.degraded:
            for entry in entries:
                self.owed.add(entry)
            return
        for tag, mine in _by_tag(entries).items():

            def lost(mine: list[_Owed] = mine) -> None:
                for entry in mine:
                    self.owed.add(entry)

            self._post(tag, self._release_command(tag, mine), lost)


def _by_tag(entries: list[_Owed]) -> dict[str, list[_Owed]]:
    out: dict[str, list[_Owed]] = {}
    for entry in entries:
        out.setdefault(entry[0], []).append(entry)
    return out


def _share(limits: KeyLimits, processes: int) -> KeyLimits:
    """This process's part of each limit while it enforces alone (at least 1)."""

    def part(v: int | None) -> int | None:
        return None if v is None else max(1, v // processes)

    return KeyLimits(
        limits.key_id, part(limits.rpm), part(limits.tpm), part(limits.max_parallel), limits.label
    )
