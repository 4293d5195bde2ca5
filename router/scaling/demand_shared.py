"""Declared models' demand summed over every replica in Redis: the scaler sees the deployment's.

Each process writes its own part of each declared model's demand (held plus in flight) into one
hash per model, `{<redis_prefix>}:demand:<model>`, field `<replica id>` = `<count>:<expiry ms>`
(Redis's own clock), and reads the sum of the fields that have not expired in the same script.
A part is re-written every third of `redis_lease_ttl` (the store's heartbeat) and at once when
it changes (the change wakes the heartbeat, so a burst is one round trip); a crashed replica's
part stops counting `redis_lease_ttl` after its last write, and the script deletes it.

Redis slow or down (router/state/store.py's rule): the totals fall back to this process's own
part, and the heartbeat writes again when Redis answers.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from router.core.errors import StoreUnavailable
from router.core.redis_client import Client, RedisTarget
from router.core.runner import Runner
from router.scaling.demand import LocalDemand
from router.state.store import SharedStore

log = logging.getLogger("sluicegate.demand")

# KEYS[1]: the model's hash; ARGV: replica id, its count, ttl in ms. Returns the live sum.
_WRITE_AND_SUM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. (now + ttl))
redis.call('PEXPIRE', KEYS[1], ttl)
local total = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local v = all[i + 1]
  local sep = string.find(v, ':', 1, true)
  local n = tonumber(string.sub(v, 1, sep - 1))
  if tonumber(string.sub(v, sep + 1)) > now then
    total = total + n
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
return total
"""


class SharedDemand(SharedStore[None], LocalDemand):
    chore = "demand_share"
    log = log
    degraded_message = "model demand not shared through Redis; scaling on this replica's own"
    recovered_message = "model demand shared through Redis again"

    def __init__(
        self,
        target: str | RedisTarget | Client,
        *,
        lease_ttl: float,
        timeout: float,
        prefix: str = "sluicegate",
        heartbeat: bool = True,
        runner: Runner | None = None,
    ) -> None:
        tag = "{" + prefix + "}"
        SharedStore.__init__(
            self,
            target,
            timeout=timeout,
            tag=tag,
            beat_every=lease_ttl / 3,
            heartbeat=heartbeat,
            runner=runner,
        )
        LocalDemand.__init__(self)
        self._key = tag + ":demand:"
        self._ttl_ms = max(1, round(lease_ttl * 1000))
        self._replica = os.urandom(8).hex()  # each process (worker) writes its own part
        self._sha = self._script(_WRITE_AND_SUM)
        self._summed: dict[str, int] = {}  # model -> the live sum, as of its last write
        self._written: dict[str, int] = {}  # model -> this process's part in that sum

    def _log_fields(self) -> dict[str, Any]:
        return {"models": len(self._summed)}

    def _changed(self, model: str) -> None:
        self._wake.set()  # the heartbeat writes the new part at once (a burst: one round)
        super()._changed(model)

    def total(self, model: str) -> int:
        mine = self.mine(model)
        if self.degraded or model not in self._summed:
            return mine
        # Others' parts as of the last write, and this process's own as of now.
        return max(0, self._summed[model] - self._written[model]) + mine

    async def _beat(self) -> None:
        h = self._holding
        if h is None:
            return
        for model in list(h.models):
            mine = self.mine(model)
            try:
                total = await self._call(
                    self._key,
                    "EVALSHA",
                    self._sha,
                    1,
                    self._key + model,
                    self._replica,
                    mine,
                    self._ttl_ms,
                )
            except StoreUnavailable:
                self._summed.pop(model, None)
                raise
            before = self.total(model)
            self._summed[model], self._written[model] = int(total), mine
            if self.total(model) != before:  # another replica's part moved
                super()._changed(model)

    async def _closing(self) -> None:
        # This replica's part goes now, not a lease later.
        h = self._holding
        for model in list(h.models) if h is not None else ():
            self._post(self._key, ("HDEL", self._key + model, self._replica), lambda: None)
