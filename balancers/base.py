"""The Balancer protocol: given the eligible candidates, their loads and weights, pick one.

A balancer is pure: no I/O, no health, no clock. Health filters candidates before it is asked;
the in-flight store supplies the loads; the request's retry context supplies `exclude`.
A balancer whose choice ignores loads sets `needs_counts = False`, which lets a shared store
skip reading them (one Redis round trip instead of two); absent, it is taken as True.
A balancer may also offer its policy in the Redis store's own language (`RedisForm`): the store
then picks and counts in one atomic script across replicas, instead of reading counts, picking
here and adding the lease (two round trips, and a race between them).
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


@runtime_checkable
class RedisForm(Protocol):
    """The same policy as `pick()`, in Lua, for the Redis in-flight store's acquire script.

    `redis_pick` defines `local function pick(n, load, weight)`: candidates are 1..n, `load(i)`
    is candidate i's count across every replica (false when it is at its `max_inflight`),
    `weight(i)` its weight; it returns the chosen index, or nil when none has room. `load` reads
    Redis on first use, so a policy that looks at two candidates reads two. It must choose as
    `pick()` does: tests/test_balancer_parity.py runs both forms through the same cases.
    """

    redis_pick: ClassVar[str]


def redis_form(balancer: Balancer) -> str | None:
    """The balancer's Lua form, when it offers one."""
    return balancer.redis_pick if isinstance(balancer, RedisForm) else None
