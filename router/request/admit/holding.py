"""Holding: a request for a declared model (`scale_from_zero`) that finds no ready backend waits
here for the first one, and each declared model's demand (held + in flight) is counted here.

A declared model is known while no backend serves it (a pool scaled to zero): its requests get
in (router/request/admit/validate.py) and, while none of its backends is ready (present in the
registry and routable by health), `Holding.hold` parks them on a future each. The app tells
`changed()` on every registry change and every health flip (router/app.py): the first ready
backend wakes every request held for its model at once, which then goes through the normal
pick. No request polls; each waits on its future, its deadline and, for a stream, the next
keep-alive comment (one sleep on the injected clock at a time).

Leaving: past its deadline (`hold_timeout_s`, or the request's own `x-sluicegate-timeout`) a
held request gets `NoBackend` (503 with Retry-After); past `max_held` for its model a newcomer
gets `TooManyHeld` at once (other models are untouched); a client that leaves cancels its wait.
Every way out gives back the held count, the future and the body's bytes in the admission
queue's bound (when admission is configured, held bodies share `max_queue_bytes` with queued
ones; every body is in the process's `max_held_body_bytes` from the edge already).

The request path of a model that has backends pays one dict miss (`models.get`), and
`changed()` an empty-set test while nothing is held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from router.core.clock import Clock
from router.core.errors import NoBackend, TooManyHeld
from router.core.settings import ScaleFromZeroConfig, Settings
from router.request.admit.byte_budget import ByteBudget

Listener = Callable[[str], None]


def declared_models(settings: Settings) -> tuple[str, ...]:
    """The models held while no backend serves them: `scale_from_zero.models`, and with
    `scale_from_zero` on, the public names a discovery source lists in its `models:`."""
    cfg = settings.scale_from_zero
    if cfg is None:
        return ()
    names = dict.fromkeys(cfg.models)
    for source in settings.discovery:
        if isinstance(source.models, dict):
            names.update(dict.fromkeys(source.models))
    return tuple(names)


class Demand:
    """One declared model's requests in this process: held, and past holding (in flight, queued
    for admission included)."""

    __slots__ = ("held", "in_flight", "waiters")

    def __init__(self) -> None:
        self.held = 0
        self.in_flight = 0
        self.waiters: set[asyncio.Future[None]] = set()

    @property
    def total(self) -> int:
        return self.held + self.in_flight


class Holding:
    def __init__(
        self,
        cfg: ScaleFromZeroConfig | None,
        declared: Iterable[str],
        clock: Clock,
        ready: Callable[[str], bool],
        bodies: ByteBudget | None = None,
    ) -> None:
        """`ready(model)`: some backend of the model is in the registry and routable now;
        `bodies`: the admission queue's byte bound, shared by held bodies (None: none)."""
        self.cfg = cfg or ScaleFromZeroConfig()
        # The one dict the request path reads: empty unless models are declared.
        self.models: dict[str, Demand] = {m: Demand() for m in declared}
        self._clock = clock
        self._ready = ready
        self._bodies = bodies
        self._holding: set[str] = set()  # models with a request held now
        self._listeners: list[Listener] = []

    def listen(self, listener: Listener) -> None:
        """`listener(model)` after every change of a model's demand (the scaler, the shared
        demand's writer)."""
        self._listeners.append(listener)

    def demand(self, model: str) -> int | None:
        """Held plus in flight in this process; None: not a declared model."""
        d = self.models.get(model)
        return d.total if d is not None else None

    def held(self, model: str) -> int:
        d = self.models.get(model)
        return d.held if d is not None else 0

    def needs_hold(self, model: str) -> bool:
        return not self._ready(model)

    def changed(self) -> None:
        """The backend set or a backend's health changed: every request held for a model that
        is ready now is woken."""
        if not self._holding:
            return
        for model in list(self._holding):
            if self._ready(model):
                for fut in self.models[model].waiters:
                    if not fut.done():
                        fut.set_result(None)

    def begin(self, d: Demand, model: str) -> None:
        d.in_flight += 1
        self._tell(model)

    def end(self, d: Demand, model: str) -> None:
        d.in_flight -= 1
        self._tell(model)

    async def hold(
        self,
        model: str,
        within: float,
        size: int,
        keepalive: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Wait until `model` has a ready backend, at most `within` seconds; `size`: the body's
        bytes; `keepalive()` every `keepalive_s` while it waits (a stream's comment)."""
        cfg = self.cfg
        d = self.models[model]
        if d.held >= cfg.max_held:
            raise TooManyHeld(
                f"{cfg.max_held} requests for `{model[:200]}` wait for a backend already "
                "(scale_from_zero.max_held); retry later.",
                retry_after=1.0,
            )
        bodies = self._bodies
        if bodies is not None and not bodies.take(size):
            raise TooManyHeld(
                "The bodies of waiting requests fill admission.max_queue_bytes; retry later.",
                retry_after=1.0,
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        d.held += 1
        d.waiters.add(fut)
        self._holding.add(model)
        self._tell(model)
        try:
            if self._ready(model):  # it came while this request got here
                return
            clock = self._clock
            now = clock.now()
            due = now + within
            beat = now + cfg.keepalive_s if keepalive is not None else due
            while not fut.done():
                now = clock.now()
                if now >= due:
                    raise NoBackend(
                        f"No backend serving `{model[:200]}` became ready within "
                        f"{within:g} s; retry later.",
                        retry_after=min(within, 5.0),
                    )
                await _first(fut, clock.sleep(min(due, beat) - now))
                if keepalive is not None and not fut.done() and clock.now() >= beat:
                    beat += cfg.keepalive_s
                    await keepalive()
        finally:
            d.held -= 1
            d.waiters.discard(fut)
            if not d.waiters:
                self._holding.discard(model)
            if bodies is not None:
                bodies.give(size)
            self._tell(model)

    def _tell(self, model: str) -> None:
        for listener in self._listeners:
            listener(model)


async def _first(fut: asyncio.Future[None], sleep: Awaitable[None]) -> None:
    """Until `fut` is done or `sleep` ends; the sleep never outlives the wait."""
    sleeper = asyncio.ensure_future(sleep)
    try:
        await asyncio.wait((fut, sleeper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
