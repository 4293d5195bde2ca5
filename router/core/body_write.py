"""An ASGI scope extension: write a response body chunk to the client's connection at once.

`scope["extensions"][BODY_WRITE]`, when the server offers it, is a callable taking one chunk of
a response already started with `more_body` chunks to come. It returns True when the chunk went
to the connection (framed as `send` would frame it), False when it did not and the chunk must go
through `send` (the client is gone, its writes are paused, the response is complete or not
chunked). The pump uses it from the upstream connection's read callback (router/request/pump.py):
a streamed token then costs no task wake-up, no future and no `send` coroutine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

BODY_WRITE = "sluicegate.body_write"

BodyWrite = Callable[[bytes], bool]

_NONE: Mapping[str, Any] = {}


def body_write(scope: Mapping[str, Any]) -> BodyWrite | None:
    """The scope's direct body write, when its server offers one."""
    found = scope.get("extensions", _NONE).get(BODY_WRITE)
    return found if callable(found) else None
