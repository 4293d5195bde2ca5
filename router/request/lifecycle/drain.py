"""Graceful shutdown: whether the process is draining, and how many calls are still running.

On SIGTERM the app sets `draining` (new requests get 503, `/readyz` turns 503) and waits up to
`drain_grace` seconds for `wait_idle()`: streams in flight finish, nothing new starts.
"""

from __future__ import annotations

import asyncio


class Lifecycle:
    """Draining state and the count of calls in progress, for graceful shutdown."""

    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, grace: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except TimeoutError:
            return False
        return True
