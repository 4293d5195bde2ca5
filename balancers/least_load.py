"""Least engine load relative to weight, from what each vLLM/SGLang engine reports.

score = (running' + QUEUE_WEIGHT x waiting' + KV_WEIGHT x kv_usage) / weight

(running', waiting') = the engine's figures moved by ours_since (`now_on`)

- running, waiting: the engine's own batch and queue (everyone's requests, also those that
  never passed through this router); a waiting request costs QUEUE_WEIGHT running ones, since a
  newcomer waits behind all of them before its first token;
- ours_since: how far sluicegate's own in-flight count for that backend (`Candidate.inflight`,
  shared across replicas with the Redis store) has moved since the reading: since the scrape was
  sent when the reading says what it was then (`EngineReading.inflight_at`), else since this
  balancer first saw it: requests dispatched since count as running, requests finished since
  are taken off, the queue first (`now_on`), so a burst between two scrapes spreads out instead
  of landing on the engine that looked idle, and a follow-up does not see its own finished
  first turn still queued there; at least our in-flight count beyond the engine's running +
  waiting (sent before the page was rendered, not yet on the engine);
- kv_usage: the share of the KV cache in use (0..1); a full cache admits nothing and preempts;
- a backend without a reading (not scraped, `kind: openai`) scores its in-flight count, which is
  in the same unit (requests); a stale reading ranks after every fresh one ("most loaded"),
  and among stale ones the in-flight count decides.
- a request for a LoRA adapter (`ctx.adapter`, balancers/lora.py): only engines serving it
  are candidates (or, with load on demand and none serving it, engines running LoRA), and each
  adds QUEUE_WEIGHT x lora.ahead() / weight: by tier, running it 0, a free slot 1, waiting for a
  slot 4, to be loaded first 16 (+1 per adapter running there), plus the adapter's home term
  (QUEUE_WEIGHT x lora.HOME x a rendezvous hash in [0, 1): up to 24); `reason` is the tier's.
With no reading among the candidates the pick is exactly `least_inflight`'s. Exact scan up to
16 candidates, power of two choices above; ties drawn at random in proportion to weight.
Pure: no I/O, no clock; the readings arrive on the candidates (`Candidate.engine`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from balancers.base import Candidate, Choice
from balancers.context import NO_CONTEXT, AdapterWant, PickContext
from balancers.least_inflight import EXACT_SCAN_MAX, LeastInflight, weighted_choice
from balancers.lora import REASONS, ahead, eligible, tier
from router.core.engine import EngineReading

QUEUE_WEIGHT = 4.0
KV_WEIGHT = 16.0
_STALE = float("inf")


def now_on(r: EngineReading, since: float) -> tuple[float, float]:
    """(running, waiting) on the engine now, as far as we know: the reading moved by our own
    requests since it (`LeastLoad.since`). Ours dispatched since run; ours finished since were
    in its figures: taken off its queue first (a request the reading caught waiting, ours or
    another's, has run since), then its batch."""
    if since >= 0:
        return r.running + since, r.waiting
    waiting = r.waiting + since
    if waiting >= 0:
        return r.running, waiting
    running = r.running + waiting
    return (running if running > 0 else 0.0), 0.0


class LeastLoad:
    name: ClassVar[str] = "least_load"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = True
    needs_hints: ClassVar[bool] = False
    needs_tokens: ClassVar[bool] = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._fallback = LeastInflight(self._rng)
        # backend -> (reading seq, our in-flight count when that reading was first seen)
        self._base: dict[str, tuple[int, int]] = {}

    def since(self, c: Candidate) -> int:
        """Our requests on `c` that its engine reading does not show: those dispatched since the
        reading was first seen, less those finished since (negative when more finished), or, when
        more, our in-flight count beyond the engine's own running and waiting (requests still in
        transit when its page was rendered, which the first count would lose); 0 without a
        reading."""
        r = c.engine
        if r is None:
            return 0
        base = self._base.get(c.name)
        if base is None or base[0] != r.seq:
            if len(self._base) > 4096:  # backends come and go; keep what is recent
                self._base.clear()
            at = r.inflight_at
            base = self._base[c.name] = (r.seq, c.inflight if at is None else at)
        dispatched = c.inflight - base[1]
        unseen = c.inflight - int(r.running + r.waiting)
        return dispatched if dispatched >= unseen else unseen

    def score(self, c: Candidate) -> float:
        r = c.engine
        if r is None:
            return c.inflight / c.weight
        if r.stale:
            return _STALE
        running, waiting = now_on(r, self.since(c))
        return (running + QUEUE_WEIGHT * waiting + KV_WEIGHT * r.kv_usage) / c.weight

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext = NO_CONTEXT) -> Choice | None:
        exclude = ctx.exclude
        pool = [c for c in candidates if c.name not in exclude] if exclude else candidates
        want = ctx.adapter
        if want is not None:
            return self.for_adapter(pool, want)
        return self.among(pool)

    def among(self, pool: Sequence[Candidate]) -> Choice | None:
        """The least loaded of `pool` (nothing excluded, no adapter)."""
        if not pool:
            return None
        for c in pool:
            if c.engine is not None:
                break
        else:
            return self._fallback.among(pool)
        return Choice(pool[0] if len(pool) == 1 else self._choose(pool))

    def for_adapter(self, pool: Sequence[Candidate], want: AdapterWant) -> Choice | None:
        """A request for an adapter: among the engines it may run on, the score plus the
        adapter's tier and home (module docstring); the reason is the tier's."""
        pool = eligible(pool, want)
        if not pool:
            return None
        score = self.score
        scored = [(score(c) + QUEUE_WEIGHT * ahead(c, want) / c.weight, c) for c in pool]
        best = min(s for s, _ in scored)
        if best == _STALE:
            scored = [(c.inflight / c.weight + ahead(c, want), c) for _, c in scored]
            best = min(s for s, _ in scored)
        tied = [c for s, c in scored if s == best]
        chosen = tied[0] if len(tied) == 1 else weighted_choice(tied, self._rng.random())
        return Choice(chosen, REASONS[tier(chosen.engine, want, chosen.name)])

    def _choose(self, pool: Sequence[Candidate]) -> Candidate:
        if len(pool) > EXACT_SCAN_MAX:
            pair = self._rng.sample(pool, 2)
            if not all(c.engine is not None and c.engine.stale for c in pair):
                pool = pair
        score = self.score
        scored = [(score(c), c) for c in pool]
        best = min(s for s, _ in scored)
        if best == _STALE:  # only stale readings left: least in flight among them
            scored = [(c.inflight / c.weight, c) for _, c in scored]
            best = min(s for s, _ in scored)
        tied = [c for s, c in scored if s == best]
        if len(tied) == 1:
            return tied[0]
        return weighted_choice(tied, self._rng.random())
