"""A clock that moves only when the test moves it, for `create_app(clock=...)`, the runner and
the parts that take a clock: `advance(seconds)` ends the sleeps it passes, so a test drives an
ejection's end, a probe schedule or an admission deadline without waiting for it.

A chore woken by `advance` still needs the event loop's turns to do its round: `until(check)`
gives them until `check()` holds (real time only turns a hang into a failure), `settle()` a
fixed number of them, before a check that something did not happen.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable

GUARD = 5.0  # real seconds before a wait counts as hung


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = 0

    def now(self) -> float:
        return self.t

    def __call__(self) -> float:  # for the parts that take a bare `() -> float`
        return self.t

    async def sleep(self, seconds: float, /) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._sleepers, (self.t + seconds, self._seq, fut))
        await fut  # cancelled: its entry is dropped when the clock passes it

    def advance(self, seconds: float) -> None:
        self.t += seconds
        heap = self._sleepers
        while heap and heap[0][0] <= self.t:
            fut = heapq.heappop(heap)[2]
            if not fut.done():
                fut.set_result(None)

    @property
    def sleeping(self) -> int:
        """Sleeps under way (not ended, not cancelled)."""
        return sum(1 for _, _, fut in self._sleepers if not fut.done())


async def until(check: Callable[[], bool], what: str = "", within: float = GUARD) -> None:
    """The event loop's turns (and real I/O) until `check()` holds."""
    try:
        async with asyncio.timeout(within):
            while not check():  # noqa: ASYNC110 (state other tasks change)
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"not within {within} s: {what or check}") from None


async def settle(turns: int = 50) -> None:
    """`turns` of the event loop: what a woken chore does next has been done."""
    for _ in range(turns):
        await asyncio.sleep(0)
