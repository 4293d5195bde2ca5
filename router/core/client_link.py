"""Two ASGI scope extensions through which the server's connection to the client serves the
hot path directly (router/web/edge.py offers them; with another server, neither is there and
the lifecycle uses plain ASGI).

- `scope["extensions"][BODY_WRITE]`: a callable taking one chunk of a response already started
  with `more_body` chunks to come. It returns True when the chunk went to the connection (framed
  as `send` would frame it), False when it did not and the chunk must go through `send` (the
  client is gone, its writes are paused, the response is complete or not chunked). The pump
  uses it from the upstream connection's read callback (router/request/lifecycle/pump.py): a
  streamed token then costs no task wake-up, no future and no `send` coroutine.
- `scope["extensions"][ON_CLIENT_LOST]`: `(callback, watching)` registers `callback`, called
  once when the client's connection is lost, or on the loop's next turn if it is already
  (`watching` True), or unregisters it (False). The lifecycle registers one that cancels it
  (router/request/lifecycle/watch.py): no watcher task waiting on `receive` per request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

BODY_WRITE = "sluicegate.body_write"
ON_CLIENT_LOST = "sluicegate.on_client_lost"

BodyWrite = Callable[[bytes], bool]
OnClientLost = Callable[[Callable[[], None], bool], None]

_NONE: Mapping[str, Any] = {}


def body_write(scope: Mapping[str, Any]) -> BodyWrite | None:
    """The scope's direct body write, when its server offers one."""
    found = scope.get("extensions", _NONE).get(BODY_WRITE)
    return found if callable(found) else None


def on_client_lost(scope: Mapping[str, Any]) -> OnClientLost | None:
    """The scope's client-lost registration, when its server offers one."""
    found = scope.get("extensions", _NONE).get(ON_CLIENT_LOST)
    return found if callable(found) else None
