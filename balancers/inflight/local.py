"""In-process in-flight counts: the default, exact for a single worker, no network."""

from __future__ import annotations

from collections.abc import Sequence, Set

from balancers.base import Balancer, Candidate
from balancers.context import NO_CONTEXT, PickContext
from balancers.inflight.base import Lease, Readings
from router.core.backend import Backend


class LocalInflight:
    kind = "local"
    degraded = False

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    async def start(self) -> None:
        return None

    def candidates(
        self, backends: Sequence[Backend], exclude: Set[str], readings: Readings | None = None
    ) -> list[Candidate]:
        counts = self._counts
        out = []
        for b in backends:
            if b.name in exclude:
                continue
            n = counts.get(b.name, 0)
            if b.max_inflight is not None and n >= b.max_inflight:
                continue
            out.append(Candidate(b.name, b.weight, n, readings.get(b.name) if readings else None))
        return out

    async def acquire(
        self,
        backends: Sequence[Backend],
        balancer: Balancer,
        ctx: PickContext = NO_CONTEXT,
        readings: Readings | None = None,
    ) -> Lease | None:
        return self.acquire_now(backends, balancer, ctx, readings)

    def acquire_now(
        self,
        backends: Sequence[Backend],
        balancer: Balancer,
        ctx: PickContext = NO_CONTEXT,
        readings: Readings | None = None,
    ) -> Lease | None:
        choice = balancer.pick(self.candidates(backends, ctx.exclude, readings), ctx)
        if choice is None:
            return None
        name = choice.candidate.name
        self._counts[name] = self._counts.get(name, 0) + 1
        return Lease(name, choice=choice)

    def release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        n = self._counts.get(lease.backend, 0) - 1
        if n > 0:
            self._counts[lease.backend] = n
        else:
            self._counts.pop(lease.backend, None)

    def count(self, name: str) -> int:
        return self._counts.get(name, 0)

    async def counts(self, names: Sequence[str]) -> dict[str, int]:
        return {n: self._counts.get(n, 0) for n in names}

    async def aclose(self) -> None:
        return None
