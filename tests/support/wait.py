"""The suite's one poller: wait until a state holds, and fail naming it when it does not.

A test waits on the state it needs (a count back to 0, a backend ejected, a line logged), never on
a length of time. `within` bounds only a state that never comes: it is not a promise about speed,
so a test that holds the router to a time asserts the seconds `wait_for` returns. `every` is how
often `check` runs; a check that costs a round trip to several processes may ask for less.

`wait_for_async` is the same for a test's own event loop: its check does not block, and may be a
coroutine function (a store's heartbeat). A blocking check, an HTTP call, goes to a thread
instead: `await asyncio.to_thread(wait_for, ...)`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable


def wait_for(
    check: Callable[[], object], what: str, within: float = 10.0, every: float = 0.02
) -> float:
    """Poll `check` until it returns something true; the seconds that took. Fails naming `what`
    when it still does not hold at a check begun after `within` seconds."""
    start = time.monotonic()
    while True:
        late = time.monotonic() - start > within  # so the last check starts past the deadline
        if check():
            return time.monotonic() - start
        if late:
            raise AssertionError(f"not within {within:g} s: {what}")
        time.sleep(every)


async def wait_for_async(
    check: Callable[[], object], what: str, within: float = 10.0, every: float = 0.02
) -> float:
    """`wait_for` on the running event loop: the loop serves other tasks between checks."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        late = loop.time() - start > within
        held = check()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return loop.time() - start
        if late:
            raise AssertionError(f"not within {within:g} s: {what}")
        await asyncio.sleep(every)
