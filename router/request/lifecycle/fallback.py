"""The fallback step: a request its model cannot serve goes on as a request for the next model of
its chains (router/request/placement/fallbacks.py; docs/fallbacks.md).

`fall_back` moves the call to that model (its backends, balancer, body and record, what is
charged from then on) and counts it; False when no model is left, and the client then gets the
original error. `answer_whole` sends a backend's error answer read whole (a refusal no fallback
took) as the backend gave it, with the served model's header.
"""

from __future__ import annotations

from starlette.types import Send

from router.core.errors import FallbackReason
from router.request.lifecycle.call import Call
from router.request.lifecycle.parts import Parts

MODEL_HEADER = b"x-sluicegate-model"


def fall_back(parts: Parts, call: Call, reason: FallbackReason) -> bool:
    """Move `call` on to its next fallback model for `reason`; False: none is left."""
    route = call.fallback
    if route is None or call.started:
        return False
    target = route.next(reason, call.snapshot.by_model, call.endpoint.errors)
    if target is None:
        return False
    moved(parts, call, target, reason)
    return True


def moved(parts: Parts, call: Call, target: str, reason: FallbackReason) -> None:
    """Count, log and trace the move to `target`, and make the call one for it."""
    assert call.fallback is not None
    source = call.model
    parts.metrics.fell_back(source, target, reason.value)
    call.trace.fell_back(source, target, reason.value)
    call.record.fallback_from = call.fallback.origin
    call.record.error = None
    call.retarget(parts, target)


async def answer_whole(
    call: Call, send: Send, response: tuple[int, list[tuple[bytes, bytes]], bytes]
) -> None:
    status, headers, body = response
    call.record.status = status
    headers = [*headers, (MODEL_HEADER, call.model.encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    call.started = True
    await send({"type": "http.response.body", "body": body})
    call.record.bytes_out = len(body)
