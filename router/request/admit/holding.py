"""Holding: a request for a declared model (`scale_from_zero`) that finds no ready backend waits
here for the first one, and each declared model's demand (held + in flight) is counted here.

A declared model is known while no backend serves it (a pool scaled to zero): its requests get
in (router/request/admit/validate.py) and, while none of its backends is ready (present in the
registry and routable by health), `Holding.hold` parks them on a future each. The app tells
`changed()` on every registry change and every health flip (router/app.py): the first ready
backend wakes every request held for its model at once, which then goes through the normal
pick. No request polls; each waits on its future, its deadline and, for a stream, the next
keep-alive comment (one sleep on the injected clock at a time).

With admission configured, a held request waits in the admission queue instead (its place,
priority and deadline there; router/request/lifecycle/hold.py): `enter`/`leave` count it here,
and `changed()` also wakes the queue (`on_ready`) when a held model has a ready backend.

Leaving: past its deadline (`hold_timeout_s`, or the request's own `x-sluicegate-timeout`) a
held request gets `NoBackend` (503 with Retry-After); past `max_held` for its model a newcomer
gets `TooManyHeld` at once (other models are untouched); a client that leaves cancels its wait.
Every way out gives back the held count and the future. A held body is bounded as a queued one:
by the process's `max_held_body_bytes` from the edge (router/request/admit/validate.py), and in
the admission queue by `max_queue_bytes` (its ticket's size) when it waits there.

The request path of a model that has backends pays one dict miss (`models.get`), and
`changed()` an empty-set test while nothing is held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from router.core.clock import Clock
from router.core.errors import NoBackend, TooManyHeld
from router.core.settings import ScaleFromZeroConfig, Settings

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
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        """`ready(model)`: some backend of the model is in the registry and routable now;
        `on_ready()`: a model with requests held has a ready backend now (the admission
        queue's wake)."""
        self.cfg = cfg or ScaleFromZeroConfig()
        # The one dict the request path reads: empty unless models are declared.
        self.models: dict[str, Demand] = {m: Demand() for m in declared}
        self.clock = clock
        self._ready = ready
        self._on_ready = on_ready
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
        woke = False
        for model in list(self._holding):
            if self._ready(model):
                woke = True
                for fut in self.models[model].waiters:
                    if not fut.done():
                        fut.set_result(None)
        if woke and self._on_ready is not None:
            self._on_ready()

    def enter(self, model: str) -> Demand:
        """One more request of `model` held (refused past `max_held`); `leave` ends it."""
        cfg = self.cfg
        d = self.models[model]
        if d.held >= cfg.max_held:
            raise TooManyHeld(
                f"{cfg.max_held} requests for `{model[:200]}` wait for a backend already "
                "(scale_from_zero.max_held); retry later.",
                retry_after=1.0,
            )
        d.held += 1
        self._holding.add(model)
        self._tell(model)
        return d

    def leave(self, d: Demand, model: str) -> None:
        d.held -= 1
        if not d.held:
            self._holding.discard(model)
        self._tell(model)

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
        keepalive: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Wait until `model` has a ready backend, at most `within` seconds; `keepalive()` every
        `keepalive_s` while it waits (a stream's comment)."""
        cfg = self.cfg
        d = self.enter(model)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        d.waiters.add(fut)
        try:
            if self._ready(model):  # it came while this request got here
                return
            clock = self.clock
            now = clock.now()
            due = now + within
            beat = now + cfg.keepalive_s if keepalive is not None else due
            while not fut.done():
                now = clock.now()
                if now >= due:
                    raise no_backend(model, within)
                await _first(fut, clock.sleep(min(due, beat) - now))
                if keepalive is not None and not fut.done() and clock.now() >= beat:
                    beat += cfg.keepalive_s
                    await keepalive()
        finally:
            d.waiters.discard(fut)
            self.leave(d, model)

    def _tell(self, model: str) -> None:
        for listener in self._listeners:
            listener(model)


def no_backend(model: str, within: float) -> NoBackend:
    return NoBackend(
        f"No backend serving `{model[:200]}` became ready within {within:g} s; retry later.",
        retry_after=min(within, 5.0),
    )


async def _first(fut: asyncio.Future[None], sleep: Awaitable[None]) -> None:
    """Until `fut` is done or `sleep` ends; the sleep never outlives the wait."""
    sleeper = asyncio.ensure_future(sleep)
    try:
        await asyncio.wait((fut, sleeper), return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
