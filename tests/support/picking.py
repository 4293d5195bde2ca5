"""A balancer with one request's context, for tests that pick with it many times."""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, replace

from balancers.base import Balancer, Candidate, Choice
from balancers.context import PickContext


@dataclass
class Bound:
    balancer: Balancer
    ctx: PickContext

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Choice | None:
        return self.balancer.pick(candidates, replace(self.ctx, exclude=exclude))
