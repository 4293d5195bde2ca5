"""The lifecycle under a watcher of the client's connection.

When the client leaves, the lifecycle is cancelled wherever it is waiting (for the first byte,
between chunks, mid-write), which closes the upstream connection, so the backend stops
generating. Where the server says when the connection is lost (ON_CLIENT_LOST,
router/core/client_link.py), the lifecycle runs in the request's own task and the server's
callback cancels that task: no task is made per request. Elsewhere it runs as a task of its
own beside a watcher task reading `receive` (no `asyncio.wait` on both: a future and callbacks
on both tasks, twice, per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.types import Receive, Scope

from router.core.client_link import on_client_lost
from router.request.usage.record import RequestRecord


async def run_watched(
    lifecycle: Coroutine[Any, Any, None], scope: Scope, receive: Receive, rec: RequestRecord
) -> None:
    """Run `lifecycle` to its end, or until the client leaves (`rec.disconnected`, then it
    returns); when the caller itself is cancelled, the lifecycle is cancelled and its cleanup
    awaited before the cancellation goes on. No task is left either way."""
    register = on_client_lost(scope)
    task = asyncio.current_task()
    if register is not None and task is not None:
        await _run_here(lifecycle, register, task, rec)
        return
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


async def _run_here(
    lifecycle: Coroutine[Any, Any, None],
    register: Callable[[Callable[[], None], bool], None],
    task: asyncio.Task[Any],
    rec: RequestRecord,
) -> None:
    """`lifecycle` in this task, which the server's callback cancels when the client leaves."""

    def lost() -> None:
        rec.disconnected = True
        task.cancel()

    register(lost, True)
    try:
        await lifecycle
    except asyncio.CancelledError:
        # Ours alone (the client left): the lifecycle's cleanup ran, the request ends here. Any
        # other cancel as well (server shutdown) goes on.
        if not rec.disconnected or task.cancelling() > 1:
            raise
        task.uncancel()
    else:
        if rec.disconnected and task.cancelling():  # a step swallowed it: not left to others
            task.uncancel()
    finally:
        register(lost, False)  # with no await since: a loss from now on cancels nothing of ours
