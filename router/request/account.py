"""The accounting at a request's end: its tokens, what it is charged, the usage book, the log
line, the metrics and the trace span. Runs once, whatever ended the request (no I/O here: a
shared book writes behind).

`tokens` reads the response's usage once; `charged` is what quotas and admission are corrected
to; `book` writes everything else.
"""

from __future__ import annotations

from typing import NamedTuple

from router.request.call import Call
from router.request.parts import Parts


class Tokens(NamedTuple):
    """Prompt, completion and cached tokens of the response, and whether any was estimated."""

    prompt: float
    completion: int
    cached: int
    estimated: bool


_NONE = Tokens(0.0, 0, 0, False)


def tokens(call: Call) -> Tokens:
    """The response's tokens; estimated when the backend sent no usage (completion events
    counted, the prompt as body bytes / 4); all 0 when no backend answered."""
    u = call.record.usage
    if u is None or not call.endpoint.counts_tokens:
        return _NONE
    prompt, completion = u.input_tokens, u.reported_tokens
    guess = call.endpoint.prompt_from_body
    carried = call.carried  # a continuation's prompt held the tokens relayed before it
    return Tokens(
        (len(call.body) / 4 if guess else 0.0) if prompt is None else max(0, prompt - carried),
        (u.events if completion is None else completion) + carried,  # no events: no stream
        u.cached_tokens or 0,
        (prompt is None and guess) or (completion is None and call.stream),
    )


def charged(call: Call, used: Tokens) -> float:
    """The tokens quotas and admission are corrected to: the ones used, or the whole estimate
    of a request abandoned while its engine worked on it (see `_abandoned`)."""
    if _abandoned(call):
        return float(call.estimate)
    return float(used.prompt + used.completion)


def _abandoned(call: Call) -> bool:
    """The client left while a backend worked on the request and before its usage was read:
    the engine may have generated up to the whole budget, and no count of it will come. The
    request is charged its whole estimate (the prompt and every sequence's budget), not 0:
    the one figure known never to be below what a bounded request can have cost."""
    rec = call.record
    if not (rec.disconnected and call.working):
        return False
    u = rec.usage
    return u is None or (not call.stream and u.reported_tokens is None)


def book(parts: Parts, call: Call, used: Tokens) -> None:
    """An answered request's tokens into the usage book and metrics, then the log line, the
    request's metrics and its trace span."""
    rec = call.record
    if rec.usage is not None and 200 <= rec.status < 300 and call.endpoint.counts_tokens:
        key = rec.key_name or "unnamed"
        prompt = round(used.prompt)
        rec.tokens_estimated = used.estimated
        parts.usage.record(key, call.model, prompt, used.completion, used.cached, used.estimated)
        parts.metrics.tokens(key, call.model, prompt, used.completion, used.cached)
    rec.emit()
    parts.metrics.observe(rec)
    call.trace.finish(rec, rec.usage)
