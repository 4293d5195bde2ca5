"""The migration step: a stream that broke after it began goes on on another backend.

`carry_on` sets up the continuation (router/request/migration/continuation.py) of what was relayed
(router/request/migration/relay.py), runs the attempts once more, and joins the new stream's events
to the client's (router/request/migration/stitch.py); when the stream may not or cannot go on, it
ends with an error event saying why. `whole_again` does the same for a non-streamed answer lost
while its engine worked on it. `count_segment` runs inside the continuation's attempt: that engine
counts the text relayed so far. Which calls may migrate: router/request/migration/policy.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable

from starlette.types import Send

from router.core.backend import Backend
from router.core.errors import UPSTREAM_FAILURES, sse_error_event
from router.request.admit.hops import HOP_HEADER
from router.request.lifecycle.call import Call
from router.request.lifecycle.endings import Broken, NoneLeft, Retry
from router.request.lifecycle.parts import Parts
from router.request.migration.continuation import CannotContinue, build
from router.request.migration.policy import Plan
from router.request.migration.stitch import Stitch
from router.upstream.transport import Answer

# The attempts once more; the argument releases the retry-budget slot once an answer starts.
Again = Callable[[Callable[[], None]], Awaitable[None]]

_COUNT = re.compile(rb'"count"\s*:\s*(\d{1,9})')  # /tokenize's answer opens with it
_COUNT_WINDOW = 4096
# Tokens a text may hold past one per UTF-8 byte (a tokenizer's own markers, were it to add any
# despite `add_special_tokens: false`).
_COUNT_SLACK = 8


async def carry_on(
    parts: Parts,
    call: Call,
    send: Send,
    broken: Broken,
    again: Again,
    exclude: set[str],
    elsewhere: Callable[[], Awaitable[Again | None]] | None = None,
) -> None:
    """Continue a broken stream on other backends (not in `exclude`, the attempts' own set), at
    most `max_migrations` times; when no backend of its model takes it, on its next fallback
    model's (`elsewhere`: their attempts, None when none is left); when it may not (or cannot)
    go on, end it with an error event saying why."""
    plan = call.plan
    assert plan is not None
    current = [again]  # the attempts of the model serving it now (a fallback's, once it moved)
    while True:
        source = call.record.backend or ""
        refusal = _continue_after(parts, call, broken, plan)
        if refusal is not None:
            result, why = refusal
            outcome(parts, call, result, why, source)
            await _end_broken(call, send, broken, f"Not migrated: {why}.")
            return
        if plan.skip_openai:
            exclude.update(b.name for b in call.backends if b.kind == "openai")
        # Counted here, as a failed attempt; one not continued is counted with the request.
        parts.metrics.attempt_failed(source, broken.kind)
        call.record.error = None
        release = parts.failover.budget.slot(True)
        try:
            await _again_or_elsewhere(call, current, release, elsewhere)
        except Broken as next_break:
            outcome(parts, call, "ok", broken.why, source)
            broken = next_break
            continue
        except (Retry, NoneLeft):
            if spent(call):  # its continuations broke engines too
                outcome(parts, call, "limit", broken.why, source)
                why = f"it broke {call.broke} engines"
                await _end_broken(call, send, broken, f"Not migrated: {why}.")
                call.record.error = "migration_failed"  # its failure is counted already
                return
            outcome(parts, call, "failed", broken.why, source)
            await _end_broken(call, send, broken, "No backend could continue it.")
            call.record.error = "migration_failed"  # its failure is counted already
            return
        finally:
            release()
        outcome(parts, call, "ok", broken.why, source)
        return


async def _again_or_elsewhere(
    call: Call,
    current: list[Again],
    release: Callable[[], None],
    elsewhere: Callable[[], Awaitable[Again | None]] | None,
) -> None:
    """The attempts once more; when none of the model's backends took the continuation, those
    of its next fallback model (which `current` holds from then on, for a next break)."""
    while True:
        try:
            await current[0](release)
            return
        except (Retry, NoneLeft):
            if elsewhere is None or spent(call):
                raise
            other = await elsewhere()
            if other is None:
                raise
            current[0] = other


def spent(call: Call) -> bool:
    """The request broke 1 + `max_migrations` engines while they worked on it (a request that
    kills its engine, or a fleet breaking): no other engine gets it, by a plain retry or a
    migration. Checked before each attempt; without it each migration ran the failover loop
    again (`retries.attempts` engines), and one such request reached every engine."""
    plan = call.plan
    return plan is not None and call.broke > plan.max_migrations


def whole_again(parts: Parts, call: Call, last: Retry) -> bool:
    """May a non-streamed request that broke on its engine be sent on once more? (Nothing
    reached the client, so the original request migrates as it is.)"""
    if call.started or call.plan is None or not last.sent or call.stream:
        return False
    if call.migrations >= call.plan.max_migrations or spent(call):
        return False
    if not parts.failover.budget.allows(parts.lifecycle.active):
        outcome(parts, call, "budget", "whole answer lost")
        return False
    call.migrations += 1
    return True


def outcome(parts: Parts, call: Call, result: str, why: str, backend: str | None = None) -> None:
    rec = call.record
    parts.migration.outcome(
        call.model,
        result,
        rec.request_id,
        backend=backend or rec.backend,
        migration=call.migrations,
        why=why,
        tokens_relayed=call.carried,
    )
    call.trace.migrated(backend or rec.backend or "", call.migrations, result, why)
    rec.migrations = call.migrations


def _continue_after(parts: Parts, call: Call, broken: Broken, plan: Plan) -> tuple[str, str] | None:
    """Set up the continuation of `broken`; (result, why) when there is none."""
    relay = broken.relay
    if relay.spoiled:
        return "refused", "an event too long to hold was cut"
    summary = relay.summary()
    if summary.tool_calls:
        return "refused", "a tool call was streaming"
    if summary.finished:
        return "refused", "the answer had finished"
    if call.migrations >= plan.max_migrations:
        return "limit", f"it broke after {plan.max_migrations} migrations"
    if not parts.failover.budget.allows(parts.lifecycle.active):
        parts.failover.budget.refused += 1
        return "budget", "the retry budget is spent"
    usage = call.record.usage
    produced = usage.events if usage is not None else 0
    text = call.text + summary.text
    try:
        continuation = build(call.parsed(), plan.shape, text, call.carried + produced)
    except CannotContinue as exc:
        return "refused", str(exc)
    call.migrations += 1
    call.text = text
    call.continuation = continuation
    call.segment = (summary.text, produced)  # counted by the backend that continues
    if call.head is None:
        call.head = summary.head
    return None


async def count_segment(parts: Parts, call: Call, backend: Backend) -> None:
    """The tokens of the text relayed by the stream that broke, as the continuation's
    engine counts them (its `/tokenize`; the content events when it cannot say), then the
    continuation's limits and stitch from that count."""
    assert call.segment is not None and call.plan is not None
    text, produced = call.segment
    count = produced
    if text and backend.kind != "openai":
        found = await _tokens_of(parts, call, backend, text)
        count = found if found is not None else produced
    call.segment = None
    call.carried += count
    try:
        call.continuation = build(call.parsed(), call.plan.shape, call.text, call.carried)
    except CannotContinue:
        pass  # the engine's own count says the limit is near: the event count's body stays
    if call.head is not None:
        call.stitch = Stitch(call.head, call.carried)


async def _tokens_of(parts: Parts, call: Call, backend: Backend, text: str) -> int | None:
    """`POST /tokenize` of `text` alone on `backend` (vLLM's, SGLang's): its count, never more
    than the text's UTF-8 bytes plus `_COUNT_SLACK`. The count is the engine's word, and it is
    charged to the client's key: a byte-level tokenizer makes at most one token of each byte, so
    an honest count is never cut, while a lying engine's (a key was charged a billion tokens
    for a few words) is bounded by the size of the text it was shown."""
    target = backend.target(call.model)
    body = json.dumps({"model": target, "prompt": text, "add_special_tokens": False})
    headers = [(b"content-type", b"application/json"), *backend.auth_headers]
    if call.hop:
        headers.append((HOP_HEADER, call.hop))
    transport, request = parts.pools.request(backend, "/tokenize", headers, body.encode())
    response: Answer | None = None
    head = b""
    try:
        async with asyncio.timeout(5):
            response = await transport.send(request)
            if response.status_code != 200:
                return None
            async for chunk in response.aiter_raw():
                head += chunk
                found = _COUNT.search(head)
                if found is not None:
                    most = len(text.encode("utf-8", "surrogatepass")) + _COUNT_SLACK
                    return min(int(found.group(1)), most)
                if len(head) > _COUNT_WINDOW:
                    return None
    except UPSTREAM_FAILURES:  # TimeoutError among them
        return None
    finally:
        if response is not None:
            await response.aclose()
    return None


async def _end_broken(call: Call, send: Send, broken: Broken, why: str) -> None:
    """End a broken stream as a stream that may not migrate ends: with an error event."""
    rec = call.record
    rec.error = broken.kind
    event = sse_error_event(
        f"{broken.message} {why}", "upstream_error", f"upstream_{broken.kind}", call.anthropic
    )
    await send({"type": "http.response.body", "body": event, "more_body": False})
    rec.bytes_out += len(event)
