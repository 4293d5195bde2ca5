"""The InflightStore protocol: pick-and-count in one step, release that can't be lost.

`acquire` asks the balancer for one of the backends that still have capacity and counts the new
request against it (atomically for shared stores); the lease carries the balancer's `Choice`,
so the request path reads the reason where it reads the backend. `release` is synchronous and
never raises, so the proxy can call it from a `finally` that is being cancelled; a shared store
hands the network call to a task it owns. `degraded` is True while a shared store has fallen
back to local counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from balancers.base import Balancer, Choice
from balancers.context import NO_CONTEXT, PickContext
from router.core.backend import Backend
from router.core.engine import EngineReading

Readings = Mapping[str, EngineReading]


@dataclass(slots=True)
class Lease:
    backend: str
    token: str = ""
    released: bool = field(default=False)
    choice: Choice | None = None  # the pick behind it (None: a lease rebuilt only to release)


class InflightStore(Protocol):
    @property
    def kind(self) -> str:
        """`local` or `redis`: shown by the admin API."""
        ...

    @property
    def degraded(self) -> bool:
        """True while a shared store has fallen back to counting locally."""
        ...

    async def start(self) -> None: ...

    async def acquire(
        self,
        backends: Sequence[Backend],
        balancer: Balancer,
        ctx: PickContext = NO_CONTEXT,
        readings: Readings | None = None,
    ) -> Lease | None:
        """A lease on the backend `balancer` picks for `ctx`, or None when every candidate is
        full or in `ctx.exclude`. `readings` (engine metrics by backend name) ride along on
        each `Candidate`."""
        ...

    def release(self, lease: Lease) -> None: ...

    async def counts(self, names: Sequence[str]) -> dict[str, int]: ...

    async def aclose(self) -> None: ...
