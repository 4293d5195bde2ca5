"""Least in flight relative to weight: an exact scan for small sets, power of two choices for
large ones; ties go to a random one of the tied, never to the first listed."""

from __future__ import annotations

import random
from collections.abc import Sequence, Set
from typing import ClassVar

from balancers.base import Candidate

EXACT_SCAN_MAX = 16


class LeastInflight:
    name: ClassVar[str] = "least_inflight"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Candidate | None:
        pool = [c for c in candidates if c.name not in exclude] if exclude else candidates
        if not pool:
            return None
        if len(pool) > EXACT_SCAN_MAX:
            a, b = self._rng.sample(pool, 2)
            sa, sb = a.inflight / a.weight, b.inflight / b.weight
            if sa == sb:
                return a if self._rng.random() < 0.5 else b
            return a if sa < sb else b
        best_score = min(c.inflight / c.weight for c in pool)
        tied = [c for c in pool if c.inflight / c.weight == best_score]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)
