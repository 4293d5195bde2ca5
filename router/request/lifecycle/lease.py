"""An attempt's lease: what one attempt holds of the fleet, with the one owner that gives it back.

An attempt takes, in this order: the picked backend's in-flight lease (`take`: from the store at
once, or through the admission queue, which calls it when there is room), the KV flight of its
prompt there, a split request's prefill engine lease (`take_prefill`), the LoRA adapter's flight
and its use on the backend, the prefill call running aside (SGLang), the upstream answer.
`close` gives back whatever was taken, in reverse order, however the attempt ended (answered,
failed, cancelled, the client gone, timed out): the answer and the call aside first, the two
it awaits, then the rest in a `finally`, so that a cancellation arriving while they close skips
nothing; the admission queue is told a slot freed. The prefill lease goes back sooner, as soon
as the prefill leg is done (router/request/lifecycle/prefill_leg.py), through this owner too.

One per request, reused by its attempts (they run one after another); empty between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from balancers.base import Balancer
from balancers.context import PickContext
from balancers.inflight.base import InflightStore, Lease, Readings
from router.core.backend import Backend
from router.engine.lora_loads import LoraLoads
from router.request.lifecycle.call import Call
from router.request.lifecycle.parts import Parts
from router.upstream.transport import Answer

if TYPE_CHECKING:
    from router.engine.kv_events import Flight
    from router.request.placement.token_load import TokenFlight


class AttemptLease:
    __slots__ = (
        "_by_name",
        "_call",
        "_flying",
        "_model",
        "_parts",
        "_side",
        "_using",
        "answer",
        "backend",
        "flight",
        "lease",
        "load_adapter",
        "prefill",
        "tokens",
    )

    def __init__(self, parts: Parts, call: Call) -> None:
        self._parts = parts
        self._call = call
        self._by_name: Mapping[str, Backend] = call.snapshot.by_name
        self._model = call.model
        self.lease: Lease | None = None
        self.backend: Backend | None = None  # the lease's, as the call's snapshot has it
        self.flight: Flight | None = None  # its prompt on an engine with KV events
        self.tokens: TokenFlight | None = None  # its tokens there (`balancer: latency`)
        self.prefill: Lease | None = None  # until its leg is done (`prefill_done`, `aside`)
        self.load_adapter = False  # the adapter must be loaded on the backend first
        self._flying = False  # counted in the adapter flights (placement/adapter_flights.py)
        self._using = False  # counted as a use of the adapter the router loaded there
        self._side: asyncio.Task[None] | None = None  # SGLang's prefill call, holding `prefill`
        self.answer: Answer | None = None

    def rebind(self, by_name: Mapping[str, Backend]) -> None:
        """A held request routes within a later snapshot (router/request/lifecycle/hold.py)."""
        self._by_name = by_name

    async def take(
        self,
        backends: Sequence[Backend],
        balancer: Balancer,
        ctx: PickContext,
        readings: Readings | None,
    ) -> Lease | None:
        """A lease on the backend `balancer` picks among `backends` (None: all of them full)."""
        lease = await self._parts.store.acquire(backends, balancer, ctx, readings)
        if lease is not None:
            assert self.lease is None, "an attempt takes one lease"
            self.lease = lease
            self.backend = self._by_name[lease.backend]
        return lease

    async def take_prefill(
        self,
        backends: Sequence[Backend],
        balancer: Balancer,
        ctx: PickContext,
        readings: Readings | None,
    ) -> Lease | None:
        """A lease on a prefill engine for this attempt's prefill leg (None: all full)."""
        lease = await self._parts.store.acquire(backends, balancer, ctx, readings)
        assert self.prefill is None, "an attempt takes one prefill lease"
        self.prefill = lease
        return lease

    def adapter_flying(self) -> None:
        """The request for the adapter goes to the backend: in flight there until it ends."""
        assert self.backend is not None
        self._parts.flights.start(self.backend.name, self._model)
        self._flying = True

    def using_adapter(self, lora: LoraLoads) -> None:
        """The adapter the router loaded on the backend is in use until the attempt ends."""
        assert self.backend is not None
        lora.using(self.backend.name, self._model)
        self._using = True

    def prefill_done(self) -> None:
        """The prefill leg is done (or never ran): its engine's lease goes back now."""
        lease = self.prefill
        if lease is not None:
            self.prefill = None
            self._parts.store.release(lease)

    def aside(self, side: asyncio.Task[None]) -> None:
        """The prefill engine's call runs aside (SGLang): the prefill lease goes back when that
        call ends, however (a task cancelled before it ran never runs its own `finally`)."""
        lease = self.prefill
        assert lease is not None
        self.prefill = None
        self._side = side
        side.add_done_callback(_releasing(self._parts.store, lease))

    async def close(self) -> None:
        """Give back what the attempt took, in reverse order (the module docstring)."""
        side = self._side
        try:
            if side is not None:
                side.cancel()  # done when D answered; else the client left or D failed
            answer = self.answer
            if answer is not None:
                self.answer = None
                await answer.aclose()
            if side is not None:
                await asyncio.wait((side,))  # its lease goes back in its done callback
        finally:
            self._side = None
            self._give_back()

    def _give_back(self) -> None:
        """The synchronous part of `close`: nothing here awaits, so no cancellation cuts it."""
        parts = self._parts
        backend = self.backend
        if backend is not None:
            if self._using:
                self._using = False
                assert parts.lora is not None
                parts.lora.done(backend.name, self._model)
            if self._flying:
                self._flying = False
                parts.flights.end(backend.name, self._model)
        self.load_adapter = False
        self.prefill_done()
        tokens = self.tokens
        if tokens is not None:
            self.tokens = None
            tokens.end()
            self._observed(tokens)
        flight = self.flight
        if flight is not None:
            self.flight = None
            kv = parts.affinity.kv
            assert kv is not None  # a flight comes from it
            kv.ended(flight)
        lease = self.lease
        if lease is not None:
            self.lease = None
            self.backend = None
            parts.store.release(lease)
            if parts.admission is not None:
                parts.admission.released()

    def _observed(self, tokens: TokenFlight) -> None:
        """A `balancer: latency` attempt ended: what it observed, to the models and metrics."""
        call = self._call
        if not tokens.streaming or call.continuation is not None or call.record.error:
            return  # no first token to time (a whole body, a continuation, a failure)
        got = self._parts.latency.observe(tokens, call.record.usage)
        if got is not None:
            slo_ttft, slo_tpot = call.slo
            self._parts.metrics.latency_observed(*got, tokens.predicted, slo_ttft, slo_tpot)


def _releasing(store: InflightStore, lease: Lease) -> Callable[[asyncio.Task[None]], None]:
    def done(task: asyncio.Task[None]) -> None:
        store.release(lease)
        if not task.cancelled():
            task.exception()  # retrieved (the expected failures are caught in the task)

    return done
