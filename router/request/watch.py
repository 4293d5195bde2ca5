"""The lifecycle task under a watcher of the client's connection.

When the client leaves, the watcher cancels the lifecycle wherever it is waiting (for the first
byte, between chunks, mid-write), which closes the upstream connection, so the backend stops
generating. No `asyncio.wait` on both (a future and callbacks on both tasks, twice, per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from starlette.types import Receive

from router.request.record import RequestRecord


async def run_watched(
    lifecycle: Coroutine[Any, Any, None], receive: Receive, rec: RequestRecord
) -> None:
    """Run `lifecycle` to its end, or until the client leaves (`rec.disconnected`, then it
    returns); when the caller itself is cancelled, the lifecycle is cancelled and its cleanup
    awaited before the cancellation goes on. No task is left either way."""
    run = asyncio.ensure_future(lifecycle)
    watch = asyncio.ensure_future(_watch_disconnect(receive, run, rec))
    try:
        try:
            await run  # cancelled with us (server shutdown); we wait for its cleanup
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if not rec.disconnected or (me is not None and me.cancelling()):
                raise
            # The client left: the lifecycle was stopped by the watcher, not us.
    finally:
        if not watch.done():
            watch.cancel()
        if not run.done():  # we ourselves were cancelled (server shutdown)
            run.cancel()
            await asyncio.wait((run,))


async def _watch_disconnect(
    receive: Receive, run: asyncio.Future[None], rec: RequestRecord
) -> None:
    """When the client leaves: stop the upstream now, wherever the lifecycle is waiting."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not run.done():
                rec.disconnected = True
                run.cancel()
            return
