"""Least in flight relative to weight: an exact scan for small sets, power of two choices for
large ones. Ties go to a random one of the tied, drawn in proportion to weight, never to the
first listed: so an idle fleet still gets traffic in the ratio of its weights, and equal weights
spread evenly."""

from __future__ import annotations

import random
from collections.abc import Sequence, Set
from typing import ClassVar

from balancers.base import Candidate

EXACT_SCAN_MAX = 16


class LeastInflight:
    name: ClassVar[str] = "least_inflight"
    needs_counts: ClassVar[bool] = True

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Candidate | None:
        pool = [c for c in candidates if c.name not in exclude] if exclude else candidates
        if not pool:
            return None
        if len(pool) == 1:
            return pool[0]
        if len(pool) > EXACT_SCAN_MAX:
            pool = self._rng.sample(pool, 2)
        best_score = min(c.inflight / c.weight for c in pool)
        tied = [c for c in pool if c.inflight / c.weight == best_score]
        if len(tied) == 1:
            return tied[0]
        return weighted_choice(tied, self._rng.random())


def weighted_choice(tied: Sequence[Candidate], u: float) -> Candidate:
    """The candidate whose share of the total weight covers `u` in [0, 1)."""
    point = u * sum(c.weight for c in tied)
    for c in tied:
        point -= c.weight
        if point < 0:
            return c
    return tied[-1]
