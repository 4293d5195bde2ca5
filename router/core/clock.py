"""The process's time: monotonic seconds (`now`) and a wait on them (`sleep`), one pair.

`create_app(settings, clock=...)` takes one; the runner's chores wait on its `sleep` and the
parts whose behaviour is timed (health's ejections and probe schedule, admission's deadlines and
re-checks, KV-event retries) read its `now`, so a test that moves a manual clock drives all of
them without real waits. `SYSTEM` is the real one: `time.monotonic` and `asyncio.sleep`
themselves, so a part that calls `clock.now` on the request path pays no wrapper.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float, /) -> None: ...


class SystemClock:
    now = staticmethod(time.monotonic)
    sleep = staticmethod(asyncio.sleep)


SYSTEM: Clock = SystemClock()
