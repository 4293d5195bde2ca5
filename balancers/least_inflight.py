"""Least in flight relative to weight: an exact scan for small sets, power of two choices for
large ones. Ties go to a random one of the tied, drawn in proportion to weight, never to the
first listed: so an idle fleet still gets traffic in the ratio of its weights, and equal weights
spread evenly.

`redis_pick` is the same policy in Lua, run by the Redis in-flight store inside its acquire
script (see `balancers.base.RedisForm`); keep the two in step."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from balancers.base import Candidate, Choice
from balancers.context import NO_CONTEXT, PickContext
from balancers.lora import eligible, labelled

EXACT_SCAN_MAX = 16

_REDIS_PICK = """
local function pick(n, load, weight)
  local function scan(idx)
    local best, tied, total = nil, {}, 0
    for _, i in ipairs(idx) do
      local c = load(i)
      if c then
        local w = weight(i)
        local s = c / w
        if best == nil or s < best then
          best, tied, total = s, {i}, w
        elseif s == best then
          tied[#tied + 1] = i
          total = total + w
        end
      end
    end
    return tied, total
  end
  local all = {}
  for i = 1, n do all[i] = i end
  local tied, total
  if n > EXACT_SCAN_MAX then
    local a = math.random(n)
    local b = math.random(n - 1)
    if b >= a then b = b + 1 end
    tied, total = scan({a, b})
    if #tied == 0 then tied, total = scan(all) end
  else
    tied, total = scan(all)
  end
  if #tied == 0 then return nil end
  if #tied == 1 then return tied[1] end
  local point = math.random() * total
  for _, i in ipairs(tied) do
    point = point - weight(i)
    if point < 0 then return i end
  end
  return tied[#tied]
end
""".replace("EXACT_SCAN_MAX", str(EXACT_SCAN_MAX))


class LeastInflight:
    name: ClassVar[str] = "least_inflight"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = False
    needs_hints: ClassVar[bool] = False
    needs_tokens: ClassVar[bool] = False
    redis_pick: ClassVar[str] = _REDIS_PICK

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext = NO_CONTEXT) -> Choice | None:
        exclude = ctx.exclude
        pool = [c for c in candidates if c.name not in exclude] if exclude else candidates
        want = ctx.adapter
        if want is not None:
            return labelled(self.among(eligible(pool, want)), want)
        return self.among(pool)

    def among(self, pool: Sequence[Candidate]) -> Choice | None:
        """The least loaded of `pool` (nothing excluded)."""
        if not pool:
            return None
        if len(pool) == 1:
            return Choice(pool[0])
        if len(pool) > EXACT_SCAN_MAX:
            pool = self._rng.sample(pool, 2)
        best_score = min(c.inflight / c.weight for c in pool)
        tied = [c for c in pool if c.inflight / c.weight == best_score]
        if len(tied) == 1:
            return Choice(tied[0])
        return Choice(weighted_choice(tied, self._rng.random()))


def weighted_choice(tied: Sequence[Candidate], u: float) -> Candidate:
    """The candidate whose share of the total weight covers `u` in [0, 1)."""
    point = u * sum(c.weight for c in tied)
    for c in tied:
        point -= c.weight
        if point < 0:
            return c
    return tied[-1]
