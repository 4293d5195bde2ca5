"""Smooth weighted round-robin (nginx's): weights honoured, picks interleaved, equal = rotation."""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import ClassVar

from balancers.base import Candidate, Choice
from balancers.context import NO_CONTEXT, PickContext
from balancers.lora import eligible, labelled


class RoundRobin:
    name: ClassVar[str] = "round_robin"
    needs_counts: ClassVar[bool] = False
    needs_engine: ClassVar[bool] = False
    needs_hints: ClassVar[bool] = False
    needs_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self._current: dict[str, float] = {}

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext = NO_CONTEXT) -> Choice | None:
        want = ctx.adapter
        if want is not None:
            return labelled(self._pick(eligible(candidates, want), ctx.exclude), want)
        return self._pick(candidates, ctx.exclude)

    def _pick(self, candidates: Sequence[Candidate], exclude: Set[str]) -> Choice | None:
        best: Candidate | None = None
        best_weight = 0.0
        total = 0.0
        current = self._current
        for c in candidates:
            if c.name in exclude:
                continue
            w = current.get(c.name, 0.0) + c.weight
            current[c.name] = w
            total += c.weight
            if best is None or w > best_weight:
                best, best_weight = c, w
        if best is not None:
            current[best.name] = best_weight - total
            if len(current) > 4 * len(candidates) + 16:
                # Backends come and go; forget the ones no longer offered.
                keep = {c.name for c in candidates}
                self._current = {k: v for k, v in current.items() if k in keep}
            return Choice(best)
        return None
