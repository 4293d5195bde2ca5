"""The admission queue: a request that finds every backend full waits here instead of failing.

`Admission.acquire(ticket, try_once)` returns a lease. While nothing waits for the model it is
one call of `try_once` (the proxy's pick-and-count); only when that finds no room does the
request queue. The backend is picked when it leaves the queue (late binding): a queued request
sleeps on its own future and is woken when a lease is released in this process, when engine
readings change, or by one process-wide re-check every `admission.recheck` seconds while
anything waits (slots freed by other replicas); no request polls. A woken request tries again;
when it gets a lease it wakes the next one (several slots may have freed), when it does not it
goes back to its place and waits.

Order: strict priority between the bands `critical` > `standard` > `sheddable`; inside a band, a
start-time fair queue over tenants (client keys) weighted by `weight`, in estimated tokens
(`estimate.estimate_tokens`: the body's bytes / 4 plus the completion budget times `n`). A
tenant with long prompts therefore gets no more than its share by sending fewer requests.

Leaving: past the ticket's deadline (`max_wait`, or the client's `x-sluicegate-timeout`) the
request gets 503 + Retry-After; a full queue (`max_queue` entries or `max_queue_bytes` of
bodies, all models) sheds its lowest entries (lowest band, latest in the fair order), which may
be the newcomer. Every exit, a cancelled one (the client left) included, takes the entry out in
`finally`. A request that queues is told so (`parked`), so that it can let go of what it need
not hold while it waits (the proxy drops its parsed body: the raw body is held once).

Time: two chores on the runner (the app's, or one of the queue's own), on the injected clock:
`admission_deadlines`, a timer over a heap of the queued tickets' deadlines that ends each
wait when it passes (no timer per request), and `admission_recheck`, the re-check, which
sleeps until something queues. A ticket's deadline is made on the request's clock
(`time.perf_counter`, `make_ticket`'s `started`); it is read on the queue's clock once, when
the ticket queues.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from starlette.datastructures import Headers

from balancers.inflight.base import Lease, Readings
from router.core.backend import Backend
from router.core.errors import BadRequest, NoCapacity
from router.core.runner import Runner, Wake, shared_or_own
from router.core.settings import AdmissionConfig
from router.request.admit.byte_budget import ByteBudget

BANDS = ("critical", "standard", "sheddable")
_RANK = {name: i for i, name in enumerate(BANDS)}
_REQUEST_CLOCK = time.perf_counter  # the clock of a ticket's `deadline` (make_ticket's `started`)
PRIORITY_HEADER = "x-sluicegate-priority"
TIMEOUT_HEADER = "x-sluicegate-timeout"


class QueueTimeout(NoCapacity):
    code = "queue_timeout"


class QueueFull(NoCapacity):
    code = "queue_full"


@dataclass(slots=True, eq=False)
class Ticket:
    """One request's place in the admission queue."""

    model: str
    band: int  # index into BANDS: 0 is served first
    tenant: str
    weight: float
    cost: float  # estimated tokens
    deadline: float  # monotonic clock
    deadline_reason: str  # "max_wait" or "deadline" (the client's own timeout)
    size: int = 0  # bytes of the request body it holds while queued (max_queue_bytes)
    start: float = 0.0  # fair-queue start tag, set on entering the queue
    entered: float = 0.0  # when it entered the queue (the admission clock)
    seq: int = 0
    queued: bool = False  # in its band's heap
    woken: bool = False  # taken out of the heap to try again, not yet back
    admitted: bool = False  # left the queue with a lease (only then does `settle` correct)
    waiter: asyncio.Future[None] | None = None
    queue: _ModelQueue | None = None  # the queue it was tagged in (for `settle`)

    @property
    def order(self) -> tuple[float, int]:
        return (self.start, self.seq)


def make_ticket(
    cfg: AdmissionConfig,
    headers: Headers,
    request_id: str,
    model: str,
    cost: int,
    size: int,
    started: float,
    priority: str,
    weight: float,
    tenant: str,
) -> Ticket:
    """The ticket for a request; a bad priority or timeout header is a `BadRequest`. `cost`:
    its token estimate; `size`: its body's bytes. `started` is the request's
    `time.perf_counter()` at arrival; deadlines are on that clock."""
    band = _RANK.get(priority, 1)
    asked = headers.get(PRIORITY_HEADER)
    if asked is not None:
        rank = _RANK.get(asked.strip().lower())
        if rank is None:
            raise BadRequest(
                f"Header `{PRIORITY_HEADER}` must be one of: {', '.join(BANDS)}.",
                code="invalid_priority",
                request_id=request_id,
            )
        band = max(band, rank)  # a request may lower its band, never raise it
    deadline, reason = started + cfg.max_wait, "max_wait"
    seconds = timeout_of(headers, request_id)
    if seconds is not None and started + seconds < deadline:
        deadline, reason = started + seconds, "deadline"
    return Ticket(model, band, tenant, weight, cost, deadline, reason, size)


def timeout_of(headers: Headers, request_id: str) -> float | None:
    """The request's own `x-sluicegate-timeout` in seconds (None: not given); a bad one is a
    `BadRequest`."""
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise BadRequest(
            f"Header `{TIMEOUT_HEADER}` must be a positive number of seconds.",
            code="invalid_timeout",
            request_id=request_id,
        )
    return seconds


class _Band:
    __slots__ = ("finish", "heap", "live", "vtime")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Ticket]] = []
        self.live = 0
        self.vtime = 0.0  # start tag of the last request admitted from the queue
        self.finish: dict[str, float] = {}  # tenant -> finish tag of its last queued request


class _ModelQueue:
    __slots__ = ("bands", "last", "live", "pending", "waking")

    def __init__(self) -> None:
        self.bands = (_Band(), _Band(), _Band())
        self.live = 0  # in the heaps
        self.last = 0.0  # when it last let one through, or began to wait (the admission clock)
        # One woken request at a time, always the head: the fair order holds exactly.
        self.waking = 0  # 1 while a woken request tries for a lease
        self.pending = False  # room may have freed while it tried


class AdmissionMetrics(Protocol):
    """What the queue reports; `router/ops/metrics.py`'s `Metrics` implements it."""

    def queue_depth(self, model: str, priority: str, delta: int) -> None: ...
    def queue_wait(self, model: str, priority: str, seconds: float) -> None: ...
    def shed(self, reason: str) -> None: ...


class _NoMetrics:
    def queue_depth(self, model: str, priority: str, delta: int) -> None:
        return None

    def queue_wait(self, model: str, priority: str, seconds: float) -> None:
        return None

    def shed(self, reason: str) -> None:
        return None


class Admission:
    def __init__(
        self,
        cfg: AdmissionConfig,
        metrics: AdmissionMetrics | None = None,
        clock: Callable[[], float] = time.perf_counter,
        runner: Runner | None = None,
    ) -> None:
        self.cfg = cfg
        self._metrics: AdmissionMetrics = metrics or _NoMetrics()
        # The app's clock and runner (whose `sleep` is that clock's); no runner: one of its
        # own, on real time, once something queues.
        self._clock = clock
        self._own_runner: Runner | None = None
        self._queues: dict[str, _ModelQueue] = {}
        self._busy: set[_ModelQueue] = set()  # queues with someone in the heaps
        self._size = 0  # queued, all models
        self._bytes = ByteBudget(cfg.max_queue_bytes)  # their bodies' bytes
        self._seq = 0
        self._mean_wait = 1.0  # seconds, a moving average: the Retry-After of a refusal
        # Model -> seconds between two requests leaving its queue while it is busy, a moving
        # average (`wait_ahead`). Bounded by the models routed (cleared past 4096).
        self._drain: dict[str, float] = {}
        # Queued tickets by deadline (on `clock`); an entry whose ticket left is dropped when
        # it comes up, or when they outnumber the queue (`_expire_later`).
        self._deadlines: list[tuple[float, int, Ticket]] = []
        self._deadline_wake = Wake()  # a deadline sooner than the one the chore sleeps for
        self._rechecking = False  # something waits: the re-check keeps its period
        self._recheck_due = False  # a period has passed since it began
        self._recheck_wake = Wake()
        self._chores = False
        if runner is not None:
            self._add_chores(runner)

    @property
    def depth(self) -> int:
        return self._size

    @property
    def queued_bytes(self) -> int:
        return self._bytes.held

    def bands(self) -> dict[str, dict[str, float | int]]:
        """Per band: requests waiting and the oldest one's wait in seconds, all models. Walks
        the queue (bounded by `max_queue`): for the console, not the request path."""
        now = self._clock()
        out: dict[str, dict[str, float | int]] = {
            name: {"depth": 0, "oldest_wait": 0.0} for name in BANDS
        }
        for q in self._busy:
            for name, band in zip(BANDS, q.bands, strict=True):
                row = out[name]
                row["depth"] += band.live
                for _, _, t in band.heap:
                    if t.queued:
                        row["oldest_wait"] = max(row["oldest_wait"], round(now - t.entered, 3))
        return out

    def wait_ahead(self, t: Ticket) -> float:
        """Seconds `t` is predicted to wait if it queued now: the entries of its model ahead of
        it (its band and the bands above; later arrivals of a higher band that pass it are not
        foreseen) times the recent interval between two leaving that queue. 0 when none waits,
        or no queue of its model has let one through yet. O(bands); read only by
        `balancer: latency` for a request with an SLO."""
        q = self._queues.get(t.model)
        if q is None:
            return 0.0
        ahead = q.waking + sum(b.live for b in q.bands[: t.band + 1])
        return ahead * self._drain.get(t.model, 0.0) if ahead else 0.0

    def waited(self, t: Ticket) -> float:
        """Seconds `t` has waited in the queue so far (0 if it never queued)."""
        return self._clock() - t.entered if t.queue is not None else 0.0

    def saturated(self, backend: Backend, readings: Readings) -> bool:
        r = readings.get(backend.name)
        if r is None or r.stale:
            return False  # no fresh reading: only max_inflight says full
        sat = self.cfg.saturation
        return r.waiting >= sat.waiting or r.kv_usage >= sat.kv_usage

    def open_backends(self, backends: Sequence[Backend], readings: Readings) -> list[Backend]:
        if not readings:
            return list(backends)
        return [b for b in backends if not self.saturated(b, readings)]

    # -- the request's side -------------------------------------------------------------------

    async def acquire(
        self,
        t: Ticket,
        try_once: Callable[[], Awaitable[Lease | None]],
        parked: Callable[[], None] | None = None,
    ) -> Lease:
        """A lease for `t`; `parked` is called once if it has to queue."""
        q = self._queues.get(t.model)
        if q is None or (q.live == 0 and q.waking == 0):
            lease = await try_once()
            if lease is not None:
                return lease
            q = self._queues.setdefault(t.model, _ModelQueue())
        # Someone waits already (it goes first, unless this one ranks before it) or no room.
        entered = t.entered = self._clock()
        if q.live == 0 and q.waking == 0:
            q.last = entered  # the queue begins to wait: the drain interval counts from here
        due = entered + (t.deadline - _REQUEST_CLOCK())  # the deadline on the queue's clock
        self._tag(t)
        try:
            self._enter(q, t)
            self._expire_later(due, t)
            if parked is not None:
                parked()
            while True:
                if due <= self._clock():
                    raise self._expired(t)
                assert t.waiter is not None  # each push gives it a fresh one
                await t.waiter  # a result: try; QueueFull: shed; QueueTimeout: its deadline
                # Still counted as waking while it tries: a newcomer must not take its slot.
                lease = await try_once()
                q.waking -= 1
                t.woken = False
                again, q.pending = q.pending, False
                if lease is not None:
                    t.admitted = True
                    band = q.bands[t.band]
                    band.vtime = max(band.vtime, t.start)
                    now = self._clock()
                    waited = now - entered
                    self._mean_wait += (waited - self._mean_wait) * 0.2
                    self._drained(t.model, now - q.last)
                    q.last = now
                    self._metrics.queue_wait(t.model, BANDS[t.band], waited)
                    self._wake(q)  # more room may have freed than this one slot
                    return lease
                self._push(q, t)  # still full: back to its place
                if again:  # a slot freed while it tried: the head (maybe itself) tries again
                    self._wake(q)
        finally:
            waiter = t.waiter
            if waiter is not None and waiter.done() and not waiter.cancelled():
                waiter.exception()  # told to leave as it was cancelled: read, not left unread
            if t.queued:
                self._remove(q, t)
            if t.woken:  # woken but leaving (cancelled, expired): hand the wake on
                t.woken = False
                q.waking -= 1
                self._wake(q)
            if q.live == 0 and q.waking == 0 and self._queues.get(t.model) is q:
                del self._queues[t.model]

    def _drained(self, model: str, gap: float) -> None:
        drain = self._drain
        prev = drain.get(model)
        if prev is None and len(drain) >= 4096:
            drain.clear()
        drain[model] = gap if prev is None else prev + (gap - prev) * 0.2

    def settle(self, t: Ticket, used_tokens: float) -> None:
        """The request ended having used `used_tokens`: its tenant's later requests in the band
        move by the difference from the estimate, so a short estimate buys no extra share. A
        no-op when it never queued or its queue has drained since (tags restart then), and when
        it left the queue without a slot (expired, shed, client gone): a refund then would pull
        the tenant's next tags back below those of its own requests still queued, and a key
        flooding past `max_wait` would get each new request placed level with a quiet key's."""
        q = t.queue
        if q is None or not t.admitted or self._queues.get(t.model) is not q:
            return
        finish = q.bands[t.band].finish
        if t.tenant in finish:
            finish[t.tenant] += (used_tokens - t.cost) / t.weight

    def _tag(self, t: Ticket) -> None:
        t.queue = self._queues.setdefault(t.model, _ModelQueue())
        band = self._band_of(t)
        t.start = max(band.vtime, band.finish.get(t.tenant, 0.0))
        band.finish[t.tenant] = t.start + t.cost / t.weight
        self._seq += 1
        t.seq = self._seq

    def _band_of(self, t: Ticket) -> _Band:
        return self._queues.setdefault(t.model, _ModelQueue()).bands[t.band]

    def _enter(self, q: _ModelQueue, t: Ticket) -> None:
        cfg = self.cfg
        if t.size > cfg.max_queue_bytes:
            raise self._refused(QueueFull, "queue_full", "The admission queue is full")
        # Entries or bytes over their bound: the lowest go first, the newcomer if it is lowest.
        while self._size >= cfg.max_queue or not self._bytes.fits(t.size):
            victim = self._lowest()
            if victim is None or (victim.band, victim.order) < (t.band, t.order):
                raise self._refused(QueueFull, "queue_full", "The admission queue is full")
            vq = self._queues[victim.model]
            self._remove(vq, victim)
            assert victim.waiter is not None
            if not victim.waiter.done():  # done: it is leaving already (see `_wake`)
                victim.waiter.set_exception(
                    self._refused(QueueFull, "queue_full", "The admission queue is full")
                )
        self._push(q, t)

    def _lowest(self) -> Ticket | None:
        """The entry a full queue sheds: lowest band, then latest in fair order. O(queued), paid
        only when the queue is full."""
        for rank in reversed(range(len(BANDS))):
            worst: Ticket | None = None
            for q in self._busy:
                for _, _, t in q.bands[rank].heap:
                    if t.queued and (worst is None or t.order > worst.order):
                        worst = t
            if worst is not None:
                return worst
        return None

    def _push(self, q: _ModelQueue, t: Ticket) -> None:
        band = q.bands[t.band]
        heapq.heappush(band.heap, (t.start, t.seq, t))
        t.queued = True
        t.waiter = asyncio.get_running_loop().create_future()
        band.live += 1
        q.live += 1
        self._size += 1
        self._bytes.add(t.size)
        self._busy.add(q)
        self._metrics.queue_depth(t.model, BANDS[t.band], 1)
        if not self._rechecking:  # the first to wait: the re-check starts its period
            self._rechecking, self._recheck_due = True, False
            self._ensure_chores()
            self._recheck_wake.set()

    def _remove(self, q: _ModelQueue, t: Ticket) -> None:
        """Out of the heap, lazily: the heap drops dead entries as they reach its top."""
        band = q.bands[t.band]
        self._dequeued(q, band, t)
        if q.live == 0:
            for b in q.bands:
                b.heap.clear()
        elif len(band.heap) > 2 * band.live + 64:
            band.heap = [e for e in band.heap if e[2].queued]
            heapq.heapify(band.heap)

    def _dequeued(self, q: _ModelQueue, band: _Band, t: Ticket) -> None:
        """`t` no longer waits in `band` of `q`: the counts and the depth gauge follow."""
        t.queued = False
        band.live -= 1
        q.live -= 1
        self._size -= 1
        self._bytes.give(t.size)
        self._metrics.queue_depth(t.model, BANDS[t.band], -1)
        if q.live == 0:
            self._busy.discard(q)

    def _expired(self, t: Ticket) -> NoCapacity:
        what = "its own deadline" if t.deadline_reason == "deadline" else "admission.max_wait"
        return self._refused(
            QueueTimeout,
            t.deadline_reason,
            f"No backend serving `{t.model[:200]}` had room within {what}",
        )

    def _refused(self, cls: type[NoCapacity], reason: str, message: str) -> NoCapacity:
        self._metrics.shed(reason)
        retry = max(1.0, min(self._mean_wait, self.cfg.max_wait))
        return cls(f"{message}; retry later.", retry_after=retry)

    # -- the side that frees room -------------------------------------------------------------

    def _wake(self, q: _ModelQueue) -> bool:
        """Take the first queued request of `q` out and let it try; False if none. While one
        tries, a wake is remembered and passed on when it is done."""
        if q.waking:
            q.pending = True
            return False
        for band in q.bands:
            heap = band.heap
            while heap:
                t = heapq.heappop(heap)[2]
                if not t.queued:
                    continue
                self._dequeued(q, band, t)
                assert t.waiter is not None
                if t.waiter.done():
                    # Its wait ended (deadline, client gone: both cancel the future) and its
                    # task has not run yet: it is leaving, the wake goes to the next one.
                    continue
                t.woken = True
                q.waking += 1
                t.waiter.set_result(None)
                return True
        return False

    def released(self) -> None:
        """A lease was released in this process: one slot, one request woken per model."""
        if self._queues:  # empty unless something waits or tries: the common case costs this
            for q in list(self._queues.values()):
                self._wake(q)

    def changed(self) -> None:
        """Engine readings changed: a saturated backend may have room now."""
        self.released()

    # -- time -------------------------------------------------------------------------------

    def _add_chores(self, runner: Runner) -> None:
        runner.timer("admission_deadlines", self._expire_due, self._deadline_wake)
        runner.timer("admission_recheck", self._recheck, self._recheck_wake)
        self._chores = True

    def _ensure_chores(self) -> None:
        """Given no runner, the chores go on one of the queue's own once something queues."""
        if not self._chores:
            self._own_runner = runner = shared_or_own(None)[0]
            self._add_chores(runner)

    def _expire_later(self, due: float, t: Ticket) -> None:
        """`t` queued: its wait ends at `due` unless it has left by then."""
        heap = self._deadlines
        if len(heap) > 2 * self._size + 64:  # mostly tickets that left: keep those waiting
            heap[:] = [e for e in heap if e[2].queued or e[2].woken]
            heapq.heapify(heap)
        heapq.heappush(heap, (due, t.seq, t))
        if heap[0][2] is t:
            self._ensure_chores()
            self._deadline_wake.set()

    async def _expire_due(self) -> float | None:
        """The `admission_deadlines` round: each queued ticket whose deadline passed is told
        (its waiter fails with QueueTimeout: it leaves, in its own `finally`); the seconds until
        the next deadline (None: nothing waits). A ticket trying for a lease at its deadline
        is not interrupted: it checks its deadline once it is back in its place."""
        heap = self._deadlines
        now = self._clock()
        while heap:
            due, _, t = heap[0]
            if not (t.queued or t.woken):  # it left (served, shed, gone): nothing to end
                heapq.heappop(heap)
                continue
            if due > now:
                return due - now
            heapq.heappop(heap)
            waiter = t.waiter
            if t.queued and waiter is not None and not waiter.done():
                waiter.set_exception(self._expired(t))
        return None

    async def _recheck(self) -> float | None:
        """The `admission_recheck` round: while anything waits, every `admission.recheck`
        seconds each queue that is idle-waiting has its head try (slots freed by other
        replicas); nothing waiting, it sleeps until something queues."""
        if not self._busy:
            self._rechecking = self._recheck_due = False
            return None
        if self._recheck_due:
            for q in list(self._busy):
                if q.waking == 0:
                    self._wake(q)  # nothing else to do: the queue is idle-waiting
        self._recheck_due = True
        return self.cfg.recheck

    async def aclose(self) -> None:
        runner, self._own_runner = self._own_runner, None
        if runner is not None:
            await runner.stop()
            self._chores = False
