"""The hop marker: every upstream request says which routers it passed, so none loops.

Each router deployment has an id (`deployment_id`, or one per `serve` shared by its workers).
An upstream request carries `x-sluicegate-hop: <ids of the routers before us>, <our id>`; a
request that arrives already naming our id has been here before (a backend, configured or
discovered, points back at the router), and is refused with 508 Loop Detected before its body
is read. So is one naming MAX_HOPS routers: two deployments pointing at each other loop
through different ids. Routers chained on purpose (one team's sluicegate in front of
another's) have different ids and pass.

Cost per request: one pass over the request's header names (bytes compares) and, when a client
sent the header, one join.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from router.core.errors import Loop

HOP_HEADER = b"x-sluicegate-hop"
MAX_HOPS = 8


def new_deployment_id() -> str:
    return uuid.uuid4().hex[:16]


class HopMarker:
    __slots__ = ("_id", "_own", "id")

    def __init__(self, deployment_id: str | None = None) -> None:
        self.id = deployment_id or new_deployment_id()
        self._own = self.id.encode("ascii")
        self._id = self._own.lower()

    def outgoing(self, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
        """The marker to send upstream for a request with these headers; raises `Loop` (508)."""
        prior: list[bytes] | None = None
        for name, value in headers:
            if name == HOP_HEADER or (len(name) == 16 and name.lower() == HOP_HEADER):
                if prior is None:
                    prior = []
                prior.extend(v for p in value.split(b",") if (v := p.strip()))
        if prior is None:
            return self._own
        if any(p.lower() == self._id for p in prior):
            raise Loop(
                "This request already passed through this router: a backend points back at it.",
                code="loop_detected",
            )
        if len(prior) >= MAX_HOPS:
            raise Loop(
                f"This request passed through {len(prior)} routers already: a routing loop.",
                code="too_many_hops",
            )
        return b", ".join((*prior, self._own))
