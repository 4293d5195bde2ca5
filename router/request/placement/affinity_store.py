"""The prefix index shared in Redis, so every replica and worker routes `cache_aware` as one.

Keys: one sorted set per backend, `{<redis_prefix>:affinity}:blocks:<backend>` (one hash tag, so
on Redis Cluster a script's keys share a slot), member = a block hash (8 bytes,
router/request/placement/prefix.py), score = when that backend was last sent it (ms, Redis's clock).
A record scores block i of the chain `t - i/1000`: the head is the most recent, so trimming a
backend to its KV capacity in blocks (ZREMRANGEBYRANK from the lowest; capped at
MAX_BLOCKS_PER_BACKEND as the local index is) drops prompt tails first, as the local index
(balancers/prefix_index.py) and vLLM do. Hence block i present implies blocks 0..i-1 present,
and a lookup binary-searches each candidate with ZSCORE: O(log n) per candidate.
Expiry (`affinity.ttl`, default 1 h): members older than it are dropped at the next record and
ignored by lookups, and each key expires ttl after its last record, so a dead fleet leaves
nothing. The bound is capacity, not time: an idle engine keeps its cache for hours, so a short
ttl would only lose affinity for chats that pause; an hour clears what a vanished backend left.

One round trip per request: `match()` runs one script that first applies the records queued by
earlier dispatches (write-behind: `record()` only queues) and then answers the lookup. When no
lookup comes within FLUSH_AFTER (a lull), a timer sends the queued records alone. Concurrent
requests' scripts share pipelined round trips (router/state/batch.py).
Faults (router/state/store.py, the skeleton every shared store has in common): a lookup waits at
most `timeout` (`redis_timeout`); on failure or timeout the caller uses its local index
(`match()` returns None, `fallbacks` += 1). After a few failed round trips in a row lookups go
local at once (one warning per outage) and a probe write every half second waits for Redis;
queued records (the latest MAX_PENDING: the store's owed work) are then replayed.
`entries`: (block, backend) pairs Redis held for the backends of this process's last scripts.
The prefix homes table (balancers/prefix_homes.py) is shared in the same script and round trip:
`...:homes` (block -> home), `...:homes_lru` (its recency, trimmed to MAX_HOME_BLOCKS) and
`...:homes_count` (each backend's share); a lookup also answers the prompt's home (`look()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from balancers.prefix_homes import GROUP_SHARE, MAX_HOME_BLOCKS
from balancers.prefix_index import MAX_BLOCKS_PER_BACKEND
from router.core.errors import StoreUnavailable
from router.core.redis_client import Client, RedisTarget
from router.core.runner import Runner
from router.state.store import SharedStore

log = logging.getLogger("sluicegate.affinity")

FLUSH_AFTER = 0.005  # s a record waits for a lookup to ride on before it is sent alone
MAX_CARRY = 16  # records one script applies (steady load: ~1; a replay spreads over several)
MAX_PENDING = 1024  # records queued (an outage keeps the latest); older ones are dropped
_MAX_CARDS = 4096  # backends whose shared entry counts are remembered

# KEYS: the lookup's candidates (ARGV[3] of them), then the other records' backends.
# ARGV: now_ms (0: Redis's clock), ttl_ms, candidates, the lookup's hashes concatenated, then per
# record: its key's index in KEYS, max blocks, age in ms, its hashes concatenated.
# Returns each candidate's matched leading blocks, then every key's size.
_SCRIPT = """
local now = tonumber(ARGV[1])
if now == 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local ttl = tonumber(ARGV[2])
local oldest = now - ttl
-- The last three keys are the homes table (balancers/prefix_homes.py, the same rule): block ->
-- 'c' or 'u' (counted toward its home's share or not) .. home; its recency; homes' shares.
local nk = #KEYS - 3
local HOMES, HLRU, HCOUNT = KEYS[nk + 1], KEYS[nk + 2], KEYS[nk + 3]
local function scored(key, blob, n, t)
  local i = 0
  while i < n do
    local args = {}
    local stop = math.min(n, i + 256)
    for j = i, stop - 1 do
      args[#args + 1] = t - j * 0.001  -- Redis passes numbers on exactly (%.17g)
      args[#args + 1] = string.sub(blob, j * 8 + 1, j * 8 + 8)
    end
    redis.call('ZADD', key, unpack(args))
    i = stop
  end
end
-- Homed blocks are prefix-closed (a record homes a whole chain, head scored newest, and trims
-- drop the oldest): the deepest homed block of a chain is found by binary search.
local function homed(b, n)
  local function has(m)
    return redis.call('HEXISTS', HOMES, string.sub(b, (m - 1) * 8 + 1, m * 8)) == 1
  end
  if n == 0 or not has(1) then return 0 end
  local lo, hi = 1, n
  while lo < hi do
    local mid = math.floor((lo + hi + 1) / 2)
    if has(mid) then lo = mid else hi = mid - 1 end
  end
  return lo
end
local function home(blob, n, backend, t)
  local known = homed(blob, n)
  if known < n then
    local counted = known < GROUP_SHARE * n
    local owner, flag = backend, 'c'
    if not counted then
      owner = string.sub(redis.call('HGET', HOMES, string.sub(blob, known * 8 - 7, known * 8)), 2)
      flag = 'u'
    end
    for j = known, n - 1 do
      local set = redis.call('HSETNX', HOMES, string.sub(blob, j * 8 + 1, j * 8 + 8), flag .. owner)
      if set == 1 and counted then redis.call('HINCRBY', HCOUNT, owner, 1) end
    end
  end
  scored(HLRU, blob, n, t)
  local card = redis.call('ZCARD', HLRU)
  if card > HOME_CAP then
    local gone = redis.call('ZPOPMIN', HLRU, card - HOME_CAP)
    for g = 1, #gone, 2 do
      local v = redis.call('HGET', HOMES, gone[g])
      redis.call('HDEL', HOMES, gone[g])
      if v and string.sub(v, 1, 1) == 'c' then
        local who = string.sub(v, 2)
        if redis.call('HINCRBY', HCOUNT, who, -1) <= 0 then redis.call('HDEL', HCOUNT, who) end
      end
    end
  end
end
local at = 5
while at <= #ARGV do
  local key = KEYS[tonumber(ARGV[at])]
  local cap = tonumber(ARGV[at + 1])
  local t = now - tonumber(ARGV[at + 2])
  local blob = ARGV[at + 3]
  local n = math.floor(#blob / 8)
  scored(key, blob, n, t)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. oldest)
  local card = redis.call('ZCARD', key)
  if card > cap then redis.call('ZREMRANGEBYRANK', key, 0, card - cap - 1) end
  redis.call('PEXPIRE', key, ttl)
  if n > 0 then home(blob, n, string.sub(key, PLEN + 1), t) end
  at = at + 4
end
if at > 5 then
  for k = nk + 1, #KEYS do redis.call('PEXPIRE', KEYS[k], ttl) end
end
local blob = ARGV[4]
local n = math.floor(#blob / 8)
local function has(key, m)
  local s = redis.call('ZSCORE', key, string.sub(blob, (m - 1) * 8 + 1, m * 8))
  return s and tonumber(s) >= oldest
end
local out = {}
local look = tonumber(ARGV[3])
for k = 1, look do
  local key = KEYS[k]
  local lo = 0
  if n > 0 and has(key, 1) then
    lo = 1
    local hi = n
    while lo < hi do
      local mid = math.floor((lo + hi + 1) / 2)
      if has(key, mid) then lo = mid else hi = mid - 1 end
    end
  end
  out[k] = lo
end
for k = 1, nk do
  out[look + k] = redis.call('ZCARD', KEYS[k])
end
-- The prompt's deepest homed block and its home, then each candidate's share of homes.
local depth, owner = homed(blob, n), ''
if depth > 0 then
  owner = string.sub(redis.call('HGET', HOMES, string.sub(blob, depth * 8 - 7, depth * 8)), 2)
end
out[look + nk + 1] = depth
out[look + nk + 2] = owner
for k = 1, look do
  out[look + nk + 2 + k] = tonumber(redis.call('HGET', HCOUNT, string.sub(KEYS[k], PLEN + 1)) or 0)
end
return out
"""


@dataclass(frozen=True, slots=True)
class Shared:
    """One lookup's answer: the blocks each candidate holds, and the shared homes table's."""

    held: dict[str, int]  # candidate -> leading blocks held (absent: none)
    home: str | None  # the home of the prompt's deepest homed block (any backend)
    depth: int  # how many leading blocks are homed
    counts: dict[str, int]  # candidate -> blocks it is home to (`PrefixHomes.place`)
    cards: dict[str, int]  # candidate -> blocks the shared index holds for it (its room)


# (backend, max blocks, when queued (monotonic s), hashes concatenated)
_Record = tuple[str, int, float, bytes]


class SharedPrefixIndex(SharedStore[_Record]):
    chore = "prefix_index_probe"
    log = log
    degraded_message = "redis prefix index unavailable; routing on this process's own index"
    recovered_message = "redis prefix index answers again; routing on the shared index"
    owed_max = MAX_PENDING

    def __init__(
        self,
        target: str | RedisTarget | Client,
        *,
        timeout: float = 0.05,
        ttl: float = 3600.0,
        prefix: str = "sluicegate",
        clock: Callable[[], float] | None = None,
        flush_after: float = FLUSH_AFTER,
        runner: Runner | None = None,
        max_home_blocks: int = MAX_HOME_BLOCKS,
    ) -> None:
        # No beat of its own: the chore runs only to probe while degraded.
        tag = "{" + prefix + ":affinity}"
        super().__init__(target, timeout=timeout, tag=tag, beat_every=None, runner=runner)
        self._ttl_ms = int(ttl * 1000)
        self._prefix = tag + ":blocks:"
        self._homes = [tag + ":homes", tag + ":homes_lru", tag + ":homes_count"]
        self._clock = clock  # seconds; None: Redis's clock (one clock for every replica)
        self._flush_after = flush_after
        source = _SCRIPT.replace("PLEN", str(len(self._prefix.encode())))
        source = source.replace("HOME_CAP", str(max_home_blocks))
        self._sha = self._script(source.replace("GROUP_SHARE", repr(GROUP_SHARE)))
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._cards: dict[str, int] = {}
        self.fallbacks = 0  # lookups answered by the local index instead
        self.scripts = 0  # scripts sent (lookups and lone record flushes)
        self.entries = 0

    def key(self, backend: str) -> str:
        return self._prefix + backend

    def _log_fields(self) -> dict[str, Any]:
        return {"replayed": len(self.owed)}

    # --- lifecycle -------------------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _closing(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._tasks:  # a lone flush under way: let it end (bounded by its timeout)
            await asyncio.wait(list(self._tasks))

    async def _settle(self) -> None:
        """The queued records, replayed (while degraded they wait here)."""
        await self._send_records()

    # --- the hot path ----------------------------------------------------------------------

    def record(self, hashes: Sequence[bytes], backend: str, max_blocks: int) -> None:
        """`backend` was sent this prompt: queued for the next script (write-behind)."""
        if not hashes or self._closed:
            return
        # Capped as the local index is: the bound is an engine's report, which may be absurd.
        blocks = max(1, min(max_blocks, MAX_BLOCKS_PER_BACKEND))
        self.owed.add((backend, blocks, time.monotonic(), b"".join(hashes)))
        if self._timer is None and not self.degraded:
            with contextlib.suppress(RuntimeError):  # no loop: the next lookup carries it
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(self._flush_after, self._flush_due)

    async def match(self, hashes: Sequence[bytes], names: Sequence[str]) -> dict[str, int] | None:
        """For each of `names` holding at least the first block: how many leading blocks, as
        every replica recorded them; None when Redis did not answer within the timeout."""
        found = await self.look(hashes, names)
        return None if found is None else found.held

    async def look(self, hashes: Sequence[bytes], names: Sequence[str]) -> Shared | None:
        """`match()`'s answer with the shared homes table's (None: Redis did not answer)."""
        if self._closed:  # shut down: the client is gone, the local index answers
            return None
        if self.degraded:
            self.fallbacks += 1
            return None
        try:
            return await self._run(hashes, names)
        except StoreUnavailable:
            self.fallbacks += 1
            return None

    async def _run(self, hashes: Sequence[bytes], names: Sequence[str]) -> Shared:
        carried = self.owed.take(MAX_CARRY)
        keys = [self.key(n) for n in names]
        slot = {n: i for i, n in enumerate(names, 1)}
        args: list[Any] = [self._now_ms(), self._ttl_ms, len(names), b"".join(hashes)]
        order = list(names)
        now = time.monotonic()
        for backend, max_blocks, queued, blob in carried:
            i = slot.get(backend)
            if i is None:
                keys.append(self.key(backend))
                order.append(backend)
                i = slot[backend] = len(keys)
            args += (i, max_blocks, int((now - queued) * 1000), blob)
        keys += self._homes
        self.scripts += 1
        try:
            out = await self._call(self._store_tag, "EVALSHA", self._sha, len(keys), *keys, *args)
        except BaseException:
            self.owed.give_back(carried)
            raise
        look, blocks = len(names), len(order)
        cards = self._cards
        if len(cards) > _MAX_CARDS:
            cards.clear()
        for backend, card in zip(order, out[look : look + blocks], strict=True):
            cards[backend] = int(card)
        self.entries = sum(cards.values())
        held = {n: int(v) for n, v in zip(names, out[:look], strict=True) if v}
        depth, owner = int(out[look + blocks]), out[look + blocks + 1]
        home = (owner.decode() if isinstance(owner, bytes) else str(owner)) if depth else None
        counts = {n: int(c) for n, c in zip(names, out[look + blocks + 2 :], strict=True) if c}
        return Shared(held, home, depth, counts, {n: cards[n] for n in names if n in cards})

    def _now_ms(self) -> int:
        return 0 if self._clock is None else int(self._clock() * 1000)

    # --- write-behind ----------------------------------------------------------------------

    def _flush_due(self) -> None:
        self._timer = None
        if self.owed and not self.degraded:
            self._spawn(self._flush())

    async def _flush(self) -> None:
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(self._timeout):
                await self._send_records()

    async def _send_records(self) -> None:
        while self.owed:
            await self._run((), ())
