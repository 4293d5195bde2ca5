"""Send a prompt to the engine that probably still caches its prefix, unless that engine is busy.

cost(c) = load(c) - cached_tokens(c) / TOKENS_PER_LOAD        (lowest cost wins)

- load(c): `least_load`'s score (engine queue, batch, KV use, our dispatches since the scrape,
  per weight; in-flight count without a reading), i.e. the expected queueing ahead of us;
- cached_tokens(c): the prompt's leading blocks that the prefix index says c was last sent
  (`Hints.held`, blocks x block_chars / CHARS_PER_TOKEN), i.e. prefill it would skip;
- TOKENS_PER_LOAD: prefill worth one unit of `least_load` (a running request; a waiting one is
  4): with continuous batching a running request barely delays our first token, a queued one
  delays it by about one prefill of ~1k tokens; so a 6k-token conversation outweighs 24 running
  or 6 queued requests elsewhere. The load bound, not the score, keeps a hot prefix in check.
Guardrail (bounded loads, Mirrokni et al.): a holder of the prefix whose requests in flight
through sluicegate (`Candidate.inflight` per weight: exact, and shared across replicas with the
Redis store, where a scrape lags) plus this one would exceed ceil(load_factor x (total + 1) / n)
over the n candidates, and that is SPILL_MIN_GAP above the least loaded one (at low load the
last turn's lease may not be released yet when the next turn arrives; that must not break
affinity), is passed over;
if every holder is, the request spills to the least loaded candidate (`least_load`'s pick), which
then joins the prefix's holders (the proxy records it).
Session affinity comes first when the request names a session (`Hints.session`: the ring point
of its key): consistent hashing with bounded loads over the candidates (balancers/session_ring.py),
the key's home unless it is over the same bound, else the next backend clockwise under it (a
backend whose engine reading is stale is left off the ring until it is read again).
Reasons: `session` (the key's home), `prefix` (the pick holds part of the prompt), `spill` (a
holder or the key's home was passed over for the bound), `load` (no candidate holds any of the
prompt, or load outweighed the cache).
It only ever sees eligible candidates (health, ejection, draining, `max_inflight` and the retry's
`exclude` are applied before), so affinity never overrides them. Pure: the match arrives as data
through `with_hints()`, which returns this request's picker; plain `pick()` is `least_load`'s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import ClassVar

from balancers.base import Candidate
from balancers.least_inflight import weighted_choice
from balancers.least_load import LeastLoad
from balancers.session_ring import Ring

CHARS_PER_TOKEN = 4
TOKENS_PER_LOAD = 250.0
SPILL_MIN_GAP = 2.0


@dataclass(frozen=True, slots=True)
class Hints:
    """What one request brings to the choice, computed outside the balancer."""

    blocks: int  # blocks in the request's prefix chain
    block_chars: int
    held: Mapping[str, int]  # backend -> how many leading blocks the index says it holds
    session: int | None = None  # the session key's point on the ring (None: no session)


class CacheAware:
    name: ClassVar[str] = "cache_aware"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = True

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._load = LeastLoad(self._rng)
        self._rings: dict[frozenset[str], Ring] = {}  # candidate set -> its ring

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Candidate | None:
        return self._load.pick(candidates, exclude)

    def with_hints(self, hints: Hints, load_factor: float) -> HintedPick:
        return HintedPick(self, hints, load_factor)

    def ring(self, names: frozenset[str]) -> Ring:
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) >= 16:  # health and capacity reshape the set; keep recent ones
                self._rings.clear()
            ring = self._rings[names] = Ring(names)
        return ring


class HintedPick:
    """One request's `cache_aware` picker; after `pick()`, `reason` and `held` say why."""

    name: ClassVar[str] = "cache_aware"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = True

    def __init__(self, owner: CacheAware, hints: Hints, load_factor: float) -> None:
        self._owner = owner
        self._load = owner._load
        self._hints = hints
        self._factor = load_factor
        self.reason = "load"
        self.held = 0  # leading blocks the picked backend holds

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Candidate | None:
        pool = [c for c in candidates if c.name not in exclude] if exclude else candidates
        hints = self._hints
        held = hints.held
        self.reason, self.held = "load", 0
        if not pool:
            return None
        if hints.session is None and not any(c.name in held for c in pool):
            return self._load.pick(pool)
        score = self._load.score
        live = [(s, c) for c in pool if (s := score(c)) != math.inf]
        if not live:  # only stale readings: nothing to weigh the cache against
            return self._load.pick(pool)
        requests = {c.name: c.inflight / c.weight for _, c in live}
        cap = math.ceil(self._factor * (sum(requests.values()) + 1) / len(live))
        floor = min(requests.values()) + SPILL_MIN_GAP

        def over(c: Candidate) -> bool:
            r = requests[c.name]
            return r + 1 / c.weight > cap and r >= floor

        if hints.session is not None:
            by_name = {c.name: c for _, c in live}
            ring = self._owner.ring(frozenset(by_name))
            for i, name in enumerate(ring.walk(hints.session)):
                c = by_name[name]
                if not over(c):
                    self.reason = "session" if i == 0 else "spill"
                    self.held = held.get(name, 0)
                    return c
            self.reason = "spill"
            return self._load.pick(pool)

        per_token = hints.block_chars / CHARS_PER_TOKEN / TOKENS_PER_LOAD
        options: list[tuple[float, Candidate]] = []
        passed_over = False
        for s, c in live:
            blocks = held.get(c.name, 0)
            if blocks and over(c):
                passed_over = True
                continue
            options.append((s - blocks * per_token, c))
        if not options:  # every holder is over the bound: the least loaded takes it
            self.reason = "spill"
            return self._load.pick([c for _, c in live if c.name not in held] or pool)
        best = min(cost for cost, _ in options)
        tied = [c for cost, c in options if cost == best]
        chosen = tied[0] if len(tied) == 1 else weighted_choice(tied, self._owner._rng.random())
        self.held = held.get(chosen.name, 0)
        self.reason = "prefix" if self.held else ("spill" if passed_over else "load")
        return chosen
