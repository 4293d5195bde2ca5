"""The InflightStore protocol: pick-and-count in one step, release that can't be lost.

`acquire` asks the balancer for one of the backends that still have capacity and counts the new
request against it (atomically for shared stores). `release` is synchronous and never raises, so
the proxy can call it from a `finally` that is being cancelled; a shared store hands the network
call to a task it owns. `degraded` is True while a shared store has fallen back to local counts.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Protocol

from balancers.base import Balancer
from router.core.backend import Backend


@dataclass(slots=True)
class Lease:
    backend: str
    token: str = ""
    released: bool = field(default=False)


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
        self, backends: Sequence[Backend], balancer: Balancer, exclude: Set[str]
    ) -> Lease | None:
        """A lease on the picked backend, or None when every candidate is full or excluded."""
        ...

    def release(self, lease: Lease) -> None: ...

    async def counts(self, names: Sequence[str]) -> dict[str, int]: ...

    async def aclose(self) -> None: ...
