"""Send a prompt to the engine that probably still caches its prefix, unless that engine is busy.

cost(c) = load(c) - cached_tokens(c) / TOKENS_PER_LOAD        (lowest cost wins)

- load(c): `least_load`'s score (engine queue, batch, KV use, our dispatches since the scrape,
  per weight; in-flight count without a reading), i.e. the expected queueing ahead of us;
- cached_tokens(c): the prompt's leading blocks that the prefix index says c was last sent
  (`PrefixMatch.held`, blocks x block_chars / CHARS_PER_TOKEN), i.e. prefill it would skip;
- TOKENS_PER_LOAD: saving this much prefill is worth one request of queueing (an engine
  prefills ~1k tokens in the time of a few decode steps; a request ahead of us costs about
  that many steps before our first token), so a 6k-token conversation outweighs a queue of 6.
Guardrail (bounded loads, Mirrokni et al.): a holder of the prefix whose request load (load(c)
without its KV term) plus this request would exceed ceil(load_factor x (total + 1) / n) over the
n candidates, and that is SPILL_MIN_GAP requests above the least loaded one, is passed over (the
gap keeps affinity at low load, where a scrape taken mid-turn still shows the last turn running);
if every holder is, the request spills to the least loaded candidate (`least_load`'s pick), which
then joins the prefix's holders (the proxy records it).
Reasons: `prefix` (the pick holds part of the prompt), `spill` (a holder was passed over for the
bound), `load` (no candidate holds any of it, or load outweighed the cache).
It only ever sees eligible candidates (health, ejection, draining, `max_inflight` and the retry's
`exclude` are applied before), so affinity never overrides them. Pure: the match arrives as data
through `with_prefix()`, which returns this request's picker; plain `pick()` is `least_load`'s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import ClassVar

from balancers.base import Candidate
from balancers.least_inflight import weighted_choice
from balancers.least_load import KV_WEIGHT, LeastLoad

CHARS_PER_TOKEN = 4
TOKENS_PER_LOAD = 1000.0
SPILL_MIN_GAP = 2.0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    blocks: int  # blocks in the request's prefix chain
    block_chars: int
    held: Mapping[str, int]  # backend -> how many leading blocks the index says it holds


class CacheAware:
    name: ClassVar[str] = "cache_aware"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = True

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._load = LeastLoad(self._rng)

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Candidate | None:
        return self._load.pick(candidates, exclude)

    def with_prefix(self, match: PrefixMatch, load_factor: float) -> PrefixPick:
        return PrefixPick(self._load, self._rng, match, load_factor)


class PrefixPick:
    """One request's `cache_aware` picker; after `pick()`, `reason` and `held` say why."""

    name: ClassVar[str] = "cache_aware"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = True

    def __init__(
        self, load: LeastLoad, rng: random.Random, match: PrefixMatch, load_factor: float
    ) -> None:
        self._load = load
        self._rng = rng
        self._match = match
        self._factor = load_factor
        self.reason = "load"
        self.held = 0  # leading blocks the picked backend holds

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Candidate | None:
        pool = [c for c in candidates if c.name not in exclude] if exclude else candidates
        held = self._match.held
        self.reason, self.held = "load", 0
        if not pool:
            return None
        if not held or not any(c.name in held for c in pool):
            return self._load.pick(pool)
        score = self._load.score
        scored = [(score(c), c) for c in pool]
        live = [(s, c) for s, c in scored if s != math.inf]
        if not live:  # only stale readings: nothing to weigh the cache against
            return self._load.pick(pool)
        requests = [s - _kv_term(c) for s, c in live]
        cap = math.ceil(self._factor * (sum(requests) + 1) / len(live))
        floor = min(requests) + SPILL_MIN_GAP
        per_token = self._match.block_chars / CHARS_PER_TOKEN / TOKENS_PER_LOAD
        options: list[tuple[float, Candidate]] = []
        passed_over = False
        for (s, c), r in zip(live, requests, strict=True):
            blocks = held.get(c.name, 0)
            if blocks and r + 1 / c.weight > cap and r >= floor:
                passed_over = True
                continue
            options.append((s - blocks * per_token, c))
        if not options:  # every holder is over the bound: the least loaded takes it
            self.reason = "spill"
            return self._load.pick([c for _, c in live if c.name not in held] or pool)
        best = min(cost for cost, _ in options)
        tied = [c for cost, c in options if cost == best]
        chosen = tied[0] if len(tied) == 1 else weighted_choice(tied, self._rng.random())
        self.held = held.get(chosen.name, 0)
        self.reason = "prefix" if self.held else ("spill" if passed_over else "load")
        return chosen


def _kv_term(c: Candidate) -> float:
    r = c.engine
    return KV_WEIGHT * r.kv_usage / c.weight if r is not None and not r.stale else 0.0
