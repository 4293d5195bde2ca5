"""The stream pump: a backend's answer relayed to the client chunk by chunk, as it comes.

The per-chunk work is inline in `pump` (a call per chunk costs more than the checks that let
most chunks skip it): the usage reader sees every chunk; the usage event sluicegate asked for is
taken out (`UsageStrip`); a migratable stream's text is kept (`Relayed`) and a continuation's
events joined (`Stitch`); a new stored response's id is remembered. A failure mid-body ends the
stream with an error event, or raises `Broken` when the stream may go on elsewhere. The pump
owns one cleanup: the relay it registered for migration is untracked however it ends.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.types import Send

from router.core.backend import Backend
from router.core.errors import (
    UPSTREAM_FAILURES,
    FailureKind,
    mid_stream_kind,
    sse_error_event,
)
from router.request.lifecycle.call import Call
from router.request.lifecycle.endings import Broken
from router.request.lifecycle.parts import Parts
from router.request.migration.relay import CHOICES_END, Relayed
from router.request.migration.stitch import Stitch
from router.request.placement.response_ids import Holder
from router.request.usage.parse import ResponseUsage
from router.request.usage.strip import FINISHED, USAGE_OBJECT, UsageStrip
from router.upstream.transport import Answer

if TYPE_CHECKING:
    from router.engine.kv_events import Flight
    from router.request.placement.token_load import TokenFlight

_DONE = b"data: [DONE]\n\n"
_DONE_TAIL = _DONE[-4:]
# A new response's id: the first `"id"` of the body or of the `response.created` event.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"([^"\\]{1,256})"')
_ID_WINDOW = 65536  # the id comes in the first event: bytes looked at for it, at most


async def pump(
    parts: Parts,
    call: Call,
    send: Send,
    response: Answer,
    backend: Backend,
    streaming: bool,
    flight: Flight | None,
    tokens: TokenFlight | None = None,
) -> None:
    """Relay `response` from `backend` to the client; `flight`: the attempt's KV flight there,
    told when the prompt is computed (the first chunk); `tokens`: its token load there
    (`balancer: latency`), told the first chunk and each batch of tokens counted."""
    rec = call.record
    tail = b"\n\n"
    usage = rec.usage = ResponseUsage(call.endpoint.usage)
    if tokens is not None:
        usage.on_count = tokens.streamed
        tokens.streaming = streaming
    # A new stored response: its id is remembered before the client can see it.
    seen: bytes | None = b"" if call.remembers and response.status_code < 400 else None
    readable = response.headers.get("content-encoding", "identity") == "identity"
    watch = usage.feed if streaming and readable else usage.keep
    # The usage event sluicegate asked for is read (by `watch`), then taken out.
    strip = None
    if call.inject and streaming and readable:
        strip = UsageStrip(backend.kind == "openai")
    ended = False  # [DONE] seen: the usage is read
    # What a migratable stream relayed (None: migration off for this call), and the stitch
    # of a continuation (None: the first stream, relayed byte-exact).
    relay = _relay_for(parts, call, backend) if streaming and readable else None
    if relay is not None:
        usage.sink = relay.take  # the usage reader's batches are what the relay keeps
    stitch = call.stitch
    searched = relay is not None or strip is not None  # they read a chunk's finish reason
    # A plain chunk (whole choices events, no finish reason, no usage object, nothing held)
    # needs nothing of the loop below but the usage reader and the write: the upstream
    # connection's read callback passes it on itself, through the server's direct write, while
    # this task waits (no wake-up, future or `send` per token). Whatever else comes, and every
    # chunk the direct write refuses, wakes this task as before, in order.
    write = call.body_write if seen is None and stitch is None and readable else None
    sink: Callable[[bytes], bool] | None = None
    if write is not None:
        put = write

        def direct(chunk: bytes) -> bool:
            if chunk[-4:] != CHOICES_END or (searched and chunk.rfind(FINISHED) >= 0):
                return False
            if relay is not None and relay.slow:
                return False
            if strip is not None and (strip.slow or chunk.rfind(USAGE_OBJECT) >= 0):
                return False
            if not put(chunk):
                return False
            watch(chunk)
            rec.bytes_out += len(chunk)
            return True

        sink = direct

    # `bytes` counts what the client was sent, also when it left mid-stream.
    try:
        async for chunk in response.stream:
            if rec.ttfb_ms is None:
                rec.ttfb_ms = round((time.perf_counter() - rec.started) * 1000, 2)
                if flight is not None:
                    flight.prefilled()
                if tokens is not None:
                    tokens.first_token()
                if sink is not None:  # after the first chunk: it times the first byte
                    response.stream.divert(sink)
            # Four bytes: the end of a choices event (CHOICES_END), of [DONE], or of neither,
            # told apart by comparing them, not by a method call per chunk.
            tail = chunk[-4:]
            # One search per chunk, shared by the relay and the strip: a choice's last event
            # (a finish reason that is not null, `"error"` among them).
            finish = searched and chunk.rfind(FINISHED) >= 0
            # Only a chunk ending inside an event, or in an event that is not a choices event
            # (an engine's `{"error": ...}`, which it sends last, or [DONE] after it), holding
            # a finish reason, or following a held part (or a move) concerns the relay.
            if relay is not None and (finish or relay.slow or tail != CHOICES_END):
                chunk = relay.feed(chunk)
                if not chunk:
                    if relay.broken is not None:
                        break
                    continue
                tail = chunk[-4:]
                finish = chunk.rfind(FINISHED) >= 0  # it may be what the relay held
                if finish and not relay.slow:
                    # The one choice finished (a migratable call has one), not in error:
                    # nothing is left to continue, and the usage event and [DONE] after it
                    # need no parsing.
                    parts.migration.untrack(backend.name, relay)
                    usage.sink = None
                    relay = None
            watch(chunk)
            if tail == _DONE_TAIL and not ended and chunk.endswith(_DONE):
                # The openai SDK closes once it reads [DONE], maybe before the engine's end
                # of body arrives here (a disconnect then cancels this): the usage, which
                # came before [DONE], is read now.
                usage.close(readable)
                ended = True
            if seen is not None:
                seen = await _remember_id(parts, call, seen + chunk, backend)
            # Inline (a method call per chunk costs more; `rfind` less than `in`): only a chunk
            # holding the usage object or a finish reason, ending inside an event or following
            # a held part needs the strip.
            if strip is not None and (
                strip.slow
                or finish
                or (tail != CHOICES_END and not tail.endswith(b"\n\n"))
                or chunk.rfind(USAGE_OBJECT) >= 0
            ):
                chunk = strip.feed(chunk)
                if not chunk:
                    continue
            if stitch is not None:
                chunk = stitch.feed(chunk)
                if not chunk:
                    continue
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            rec.bytes_out += len(chunk)
            if relay is not None and relay.broken is not None:
                break
    except UPSTREAM_FAILURES as exc:
        kind = mid_stream_kind(exc)
        rec.error = kind
        parts.health.on_failure(backend.name, kind)
        if not streaming or not readable:
            # A plain body can't carry an error event: abort so the client sees it incomplete.
            raise
        message = (
            f"Backend `{backend.name}` timed out mid-stream."
            if kind is FailureKind.TIMEOUT
            else f"Backend `{backend.name}` failed mid-stream."
        )
        if relay is not None and not relay.spoiled:
            usage.flush()  # the relay's last batch
            await _release(send, call, strip, stitch)
            raise Broken(kind, message, relay, "connection") from exc
        if call.why_not is not None:
            message += f" Not migrated: {call.why_not}."
        event = sse_error_event(message, "upstream_error", f"upstream_{kind}", call.anthropic)
        held = strip.flush() if strip is not None else b""
        if held or not tail.endswith(b"\n\n"):
            event = held + b"\n\n" + event  # end the half event so the error parses alone
        await send({"type": "http.response.body", "body": event, "more_body": False})
        rec.bytes_out += len(event)
        return
    finally:
        if relay is not None:
            parts.migration.untrack(backend.name, relay)
    if relay is not None and relay.slow and relay.broken is None:
        # The stream ended inside an event (no blank line after its last one): what the relay
        # held goes on as it would without migration (the usage event among it taken out).
        last = relay.flush()
        if last:
            watch(last)
            if strip is not None:
                last = strip.feed(last)
            if stitch is not None and last:
                last = stitch.feed(last)
            if last:
                await send({"type": "http.response.body", "body": last, "more_body": True})
                rec.bytes_out += len(last)
    if relay is not None and relay.broken is not None:
        why = relay.broken
        if why != "moved":  # the engine's own error: a failure of that backend
            rec.error = FailureKind.MID_STREAM
            parts.health.on_failure(backend.name, FailureKind.MID_STREAM)
        message = (
            f"Backend `{backend.name}` is being removed."
            if why == "moved"
            else f"Backend `{backend.name}` failed mid-stream ({why.replace('_', ' ')})."
        )
        usage.flush()  # the relay's last batch
        await _release(send, call, strip, stitch)
        raise Broken(FailureKind.MID_STREAM, message, relay, why)
    if response.status_code < 400:
        # The answer came whole: only now a success (an engine that breaks every answer
        # mid-way must reach `consecutive_failures`, not be reset by each answer's start).
        parts.health.on_success(backend.name)
    if not ended:
        usage.close(readable and response.status_code < 400)
    held = strip.flush() if strip is not None else b""
    rec.bytes_out += len(held)
    await send({"type": "http.response.body", "body": held, "more_body": False})


async def _release(send: Send, call: Call, strip: UsageStrip | None, stitch: Stitch | None) -> None:
    """Before a stream goes on elsewhere, what the strip holds back goes to the client: whole
    events (the relay passes no partial one), the last of them ending in a CR, which a LF might
    have followed. The relay counted them as relayed: the continuation follows them."""
    held = strip.flush() if strip is not None else b""
    if held and stitch is not None:
        held = stitch.feed(held)
    if held:
        await send({"type": "http.response.body", "body": held, "more_body": True})
        call.record.bytes_out += len(held)


def _relay_for(parts: Parts, call: Call, backend: Backend) -> Relayed | None:
    """A record of what this attempt relays, when it may migrate (tracked: a backend being
    removed moves the streams on it)."""
    plan = call.plan
    if plan is None:
        return None
    if plan.skip_openai and backend.kind == "openai":
        call.why_not = "its backend is a `kind: openai` provider"
        return None
    relay = Relayed(plan.shape)
    parts.migration.track(backend.name, relay)
    return relay


async def _remember_id(parts: Parts, call: Call, seen: bytes, backend: Backend) -> bytes | None:
    """Look for the new response's id in the bytes so far; None once done with it."""
    found = _RESPONSE_ID.search(seen)
    if found is None:
        return seen if len(seen) < _ID_WINDOW else None
    response_id = found.group(1).decode("utf-8", "replace")
    holder = Holder(backend.name, call.model, call.owner)
    if await parts.response_ids.remember(response_id, holder):
        call.stored_id = response_id
    return None
