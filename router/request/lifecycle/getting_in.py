"""Getting in: the checks and holds a request passes before any backend is picked.

In order: not draining, not a loop (the hop marker), a valid request (or the stored response it
follows), a token estimate, an admission ticket, a quota reservation. Each refusal is raised, a
`Refused` of router/core/errors.py that the web face answers in the client's error format; what
passes is a `Call`. Nothing is built for a request that passes. The reservation is taken
last, so nothing after it can fail and leave it open; `let_go` closes it, and settles the
ticket, with the tokens the request really used.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Set

from starlette.requests import Request

from router.core.endpoints import Endpoint
from router.core.errors import BadRequest, Loop, ShuttingDown, Unknown
from router.core.fastjson import without_members
from router.registry.fleet import Snapshot
from router.request.admit.admission import Ticket, make_ticket
from router.request.admit.estimate import BadLimit, estimate_tokens
from router.request.admit.quota import KeyLimits
from router.request.admit.validate import ValidRequest, request_id_of, validate
from router.request.lifecycle.call import Call
from router.request.lifecycle.parts import Parts
from router.request.placement.fallbacks import BODY_MEMBER, body_fallbacks
from router.request.placement.response_ids import ANONYMOUS, Holder
from router.request.placement.slo import NO_SLO, Slo, slo_of
from router.request.usage.record import RequestRecord


async def get_in(
    parts: Parts,
    request: Request,
    endpoint: Endpoint,
    allowed_models: Set[str] | None,
    key_name: str | None,
    priority: str,
    weight: float,
    limits: KeyLimits | None,
    response_id: str | None,
    owner: str = ANONYMOUS,
    fallbacks: bool = True,
    slo: Slo = NO_SLO,
) -> Call:
    """The request's `Call`; raises a `Refused` (with the request's id) when it may not get in.
    `fallbacks` False: the client key's entry turned model fallbacks off."""
    request_id = request_id_of(request.headers.get("x-request-id"))
    if parts.lifecycle.draining:
        raise ShuttingDown("The router is shutting down; retry.", request_id=request_id)
    try:
        hop = parts.hops.outgoing(request.headers.raw)
    except Loop as loop:
        loop.request_id = request_id
        parts.metrics.loop_refused()
        raise
    # The request routes within this snapshot of the backend set, from here to its end.
    snapshot = parts.registry.snapshot
    checked: ValidRequest
    if endpoint.state == "follows":
        checked = await _follow(
            parts, snapshot, request, request_id, response_id or "", allowed_models, owner
        )
    else:
        checked = await validate(
            request,
            request_id,
            parts.settings.max_body_bytes,
            allowed_models,
            snapshot.by_model,
            endpoint,
            parts.settings.max_upload_bytes,
            bodies=parts.bodies,
            declared=parts.holding.models,
        )
    only: list[str] | None = None
    # The client's own `"fallbacks"` in a JSON body (a form's fields go as they came).
    if BODY_MEMBER in checked.payload and checked.model_span is None and checked.body:
        checked, only = _body_fallbacks(parts, checked, request_id)
    # The body is held in the body budget from here: by the call until `let_go`, or given
    # back at once on any other way out (a refusal, an error, a cancel).
    held = len(checked.body)
    try:
        call = await _hold(
            parts,
            snapshot,
            request,
            endpoint,
            checked,
            request_id,
            hop,
            key_name,
            priority,
            weight,
            limits,
            owner,
            slo,
        )
    except BaseException:
        parts.bodies.give(held)
        raise
    if fallbacks and checked.model_span is None:  # a form's fallback is not offered
        call.fallback = parts.fallbacks.route(checked.model, allowed_models, only)
    return call


def _body_fallbacks(
    parts: Parts, checked: ValidRequest, request_id: str
) -> tuple[ValidRequest, list[str]]:
    """The body's `"fallbacks"` (it may only narrow the chains: `[]` turns them off), and the
    request without it; the bytes it took back in the body budget."""
    only = body_fallbacks(checked.payload)
    if isinstance(only, str):
        raise BadRequest(only, code="invalid_fallbacks", request_id=request_id, param=BODY_MEMBER)
    payload = {k: v for k, v in checked.payload.items() if k != BODY_MEMBER}
    body = without_members(checked.body, (BODY_MEMBER,)) or json.dumps(payload).encode()
    parts.bodies.give(max(0, len(checked.body) - len(body)))
    return dataclasses.replace(checked, body=body, payload=payload), only or []


async def _hold(
    parts: Parts,
    snapshot: Snapshot,
    request: Request,
    endpoint: Endpoint,
    checked: ValidRequest,
    request_id: str,
    hop: bytes,
    key_name: str | None,
    priority: str,
    weight: float,
    limits: KeyLimits | None,
    owner: str,
    slo: Slo,
) -> Call:
    """A valid request's estimate, admission ticket and quota reservation, as its `Call`."""
    history = 0  # the stored conversation a request continues, in tokens (0: none, unknown)
    if endpoint.state == "creates":
        checked, history = await _continue(parts, snapshot, checked, request_id, owner)
    try:
        estimate = estimate_tokens(
            checked.payload,
            len(checked.body),
            endpoint.limit_fields,
            parts.default_max_tokens,
            parts.max_model_len,
            endpoint.prompt_from_body,
            history,
        )
    except BadLimit as bad:
        raise BadRequest(str(bad), code=bad.code, request_id=request_id, param=bad.param) from None
    record = RequestRecord(
        request_id, checked.model, endpoint.path, checked.stream, time.perf_counter()
    )
    record.key_name = key_name
    ticket: Ticket | None = None
    if parts.admission is not None:
        ticket = make_ticket(
            parts.admission.cfg,
            request.headers,
            request_id,
            checked.model,
            estimate,
            len(checked.body),
            record.started,
            priority,
            weight,
            key_name or "",
        )
    call = Call(
        parts,
        snapshot,
        request,
        endpoint.path,
        checked.body,
        checked.payload,
        checked.model,
        checked.backends,
        checked.stream,
        record,
        ticket,
        estimate,
        hop,
        endpoint,
        checked.model_span,
    )
    call.owner = owner
    if call.balancer.needs_tokens:  # only `latency` routes on them
        call.slo = slo_of(call.client_headers, slo, request_id)
    if limits is not None and endpoint.limited:
        call.reservation = await parts.quotas.admit(
            limits_for(endpoint, limits), estimate, request_id
        )
    return call


def limits_for(endpoint: Endpoint, limits: KeyLimits) -> KeyLimits:
    """The key's limits that apply to the endpoint (its row's `rpm`, `parallel`, `tpm`)."""
    if endpoint.fully_limited:
        return limits  # the common case: no copy
    return dataclasses.replace(
        limits,
        rpm=limits.rpm if endpoint.rpm else None,
        tpm=limits.tpm if endpoint.tpm != "none" else None,
        max_parallel=limits.max_parallel if endpoint.parallel else None,
    )


def let_go(parts: Parts, call: Call, used: float) -> None:
    """Close what getting in held, charged `used` tokens: the body's bytes in the body budget
    (`call.held_bytes`, the body read), the quota reservation, and the admission
    ticket's fair-queue tag (only a request that queued has one to correct)."""
    parts.bodies.give(call.held_bytes)
    if call.reservation is not None:
        call.reservation.close(used)
    ticket = call.ticket
    if ticket is not None and ticket.queue is not None and parts.admission is not None:
        parts.admission.settle(ticket, used)


async def _continue(
    parts: Parts, snapshot: Snapshot, checked: ValidRequest, request_id: str, owner: str
) -> tuple[ValidRequest, int]:
    """A Responses request with `previous_response_id` goes to the backend holding it; with the
    stored conversation's known size (tokens), which its estimate carries."""
    previous = checked.payload.get("previous_response_id")
    if not isinstance(previous, str) or not previous:
        return checked, 0
    holder = await parts.response_ids.find(previous, owner)
    if holder is None:
        if len(checked.backends) == 1:
            return checked, 0  # made before this router knew it: only one engine can have it
        raise _response_gone(previous, request_id, "previous_response_id", None)
    if not holder.owned_by(owner):  # another key's: as unknown, even with one engine
        raise _response_gone(previous, request_id, "previous_response_id", None)
    backend = snapshot.serving(checked.model).get(holder.backend)
    if backend is None:
        raise _response_gone(previous, request_id, "previous_response_id", holder)
    return dataclasses.replace(checked, backends=(backend,)), holder.tokens


async def _follow(
    parts: Parts,
    snapshot: Snapshot,
    request: Request,
    request_id: str,
    response_id: str,
    allowed_models: Set[str] | None,
    owner: str,
) -> ValidRequest:
    """`GET /v1/responses/{id}` or `.../cancel`: the backend holding the response, for its
    owner only."""
    holder = await parts.response_ids.find(response_id, owner)
    if (
        holder is None
        or not holder.owned_by(owner)
        or (allowed_models is not None and holder.model not in allowed_models)
    ):
        raise _response_gone(response_id, request_id, "response_id", None)
    backend = snapshot.serving(holder.model).get(holder.backend)
    if backend is None:
        raise _response_gone(response_id, request_id, "response_id", holder)
    stream = request.method == "GET" and request.query_params.get("stream") == "true"
    return ValidRequest(b"", {}, holder.model, (backend,), stream)


def _response_gone(response_id: str, request_id: str, param: str, holder: Holder | None) -> Unknown:
    """OpenAI's 404 for a stored response this router cannot reach: never another engine's."""
    shown = response_id[:256]
    why = (
        "the engine that stored it is no longer serving"
        if holder is not None
        else "the router does not know which engine stored it (unknown or expired)"
    )
    return Unknown(
        f"Response with id '{shown}' not found: {why}.",
        code="response_not_found",
        request_id=request_id,
        param=param,
    )
