"""Prefill/decode: the prefill leg of one attempt, on the prefill engine picked for it.

`first_phase` runs phase 1 on the prefill engine the attempt's lease holds, and has that lease
given back when phase 1 ends (router/request/lifecycle/lease.py): NIXL's call is awaited (its
`kv_transfer_params` go into the decode leg's body), SGLang's runs aside while the decode
engine's request runs (the attempt's lease cancels it when the attempt ends).
Which pools and bodies: router/request/placement/pd.py; whether to split:
balancers/disaggregation.py.
"""

from __future__ import annotations

import asyncio
import json
import time

from router.core.backend import Backend
from router.core.errors import UPSTREAM_FAILURES, FailureKind, ProxyError, upstream_failure
from router.request.admit.hops import HOP_HEADER
from router.request.lifecycle.call import Call
from router.request.lifecycle.endings import Retry
from router.request.lifecycle.lease import AttemptLease
from router.request.lifecycle.parts import Parts
from router.request.placement.pd import (
    MAX_PREFILL_ANSWER,
    BadPrefillAnswer,
    bootstrap_fields,
    check_remote,
    prefill_body,
    transfer_params,
    url_host,
    with_members,
)
from router.request.wire.headers import upstream_request_headers
from router.upstream.transport import Answer


async def first_phase(parts: Parts, call: Call, held: AttemptLease) -> bytes | None:
    """Phase 1 on the prefill engine `held` leased: phase 2's members (P's
    `kv_transfer_params`, or SGLang's bootstrap), with that engine as the record's
    `prefill_backend`; None when the decode engine serves the request whole. The prefill lease
    goes back when the phase ends, however (a failure before it began: when the attempt
    ends)."""
    lease = held.prefill
    assert lease is not None and call.pools is not None
    name = lease.backend
    backend = call.snapshot.by_name[name]  # the request routes within its snapshot
    if call.pools.rule.connector == "sglang":
        handoff = bootstrap_fields(backend)
        held.aside(asyncio.ensure_future(_bootstrap(parts, call, backend, handoff)))
        call.record.prefill_backend = name
        return handoff
    try:
        params = await _prefill(parts, call, backend)
    finally:
        held.prefill_done()
    if params is None:
        call.record.pd = "prefill_refused"
        return None
    call.record.prefill_backend = name
    return b'"kv_transfer_params":' + params


def _headers(call: Call, backend: Backend) -> list[tuple[bytes, bytes]]:
    """The decode leg's headers for the prefill engine: the same request id, its own key."""
    # Its answer is read here, so not compressed (an own header replaces the client's).
    own = [*backend.auth_headers, (b"accept-encoding", b"identity")]
    if call.hop:
        own.append((HOP_HEADER, call.hop))
    return upstream_request_headers(call.client_headers, call.record.request_id, own)


async def _prefill(parts: Parts, call: Call, backend: Backend) -> bytes | None:
    """NIXL phase 1 on `backend`: its `kv_transfer_params` (serialised, unchanged); None
    when it refused the request itself (4xx: the decode engine answers it whole, and so
    the client gets the engine's own error). A failure raises `Retry` naming it.

    A client that leaves now cancels this call, which closes its connection: vLLM then
    aborts the request, and a request aborted before it finished frees its blocks at once
    (NixlConnectorScheduler.request_finished: not FINISHED_LENGTH_CAPPED, no delayed free).
    Once phase 1 has answered, the blocks are held for a decode engine until
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT; vLLM has no call to release them early (only a decode
    engine that aborts a request carrying the params tells P to free them), so a request
    ended between the phases leaves them to that lease."""
    trace = call.trace
    name = backend.name
    target = backend.target(call.model)
    body = prefill_body(call.parsed(), target)
    trace.prefill(name)
    transport, request = parts.pools.request(
        backend, call.path, trace.upstream_headers(_headers(call, backend)), body
    )
    started = time.perf_counter()
    call.working = True
    response: Answer | None = None
    peer: str | None = None
    try:
        try:
            # One token, not streamed: vLLM writes the whole answer at once, so the read
            # timeout that bounds its head bounds all of it (a trickle resets the read timer).
            async with asyncio.timeout(parts.settings.timeouts.read):
                response = await transport.send(request)
                peer = response.peer()
                chunks: list[bytes] = []
                size = 0
                async for chunk in response.stream:
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > MAX_PREFILL_ANSWER:
                        break
        except UPSTREAM_FAILURES as exc:
            failure = upstream_failure(exc, name)
            parts.health.on_failure(name, failure.kind)
            trace.prefill_end(failure.kind)
            raise Retry(failure.error, failure.kind, prefill=name) from exc
        status = response.status_code
        if status != 200:
            trace.prefill_end(FailureKind.STATUS, status)
            if 400 <= status < 500 and status != 429:
                return None
            if status >= 500:
                parts.health.on_failure(name, FailureKind.STATUS, status)
            err = ProxyError(f"Prefill backend `{name}` answered {status}.")
            raise Retry(err, FailureKind.STATUS, prefill=name)
        try:
            if size > MAX_PREFILL_ANSWER:
                raise BadPrefillAnswer("its answer is too long")
            params = transfer_params(b"".join(chunks))
            check_remote(params, url_host(backend.url), peer)
        except BadPrefillAnswer as bad:
            trace.prefill_end(FailureKind.CONNECT, status)
            parts.health.on_failure(name, FailureKind.CONNECT)
            err = ProxyError(f"Prefill backend `{name}`: {bad}.")
            raise Retry(err, FailureKind.CONNECT, prefill=name) from None
        parts.health.on_success(name)
        parts.metrics.prefilled(name, time.perf_counter() - started)
        trace.prefill_end(None, status)
        return params
    finally:
        trace.prefill_end("cancelled")  # a no-op unless the client left meanwhile
        if response is not None:
            await response.aclose()


async def _bootstrap(parts: Parts, call: Call, backend: Backend, fields: bytes) -> None:
    """SGLang: the prefill engine's copy of the request (same room), sent while the decode
    engine's runs; its answer is read and dropped. Cancelled when the decode leg ends."""
    trace = call.trace
    target = backend.target(call.model)
    payload = {**call.parsed(), "model": target}
    body = with_members(json.dumps(payload, ensure_ascii=False).encode(), fields)
    trace.prefill(backend.name)
    transport, request = parts.pools.request(
        backend, call.path, trace.upstream_headers(_headers(call, backend)), body
    )
    started = time.perf_counter()
    response: Answer | None = None
    try:
        response = await transport.send(request)
        async for _ in response.aiter_raw():
            pass
        if response.status_code >= 500:
            parts.health.on_failure(backend.name, FailureKind.STATUS, response.status_code)
        parts.metrics.prefilled(backend.name, time.perf_counter() - started)
        trace.prefill_end(None, response.status_code)
    except UPSTREAM_FAILURES as exc:
        failure = upstream_failure(exc, backend.name)
        parts.health.on_failure(backend.name, failure.kind)
        trace.prefill_end(failure.kind)
    finally:
        trace.prefill_end("cancelled")  # a no-op unless the decode leg ended first
        if response is not None:
            await response.aclose()
