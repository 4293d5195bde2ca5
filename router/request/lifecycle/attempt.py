"""One attempt: pick a backend, lease it, (prefill on another engine,) open the upstream request,
relay its answer; and the request's attempts together, as `Failover.run` drives them.

`Attempts` holds what the attempts of one request share: the request's affinity (cached
prefix, session, LoRA adapter), the backends excluded so far, the last failure, and the
attempt's lease (router/request/lifecycle/lease.py). Its call is one attempt: it picks and
takes the lease, and closes it in its `finally`. `exchange` is that attempt on its backend;
what it takes in turn (the adapter's flight, the prefill leg, the adapter's use, the upstream
answer) it hands to the lease, which gives it all back. A failure before the answer started
raises `Retry`; a 5xx or 429 is read whole first (`_retryable_status`), so the client may
still get it when no other backend is left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Sequence, Set
from typing import NoReturn

import httpx
from starlette.types import Send

from balancers import lora as adapters
from balancers.base import Candidate, Choice
from balancers.context import AdapterWant, PickContext
from balancers.disaggregation import decide
from balancers.inflight.base import Lease, Readings
from balancers.latency import UNATTAINABLE
from router.core.backend import Backend
from router.core.errors import (
    UPSTREAM_FAILURES,
    FailureKind,
    InvalidUpstreamResponse,
    NoCapacity,
    ProxyError,
    SloUnattainable,
    refusal_reason,
    upstream_failure,
)
from router.engine.lora_loads import LoadFailed
from router.request.admit.admission import BANDS
from router.request.admit.hops import HOP_HEADER
from router.request.lifecycle.call import Call, Held
from router.request.lifecycle.endings import Broken, NoneLeft, Refusal, Retry
from router.request.lifecycle.fallback import MODEL_HEADER, answer_whole
from router.request.lifecycle.lease import AttemptLease
from router.request.lifecycle.migrate import count_segment, outcome, spent, whole_again
from router.request.lifecycle.parts import Parts
from router.request.lifecycle.prefill_leg import first_phase
from router.request.lifecycle.pump import pump
from router.request.placement.affinity import RequestAffinity
from router.request.placement.pd import with_members
from router.request.placement.session_token import HEADER as SESSION_HEADER
from router.request.placement.slo import NO_SLO
from router.request.wire.headers import downstream_response_headers, upstream_request_headers
from router.upstream.transport import Answer

# Failures after the request went out: the backend was working on it when it broke.
_SENT = (httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError)
# A lease whose store passed no choice on (a stand-in store): chosen by load, nothing held.
_NO_CHOICE = Choice(Candidate("", 1.0, 0))
_NONE: frozenset[str] = frozenset()


async def _no_lease() -> None:
    return None


async def attempts_for(parts: Parts, call: Call, send: Send) -> Attempts:
    """The request's attempts, with its affinity looked up (the shared prefix index, the
    engine's token ids: a round trip each, when configured). A lookup that computes nothing
    (`/tokenize`, `/detokenize`, count_tokens: usage `none`) has none: its prompt is never
    prefilled, so its engine holds nothing of it afterwards (`vllm bench serve` tokenizes
    every prompt through the router before a run whose tokenizer disagrees with the engine's,
    and each call taught the index a prefix no engine held)."""
    affinity = (
        None
        if call.endpoint.usage == "none"
        else parts.affinity.prepare(
            call.balancer,
            call.client_headers,
            call.parsed(),
            call.endpoint.usage == "responses",
            call.adapter,
        )
    )
    if affinity is not None and parts.affinity.shared is not None:
        affinity = await parts.affinity.look_up(affinity, call.backends)  # one round trip
    if affinity is not None and parts.affinity.wants_tokens(call.model, call.backends):
        affinity = await parts.affinity.with_tokens(
            affinity, call.model, call.parsed(), parts.health.eligible(call.backends, call.model)
        )
    return Attempts(parts, call, send, affinity)


class Attempts:
    __slots__ = (
        "affinity",
        "balancer",
        "call",
        "engine_aware",
        "exclude",
        "held",
        "last",
        "p_exclude",
        "parts",
        "pinned",
        "queued",
        "readings",
        "refused",
        "send",
        "want",
    )

    def __init__(
        self, parts: Parts, call: Call, send: Send, affinity: RequestAffinity | None
    ) -> None:
        self.parts = parts
        self.call = call
        self.send = send
        self.balancer = balancer = call.balancer
        self.affinity = affinity
        self.exclude: set[str] = set()  # backends that failed this request
        # Prefill engines that failed this request (a split request's; a set is made only
        # when one fails).
        self.p_exclude = _NONE
        # A decode engine's 5xx to a handoff not yet charged: (prefill, decode, status).
        self.refused: tuple[str, str, int] | None = None
        self.last: Retry | None = None
        self.engine_aware = balancer.needs_engine or call.adapter is not None
        self.want: AdapterWant | None = None
        self.readings: Readings | None = None
        self.held = AttemptLease(parts, call)  # the attempt's, one at a time
        # The backend an echoed x-session-token names (`balancer: latency`), looked up once.
        self.pinned: str | None = None
        self.queued = 0.0  # `latency`, with an SLO: seconds in the admission queue, as last told
        if balancer.needs_tokens:
            self.pinned = _pinned(parts, call)

    async def __call__(self, number: int, answered: Callable[[], None]) -> None:
        """Attempt `number`; `answered()` once its answer started (the retry slot's end)."""
        parts = self.parts
        call = self.call
        rec = call.record
        if call.broke and spent(call):
            raise NoneLeft  # it broke as many engines as it may reach
        call.trace.queued()
        lease = await self._take(number)
        if lease is None:
            raise NoneLeft
        name = lease.backend
        try:
            self._routed(lease, number)
            if call.pools is not None and not call.started and call.continuation is None:
                rec.prefill_backend = None  # this attempt's own, set when it has one
                await self._take_prefill(number, lease)
            await exchange(parts, call, self.send, self.held, answered)
            self._settle(name, rec.prefill_backend is not None)
        except Broken as broken:
            call.working = False
            if broken.why != "moved":  # a backend being removed broke nothing
                call.broke += 1
            self._settle(name, rec.prefill_backend is not None)
            self.exclude.add(name)  # a continuation goes elsewhere
            raise
        except Retry as retry:
            call.working = False  # that backend failed or refused before it answered
            if retry.sent:  # it broke while working on it
                call.broke += 1
            self.last = retry
            call.trace.attempt_failed(retry.kind, retry.response[0] if retry.response else None)
            if retry.prefill is not None:  # phase 1 again elsewhere; the decode engine stays
                self.p_exclude = self.p_exclude | {retry.prefill}
                if retry.response is None:  # the prefill leg's own failure
                    parts.metrics.attempt_failed(retry.prefill, retry.kind)
                else:  # the decode engine refused the handoff: charged once it is known whose
                    self._settle(name, None)
                    self.refused = (retry.prefill, name, retry.response[0])
            else:
                self._settle(name, None)
                parts.metrics.attempt_failed(name, retry.kind)
                self.exclude.add(name)  # the next attempt goes elsewhere
            raise
        finally:
            try:
                await self.held.close()  # all the attempt took, back in reverse order
            finally:
                call.trace.attempt_end(rec.error)

    async def lease_only(self) -> Lease | None:
        """The endpoint picker's one attempt (router/picker/): picked and leased (with a split
        model's prefill engine, when the prompt is split), recorded as `__call__` records it,
        but sent by the gateway; the leases stay in `held` until the picker's stream ends
        (`held.close()`). None: every eligible backend is full."""
        lease = await self._take(1)
        if lease is not None:
            self._routed(lease, 1)
            if self.call.pools is not None:  # a split model: its prefill engine, when split
                await self._take_prefill(1, lease)
        return lease

    async def again(self, release: Callable[[], None]) -> None:
        """The failover loop once more, for a migration: its retry slot is released as soon
        as an answer starts."""

        async def continued(number: int, answered: Callable[[], None]) -> None:
            def both() -> None:
                answered()
                release()

            await self(number, both)

        await self.parts.failover.run(continued)

    async def resend_whole(self) -> bool:
        """A whole (non-streamed) answer lost while its engine worked on it: nothing reached
        the client, so the original request migrates as it is. True when one was answered."""
        parts = self.parts
        call = self.call
        while self.last is not None and whole_again(parts, call, self.last):
            release = parts.failover.budget.slot(True)
            try:
                await self.again(release)
                outcome(parts, call, "ok", "whole answer lost")
                return True
            except (Retry, NoneLeft):
                outcome(parts, call, "failed", "whole answer lost")
            finally:
                release()
        return False

    def _settle(self, decode: str | None, handoff: bool | None) -> None:
        """Charge a pending refused handoff (`refused`) now that `decode` answered again, taking
        a handoff (`handoff` True) or serving the request whole (False); None: it failed, or no
        answer came. vLLM's decode engine answers 500 when its pull fails, and a broken one to
        everything: only the same decode engine taking another prefill engine's handoff shows
        the first prefill engine at fault, and its serving the request whole shows neither."""
        refused = self.refused
        if refused is None:
            return
        self.refused = None
        prefill, refuser, status = refused
        if decode == refuser and handoff is not None:
            if not handoff:
                return  # it works; whether its pulls or that prefill engine failed, unknown
            name = prefill
        else:
            name = refuser  # the engine that answered 500
        self.parts.health.on_failure(name, FailureKind.STATUS, status)
        self.parts.metrics.attempt_failed(name, FailureKind.STATUS)

    async def give_up(self) -> None:
        """No attempt is left: the last backend's own error answer, or the router's error."""
        self._settle(None, None)  # no later answer tells: the engine that answered 500
        last = self.last
        call = self.call
        if last is None:
            raise NoCapacity(
                f"Every backend serving `{call.model}` is busy or unavailable; retry later.",
                retry_after=self.parts.health.retry_after(call.backends) or 1,
            )
        if last.response is None or call.started:  # started: a held stream's head was sent
            raise last.error
        await answer_whole(call, self.send, last.response)

    # -- picking ------------------------------------------------------------------------------

    def _context(
        self, eligible: Sequence[Backend], exclude: Set[str], ahead: bool = False
    ) -> PickContext:
        """What this pick is told of the request: its exclusions, the prompt's hints for the
        eligible backends, the adapter it wants; for `latency`, with an SLO and admission, the
        time it has waited in the queue (`ahead`: the time it is predicted to wait there)."""
        parts = self.parts
        adapter = self.call.adapter
        want = None
        if adapter is not None:
            want = parts.lora.want(adapter) if parts.lora is not None else AdapterWant(adapter)
            want = dataclasses.replace(want, flights=parts.flights.on())
        self.want = want
        affinity = self.affinity
        hints = parts.affinity.hints(affinity, eligible) if affinity else None
        load_factor = parts.settings.affinity.load_factor
        if not self.balancer.needs_tokens:
            return PickContext(exclude, hints, want, load_factor)
        call = self.call
        ticket = call.ticket
        admission = parts.admission
        queued = 0.0
        if admission is not None and ticket is not None and call.slo != NO_SLO:
            queued = admission.wait_ahead(ticket) if ahead else admission.waited(ticket)
        self.queued = queued
        latency = parts.latency.inputs(
            _prompt_tokens(affinity, call),
            self.pinned,
            parts.settings.affinity.session_break_ms,
            admission is not None,
            queued,
            call.slo[0],
        )
        slo_ttft, slo_tpot = call.slo
        priority = BANDS[ticket.band] if ticket is not None else None
        return PickContext(exclude, hints, want, load_factor, slo_ttft, slo_tpot, priority, latency)

    # `_take` and `_try_admit` hand back the lease's own awaitable, not a coroutine of their
    # own: a frame less per attempt.

    def _take(self, number: int) -> Awaitable[Lease | None]:
        """The attempt's lease (None: every eligible backend is full or excluded). The first
        attempt of a request with a ticket goes through admission (it may queue); any other
        picks among the eligible backends at once."""
        parts = self.parts
        call = self.call
        admission = parts.admission
        if admission is not None and call.ticket is not None and number == 1:
            if not call.record.attempts:  # not a migration's first attempt
                if self.balancer.needs_tokens and call.slo != NO_SLO:
                    self._shed_early()  # a sheddable request out of reach: not queued first
                return admission.acquire(call.ticket, self._try_admit, call.parked)
        eligible = parts.health.eligible(call.backends, call.model)
        readings = self._read_engines()
        if call.record.batch:
            eligible = self._with_room(eligible, readings)
        self.readings = readings if self.engine_aware else None
        ctx = self._context(eligible, self.exclude)
        return self.held.take(eligible, self.balancer, ctx, self.readings)

    def _read_engines(self) -> Readings | None:
        """The engines' readings, read once per pick and only where used: a batch line's room
        filter, an engine-aware balancer."""
        read = self.parts.readings
        return (
            read() if read is not None and (self.call.record.batch or self.engine_aware) else None
        )

    def _try_admit(self) -> Awaitable[Lease | None]:
        """One pick-and-count among backends with room by max_inflight and engine readings;
        None sends the request to (or back to) the queue."""
        parts = self.parts
        call = self.call
        assert parts.admission is not None
        if call.held is not None:  # a declared model's request, held in the queue
            if parts.holding.needs_hold(call.model):
                return _no_lease()  # still no ready backend: back to its place
            return self._after_hold(call.held)
        eligible = parts.health.eligible(call.backends, call.model)
        if not eligible:
            raise NoneLeft  # nothing could take it however long it waited
        all_readings = parts.readings() if parts.readings else None
        if all_readings:
            eligible = parts.admission.open_backends(eligible, all_readings)
            if call.record.batch:
                eligible = self._with_room(eligible, all_readings)
            if not eligible:
                return _no_lease()
        self.readings = all_readings if self.engine_aware else None
        ctx = self._context(eligible, self.exclude)
        return self.held.take(eligible, self.balancer, ctx, self.readings)

    def _with_room(self, eligible: list[Backend], readings: Readings | None) -> list[Backend]:
        """A batch line's candidates (docs/batch.md): only the engines whose readings show room
        by `batch.room_waiting` and `batch.room_kv_usage`; none left means no lease (the line
        is handed back and taken again when the fleet has room)."""
        cfg = self.parts.settings.batch
        if cfg is None or not readings:
            return eligible
        return [b for b in eligible if cfg.room_in(readings.get(b.name))]

    async def _after_hold(self, held: Held) -> Lease | None:
        """The held request's model has a ready backend: the hold ends (its keep-alive stopped
        before anything else is sent) and it tries as any queued request does."""
        await held.end()
        self.held.rebind(self.call.snapshot.by_name)
        return await self._try_admit()

    def _routed(self, lease: Lease, number: int) -> None:
        """What the pick chose and why, into the record, metrics, prefix index and trace."""
        parts = self.parts
        call = self.call
        rec = call.record
        choice = lease.choice or _NO_CHOICE
        want = self.want
        readings = self.readings
        rec.reason = choice.reason
        # Chosen where it is not served (load on demand): it is loaded there first.
        self.held.load_adapter = (
            want is not None
            and want.on_demand
            and not adapters.serves(
                readings.get(lease.backend) if readings else None, want, lease.backend
            )
        )
        parts.metrics.routed(call.model, self.balancer.name, lease.backend, rec.reason)
        if self.balancer.needs_tokens:
            self._count_tokens(lease.backend, choice)
        affinity = self.affinity
        if affinity:
            held = choice.held
            rec.prefix_chars = held * parts.settings.affinity.block_chars
            parts.affinity.dispatched(affinity.hashes, lease.backend, readings)
            if affinity.tokens is not None:
                self.held.flight = parts.affinity.kv_dispatched(
                    affinity, lease.backend, choice.cached
                )
            entries = parts.affinity.index.entries
            parts.metrics.affinity(len(affinity.hashes), held, entries)
        call.trace.picked(lease.backend, rec.reason)
        call.trace.attempt(lease.backend, number)
        rec.attempts += 1  # a migration's attempts count on from the first stream's

    def _count_tokens(self, backend: str, choice: Choice) -> None:
        """`balancer: latency`'s pick: refused for its SLO (a sheddable request none would
        serve in time), or its tokens counted on `backend` until the attempt ends."""
        parts = self.parts
        call = self.call
        if choice.predicted is not None:
            parts.metrics.predicted_ttft.labels(call.model).observe(choice.predicted)
        if choice.reason == UNATTAINABLE:
            self._refuse(choice)
        prompt = _prompt_tokens(self.affinity, call)
        completion = max(0, call.estimate - len(call.body) // 4)
        # A continuation's first token is a resumed stream's, not a TTFT: no sample from it.
        features = choice.features if call.continuation is None else None
        self.held.tokens = parts.latency.tokens.dispatched(
            backend, prompt - choice.cached, completion, features, choice.predicted
        )

    def _shed_early(self) -> None:
        """With admission, before a `sheddable` request with an SLO queues: the balancer's
        judgement on the eligible backends as they are (in-flight counts aside: `latency` weighs
        token loads and readings), and the 429 at once when none would serve it in time."""
        call = self.call
        ticket = call.ticket
        if ticket is None or BANDS[ticket.band] != "sheddable":
            return
        parts = self.parts
        eligible = parts.health.eligible(call.backends, call.model)
        readings = self._read_engines()
        candidates = [
            Candidate(b.name, b.weight, 0, readings.get(b.name) if readings else None)
            for b in eligible
        ]
        choice = self.balancer.pick(candidates, self._context(eligible, self.exclude, True))
        if choice is not None and choice.reason == UNATTAINABLE:
            self._refuse(choice)

    def _refuse(self, choice: Choice) -> NoReturn:
        call = self.call
        self.parts.metrics.shed("slo_unattainable")
        raise SloUnattainable(
            f"No backend serving `{call.model}` is predicted to meet this request's latency "
            "objective; retry later.",
            retry_after=max(
                1.0, (choice.predicted or 0.0) + self.queued - (call.slo[0] or 0.0) / 1000
            ),
        )

    async def _take_prefill(self, number: int, decode: Lease) -> None:
        """A lease on the prefill engine for this attempt when the prompt should be split
        (after the `decode` engine was chosen), else none: served whole on the decode engine.
        The last attempt after prefill failures goes whole: the decode engine can still
        answer."""
        parts = self.parts
        call = self.call
        pools = call.pools
        assert pools is not None
        affinity = self.affinity
        choice = decode.choice or _NO_CHOICE
        tokens = affinity.tokens if affinity else None
        prompt = len(tokens) if tokens is not None else len(call.body) // 4
        if tokens is not None:
            cached = choice.cached
        else:
            cached = choice.held * parts.settings.affinity.block_chars // 4
        # No panic mode here: with no healthy prefill engine the decode engine serves it.
        p_exclude = self.p_exclude
        candidates = [b for b in parts.health.healthy(pools.prefill) if b.name not in p_exclude]
        if p_exclude and number >= parts.settings.retries.attempts:
            candidates = []
        split = decide(
            prompt,
            cached,
            pools.rule.min_uncached_tokens,
            bool(candidates),
            "kv_transfer_params" in call.parsed(),
        )
        call.record.pd = split.reason
        if not split.split:
            return
        readings = parts.readings() if parts.readings and self.engine_aware else None
        ctx = self._context(candidates, p_exclude)
        chosen = await self.held.take_prefill(candidates, self.balancer, ctx, readings)
        if chosen is None:
            call.record.pd = "no_prefill"  # all at their max_inflight
        elif affinity:  # it computed the prompt: its own prefix cache holds it now
            parts.affinity.dispatched(affinity.hashes, chosen.backend, readings)


async def exchange(
    parts: Parts, call: Call, send: Send, held: AttemptLease, answered: Callable[[], None]
) -> None:
    """One attempt on the backend `held` leased; a split request's decode leg, after its
    prefill leg on the prefill engine `held` leased. What it takes it hands to `held`, which
    gives it back when the attempt ends."""
    rec = call.record
    backend = held.backend  # the request routes within the snapshot it started with
    assert backend is not None
    rec.backend = backend.name
    lora = parts.lora if call.adapter is not None else None
    if call.adapter is not None:
        held.adapter_flying()
    handoff = split = None
    if held.prefill is not None:
        handoff = await first_phase(parts, call, held)
        split = rec.prefill_backend  # this attempt's own: None when it is served whole
    if lora is not None:
        if held.load_adapter or lora.pending(backend.name, call.model):
            try:
                await lora.ensure(backend, call.model)
            except LoadFailed as exc:
                err = ProxyError(
                    f"Loading LoRA adapter `{call.model}` on `{backend.name}` failed: {exc}."
                )
                raise Retry(err, FailureKind.LORA_LOAD) from None
        held.using_adapter(lora)
    own = list(backend.auth_headers)
    if call.hop:
        own.append((HOP_HEADER, call.hop))  # replaces the client's own, if it sent one
    headers = upstream_request_headers(call.client_headers, rec.request_id, own)
    if call.segment is not None:
        await count_segment(parts, call, backend)
    if call.inject or call.remembers:
        # The usage event can only be taken out of bytes that are not compressed (nor
        # a response id read).
        headers = [(k, v) for k, v in headers if k.lower() != b"accept-encoding"]
        headers.append((b"accept-encoding", b"identity"))
    body = call.body_for(backend)
    if handoff is not None:
        body = with_members(body, handoff)
    transport, request = parts.pools.request(
        backend,
        call.path,
        call.trace.upstream_headers(headers),
        body,
        call.method,
        call.endpoint.state != "follows",  # a path with an id is not cached
    )
    call.working = True
    try:
        response = held.answer = await transport.send(request)
    except UPSTREAM_FAILURES as exc:
        failure = upstream_failure(exc, backend.name)
        parts.health.on_failure(backend.name, failure.kind)
        sent = isinstance(exc, _SENT) and not isinstance(exc, InvalidUpstreamResponse)
        raise Retry(failure.error, failure.kind, sent=sent) from exc

    status = response.status_code
    # A continuation's answer joins a stream that began with 200: it must be one too.
    if status >= 500 or status == 429 or (call.started and status >= 300):
        # The decode engine answered, but refused the handoff (vLLM's 500 when the
        # transfer fails, or its own failure): phase 1 again, on another prefill engine,
        # fresh params; whose failure it was, the next answer shows (Attempts._settle).
        # A 429 is the decode engine's own: another one takes it.
        refused = split if status >= 500 else None
        try:
            await _retryable_status(parts, call, backend, response, refused is None)
        except Retry as retry:
            retry.prefill = refused
            raise
    elif status == 400 and call.fallback is not None and call.fallback.chains.reads_refusals:
        await _refused(parts, call, send, backend, response)
        answered()
        return
    streaming = call.stream and status < 400
    if call.started:  # a migration: the client has its response head already
        answered()
        await pump(parts, call, send, response, backend, streaming, held.flight, held.tokens)
        return
    headers = downstream_response_headers(response.headers.raw, rec.request_id, streaming)
    headers.append((MODEL_HEADER, call.model.encode()))
    if parts.settings.expose_backend_header:
        headers.append((b"x-sluicegate-backend", backend.name.encode()))
    if held.tokens is not None:  # `balancer: latency`: the session's engine, opaque
        headers.append((SESSION_HEADER, parts.session_tokens.token(backend.name)))
    if call.reservation is not None:
        headers.extend(call.reservation.headers)
    rec.status = status
    call.trace.answered(status)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    call.started = True
    answered()
    # Its success is counted when the answer has come whole (router/request/lifecycle/pump.py):
    # one breaking mid-answer is a failure, not a success then a failure.
    await pump(parts, call, send, response, backend, streaming, held.flight, held.tokens)


async def _refused(
    parts: Parts, call: Call, send: Send, backend: Backend, response: Answer
) -> None:
    """A 400 of a model with context-window or content-policy fallbacks: read whole and told
    apart (router/core/errors.py's `refusal_reason`). One a fallback chain takes raises
    `Refusal`; an ordinary one reaches the client as the backend gave it."""
    body, cut = await _read_error(parts, response)
    call.working = False  # it answered: no generation to charge should the client leave
    headers = downstream_response_headers(response.headers.raw, call.record.request_id, False)
    if cut:
        headers = [(k, v) for k, v in headers if k != b"content-length"]
    reason = refusal_reason(400, body)
    assert call.fallback is not None
    if reason is not None and call.fallback.chains.for_reason(reason) is not None:
        raise Refusal(reason, (400, headers, body))
    if parts.settings.expose_backend_header:
        headers.append((b"x-sluicegate-backend", backend.name.encode()))
    call.trace.answered(400)
    await answer_whole(call, send, (400, headers, body))


async def _read_error(parts: Parts, response: Answer) -> tuple[bytes, bool]:
    """A (small) error answer's body, at most `max_error_body_bytes`; True when cut."""
    limit = parts.settings.max_error_body_bytes
    body = b""
    cut = False  # the backend's Content-Length no longer describes `body`
    try:
        async for chunk in response.aiter_raw():
            body += chunk
            if len(body) > limit:
                body = body[:limit]
                cut = True
                break
    except UPSTREAM_FAILURES:
        cut = True  # what arrived of the error answer is enough
    return body, cut or len(body) >= limit


async def _retryable_status(
    parts: Parts, call: Call, backend: Backend, response: Answer, charge: bool = True
) -> None:
    """Read the (small) error answer, note it, and hand it to the retry loop. `charge`
    False: a refused handoff, charged to one engine or the other later."""
    body, cut = await _read_error(parts, response)
    status = response.status_code
    retry_after = _retry_after(response.headers.get("retry-after"))
    if retry_after is not None and status in (429, 503):
        parts.health.cool_down(backend.name, retry_after)
    if status >= 500 and charge:
        parts.health.on_failure(backend.name, FailureKind.STATUS, status)
    headers = downstream_response_headers(response.headers.raw, call.record.request_id, False)
    if cut:
        headers = [(k, v) for k, v in headers if k != b"content-length"]
    err = ProxyError(f"Backend `{backend.name}` answered {status}.")
    raise Retry(err, FailureKind.STATUS, (status, headers, body))


def _prompt_tokens(affinity: RequestAffinity | None, call: Call) -> int:
    """The prompt's length in tokens: its ids' when tokenized, else the body's bytes / 4."""
    if affinity is not None and affinity.tokens is not None:
        return affinity.token_count
    return len(call.body) // 4


def _pinned(parts: Parts, call: Call) -> str | None:
    """The backend the request's x-session-token names, if it names one of its model's."""
    for name, value in call.client_headers:
        if name.lower() == SESSION_HEADER:
            return parts.session_tokens.backend(value, (b.name for b in call.backends))
    return None


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None  # HTTP-date form: rare from model servers; not worth a parser
    return seconds if 0 <= seconds <= 3600 else None
