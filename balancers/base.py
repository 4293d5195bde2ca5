"""The Balancer protocol: given the eligible candidates, their loads and weights, pick one.

A balancer is pure: no I/O, no health, no clock. Health filters candidates before it is asked;
the in-flight store supplies the loads; the request's retry context supplies `exclude`.
A balancer whose choice ignores loads sets `needs_counts = False`, which lets a shared store
skip reading them (one Redis round trip instead of two); absent, it is taken as True.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    weight: float
    inflight: int


@runtime_checkable
class Balancer(Protocol):
    name: ClassVar[str]

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Candidate | None:
        """One of `candidates` not in `exclude`, or None when none is left."""
        ...


def needs_counts(balancer: Balancer) -> bool:
    return bool(getattr(balancer, "needs_counts", True))
