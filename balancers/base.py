"""The Balancer protocol: given the eligible candidates, their loads and weights, pick one.

A balancer is pure: no I/O, no health, no clock. Health filters candidates before it is asked;
the in-flight store supplies the loads; the request's retry context supplies `exclude`.
A balancer whose choice ignores loads sets `needs_counts = False`, which lets a shared store
skip reading them (one Redis round trip instead of two); absent, it is taken as True.
A balancer that reads engine metrics sets `needs_engine = True`: the proxy then hands the store
the latest `EngineReading`s and each `Candidate` carries its backend's (`engine`, None when the
backend is not scraped); absent, it is taken as False and `engine` stays None.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from router.core.engine import EngineReading


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    weight: float
    inflight: int
    engine: EngineReading | None = None


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


def needs_engine(balancer: Balancer) -> bool:
    return bool(getattr(balancer, "needs_engine", False))
