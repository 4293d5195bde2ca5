"""The accounting at a request's end: its tokens, what it is charged, the usage book, the log
line, the metrics and the trace span. Runs once, whatever ended the request (no I/O here: a
shared book writes behind).

`tokens` reads the response's usage once; `charged` is what quotas and admission are corrected
to; `book` writes everything else. The usage book and the metrics get the same tokens the quota
is charged: the engine's count when it reported one, else the router's estimate of it (marked
estimated), never 0 for work an engine did or may still be doing.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from router.request.lifecycle.call import Call
from router.request.lifecycle.parts import Parts


class Tokens(NamedTuple):
    """Prompt, completion and cached tokens of the response, whether any was estimated, and
    whether they are the request's whole estimate (no count of its work will come)."""

    prompt: float
    completion: int
    cached: int
    estimated: bool
    whole: bool = False


_NONE = Tokens(0.0, 0, 0, False)
_BYTES_A_TOKEN = 4  # the rule the prompt's estimate uses (router/request/admit/estimate.py)


def tokens(call: Call) -> Tokens:
    """The response's tokens: the backend's usage; estimated when it sent none (a stream's
    completion events counted, a whole answer's body bytes / 4, the prompt as body bytes / 4);
    the whole estimate when the engine may have generated up to the budget and its count will
    never be read here (see `_uncounted`); all 0 when no backend answered."""
    if not call.endpoint.counts_tokens:
        return _NONE
    u = call.record.usage
    if _uncounted(call):
        return _whole_estimate(call)
    if u is None:
        return _NONE
    prompt, completion = u.input_tokens, u.reported_tokens
    guess = call.endpoint.prompt_from_body
    carried = call.carried  # a continuation's prompt held the tokens relayed before it
    if completion is not None:
        made, made_guessed = completion, False
    elif call.stream:
        made, made_guessed = u.events, True  # no events: no stream
    elif call.endpoint.limit_fields and 200 <= call.record.status < 300:
        # A whole answer without a count (vLLM's non-streamed transcription reports seconds):
        # its text is in the body.
        made, made_guessed = call.record.bytes_out // _BYTES_A_TOKEN, True
    else:
        made, made_guessed = 0, False
    return Tokens(
        (len(call.body) / 4 if guess else 0.0) if prompt is None else max(0, prompt - carried),
        made + carried,
        u.cached_tokens or 0,
        (prompt is None and guess) or made_guessed,
    )


def charged(call: Call, used: Tokens) -> float:
    """The tokens quotas and admission are corrected to: the ones `tokens` found."""
    return float(used.prompt + used.completion)


def _uncounted(call: Call) -> bool:
    """No count of the engine's work will be read, and it may be up to the whole budget: the
    client left while a backend worked on the request and before its usage was read
    (`_abandoned`), or a background response was answered before it was done."""
    return _abandoned(call) or _in_background(call)


def _abandoned(call: Call) -> bool:
    """The client left while a backend worked on the request and before its usage was read:
    the engine may have generated up to the whole budget, and no count of it will come."""
    rec = call.record
    if not (rec.disconnected and call.working):
        return False
    u = rec.usage
    return u is None or (not call.stream and u.reported_tokens is None)


def _in_background(call: Call) -> bool:
    """A Responses request with `background: true` answered (`queued`, `usage: null`, or a
    stream that ended before its `response.completed`): the engine generates on after the
    answer. Its usage comes only to whoever GETs the response later (maybe never, maybe many
    times, maybe another replica), so it is charged here, at the one call certain to happen."""
    if call.endpoint.state != "creates":
        return False
    rec = call.record
    u = rec.usage
    if u is None or u.reported_tokens is not None or not 200 <= rec.status < 300:
        return False
    return call.parsed().get("background") is True


def _whole_estimate(call: Call) -> Tokens:
    """The request's whole estimate (its prompt and every sequence's budget): the one figure
    known never to be below what a bounded request can have cost. Its prompt part is the
    engine's prompt count when it sent one, else body bytes / 4; the rest is completion."""
    u = call.record.usage
    reported = u.input_tokens if u is not None else None
    if reported is not None:
        prompt = reported
    else:
        prompt = math.ceil(len(call.body) / 4) if call.endpoint.prompt_from_body else 0
    estimate = call.estimate
    prompt = min(prompt, estimate)
    cached = (u.cached_tokens or 0) if u is not None else 0
    return Tokens(float(prompt), estimate - prompt, cached, True, True)


def book(parts: Parts, call: Call, used: Tokens) -> None:
    """An answered request's tokens (or the whole estimate of one whose count will not come)
    into the usage book and metrics, then the log line, the request's metrics and its trace
    span."""
    rec = call.record
    if (
        call.endpoint.counts_tokens
        and not rec.batch
        and (used.whole or (rec.usage is not None and 200 <= rec.status < 300))
    ):
        key = rec.key_name or "unnamed"
        prompt = round(used.prompt)
        rec.tokens_estimated = used.estimated
        parts.usage.record(key, call.model, prompt, used.completion, used.cached, used.estimated)
        parts.metrics.tokens(key, call.model, prompt, used.completion, used.cached)
    rec.emit()
    parts.metrics.observe(rec)
    call.trace.finish(rec, rec.usage)
