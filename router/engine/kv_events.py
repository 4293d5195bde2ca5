"""The router's subscription to every vLLM engine's KV-cache events, feeding the `TokenIndex`.

One ZMQ SUB socket per publisher (a backend with `kv_events`, or each data-parallel rank that its
`GET /kv_event_sources` lists), read on the event loop without a future per message: the
sockets are polled together every PUMP_INTERVAL and each ready one drained (at most DRAIN_MAX
messages per round), so a busy engine's batches are read several at a time rather than one
wake-up each. Every router process subscribes on its own, so no index is shared:
each replica is exact once it has caught up. Connect or bind follows vLLM (router/core/settings
`KvEventsConfig`); an `ipc://` path keeps both on one machine.
Sequence numbers, per publisher:
- the next one: applied; an older one (a replay overlap): ignored;
- 0 after others, or one at or below the last but built after it (the restarted engine's first
  batches went out before the socket reconnected): the engine restarted with an empty cache,
  so its index is dropped (and the missed batches asked for, as for a gap from 0);
- a gap (or a first message past 0: the router joined late): with a `replay_endpoint` the
  missed batches are asked for (at once on joining, too: an idle engine sends nothing; ZMQ
  DEALER, vLLM answers `(seq, payload)` pairs, then seq -1) while new ones are held (at most
  HOLD_MAX_BYTES); without one, or when the replay no longer has them, the index is `unsure`
  until the engine has stored a cache's worth of blocks since (every block it holds was then
  seen) or restarts.
Bounds (a publisher is an engine, not a client, yet a flood from it must not freeze the
router): a frame over MAX_MESSAGE_BYTES drops the publisher's connection (ZMQ_MAXMSGSIZE; the
batch is a gap), at most QUEUE_MAX messages wait on the router's side (the rest in the
publisher's own queue), a batch applies at most MAX_BATCH_BLOCKS block hashes (past them the
feed is `unsure`), a replay's answer is read up to REPLAY_MAX_BYTES, and a loop turn handles
TURN_BYTES of messages or TURN_SECONDS of work before the event loop's other tasks get their
turn, the replay's catching up included. Each is O(1) per message.
A backend is `live` (its index is the truth; `cache_aware` routes on it) when each of its
publishers is; else `waiting` (nothing heard yet), `unsure`, `replaying` or `error` (a socket
that could not be set up; retried every RETRY seconds). Each request this router sends an
engine is a `Flight` there until its attempt ends: its uncached tokens are pending until the
engine's next event or the answer's first chunk (the prefill is done), whichever comes first
(`pending_ttl` bounds the rest), and its prompt's block keys count as held (a running request's
blocks cannot be evicted, and a second request of a prompt still prefilling then joins it
instead of building a second copy elsewhere). The first chunk matters: a prompt that hits stores
no full block and sends no event, so a holder's pending grew with every hit (docs/kv-events.md).
Cost: per message one decode (msgspec), and per stored block a scan for its end and one hash
(router/engine/kv_index.py); the event counts reach the metrics once per FLUSH_INTERVAL, not per
message (bench/scenarios/kv.py).
The loops are chores on the runner (the app's, or one of its own), started once a socket opens
or a retry is owed, so a router without events runs none: `kv_events_pump` (every
PUMP_INTERVAL), `kv_events_flush` (every FLUSH_INTERVAL) and `kv_events_retry`, a timer that
opens again what failed (a socket, an engine's `/kv_event_sources`) once its RETRY seconds
on the injected clock (`monotonic`) are up. A replay, a discovery question and a run-time
endpoint's vetting are one-shot tasks of their own, cancelled at close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq
import zmq.asyncio

from router.core.backend import Backend
from router.core.netpolicy import OPEN, NetPolicy
from router.core.runner import Runner, Wake, shared_or_own
from router.core.settings import KvEventsConfig
from router.engine.kv_endpoints import (
    EndpointRefused,
    local_refusal,
    path_refusal,
    resolve,
    vetted,
)
from router.engine.kv_index import TokenIndex
from router.engine.kv_wire import Batch, WireError, decode
from router.upstream.pools import ask

log = logging.getLogger("sluicegate.kv_events")

DRAIN_MAX = 512  # messages per socket per round before the others' turn
PUMP_INTERVAL = 0.02  # seconds between two rounds of reading every socket (lag added, at most)
# A frame larger drops the connection (ZMQ_MAXMSGSIZE): a vLLM step of 200 k new tokens fits.
MAX_MESSAGE_BYTES = 1 << 20
# Messages ZMQ holds for one publisher on the router's side (RCVHWM): with the largest frames,
# QUEUE_MAX x MAX_MESSAGE_BYTES. Past it ZMQ stops reading that connection, and the rest waits
# in the publisher's own queue (vLLM's holds 100,000); 64 still takes thousands a second.
QUEUE_MAX = 64
TURN_BYTES = 256 << 10  # message bytes one loop turn handles before yielding the loop
TURN_SECONDS = 0.005  # work one loop turn does before yielding the loop
HOLD_MAX_BYTES = 8 << 20  # batches held while a replay runs: payload + HOLD_OVERHEAD each
HOLD_OVERHEAD = 512  # bytes a held batch counts beyond its payload (its objects)
REPLAY_MAX_BYTES = 16 << 20  # a replay's answer read up to this, counted as held (the rest: unsure)
RETRY = 5.0  # seconds between discovery or socket attempts
REPLAY_TIMEOUT = 5.0
DISCOVER_TIMEOUT = 2.0  # seconds for the whole /kv_event_sources answer
MAX_SOURCES_BODY = 256 * 1024  # one publisher per data-parallel rank: a few hundred bytes each
DEFAULT_BLOCKS = 1024  # an engine's capacity in blocks until its metrics say
PENDING_MAX = 4096  # dispatches counted as pending per backend
CHURN_TAU = 5.0  # seconds: the window of an engine's eviction rate (`churn`)
FLUSH_INTERVAL = 1.0  # seconds between two hand-overs of the event counts to the metrics

STATES = ("waiting", "live", "unsure", "replaying", "error")


def _frames(recv: Callable[..., Any]) -> list[bytes]:
    """One multipart message, waiting for none (zmq.Again: nothing queued). pyzmq's
    `recv_multipart` asks `getsockopt(RCVMORE)` after each frame, which converts the option to
    its enum in Python: 3 of those a batch were a tenth of the ingestion's cost
    (bench/scenarios/kv.py). A frame received without a copy carries the flag itself. A message's
    frames arrive together, so none is missing once its first has come."""
    frame = recv(zmq.NOBLOCK, copy=False)
    parts = [frame.bytes]
    while frame.more:
        frame = recv(zmq.NOBLOCK, copy=False)
        if len(parts) < 4:  # a fourth makes it malformed already: the rest is not copied
            parts.append(frame.bytes)
    return parts


@dataclass
class Feed:
    """One publisher: an engine, or one data-parallel rank of it."""

    backend: str
    endpoint: str
    bind: bool
    topic: bytes
    replay: str | None
    rank: int = 0
    learned: bool = False  # from the engine's `GET /kv_event_sources`, not the config
    sock: zmq.Socket[bytes] | None = None
    # Where `sock` connects: its disconnections, to connect again (`KvEvents._reconnect`).
    monitor: zmq.Socket[bytes] | None = None
    last_seq: int | None = None
    last_ts: float = 0.0  # the engine's clock on the last batch applied
    state: str = "waiting"
    stored_since_gap: int = 0
    held: deque[Batch] = field(default_factory=deque)
    held_bytes: int = 0  # what `held` counts against HOLD_MAX_BYTES
    catching_up: bool = False  # a replay's batches are being applied: new ones wait behind
    replays: int = 0  # replays started: a replay that is no longer the last one stops
    error: str | None = None
    retry_at: float | None = None  # its socket (or vetting) tried again then (`kv_events_retry`)

    def hold(self, batch: Batch) -> None:
        """Keep `batch` until the replay is applied; past HOLD_MAX_BYTES the oldest go (the
        replay's answer then misses them: `unsure`)."""
        held = self.held
        held.append(batch)
        self.held_bytes += batch.size + HOLD_OVERHEAD
        while self.held_bytes > HOLD_MAX_BYTES and len(held) > 1:
            self.held_bytes -= held.popleft().size + HOLD_OVERHEAD

    def take_held(self) -> list[Batch]:
        out = list(self.held)
        self.held.clear()
        self.held_bytes = 0
        return out


class _Turn:
    """What one task may do with the event loop before yielding it: TURN_BYTES of messages
    or TURN_SECONDS, whichever comes first (a message is handled whole)."""

    __slots__ = ("end", "left", "over")

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.left = TURN_BYTES
        self.end = time.perf_counter() + TURN_SECONDS
        self.over = False

    def spend(self, size: int) -> bool:
        """`size` bytes handled; True (and `over`) when the turn is used up."""
        self.left -= size
        if self.left <= 0 or time.perf_counter() >= self.end:
            self.over = True
        return self.over


@dataclass(slots=True, eq=False)
class Flight:
    """A request this router sent an engine with events, until it ends (module docstring)."""

    backend: str
    when: float  # monotonic clock at the dispatch
    tokens: int  # its uncached prompt tokens while its prefill is pending, then 0
    keys: Sequence[bytes]  # its prompt's block keys at the engine's block size
    ended: bool = False

    def prefilled(self) -> None:
        """Its answer began: the engine computed its prompt, which is no longer pending."""
        self.tokens = 0


class Churn(Mapping[str, float]):
    """Each live engine's eviction rate (`KvEvents.churn`), worked out when read: only a new
    prompt on a fleet of full caches reads it, and an `exp` per engine on every request cost
    more than the rest of the per-engine hints together (0.22 us each, timeit)."""

    __slots__ = ("_kv", "_names")

    def __init__(self, kv: KvEvents, names: Collection[str]) -> None:
        self._kv = kv
        self._names = names

    def __getitem__(self, name: str) -> float:
        if name not in self._names:
            raise KeyError(name)
        return self._kv.churn(name)

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._names if self._kv.churn(n))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Keys:
    """`keys[i] in flying` for bisect: the set of in-flight keys is prefix-closed (each flight
    adds its whole chain), so the answer is True up to some i and False after."""

    __slots__ = ("flying", "keys")

    def __init__(self, keys: Sequence[bytes], flying: dict[bytes, int]) -> None:
        self.keys = keys
        self.flying = flying

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> bool:
        return self.keys[i] not in self.flying


@dataclass
class Engine:
    """A backend's event state, as `/admin/backends` and `sluicegate status` show it."""

    feeds: list[Feed] = field(default_factory=list)
    discovering: bool = False
    retry_at: float | None = None  # its `/kv_event_sources` asked again then
    lag: float | None = None  # seconds between the engine building the last batch and us
    last_event: float = 0.0  # wall clock of the last batch received
    counts: dict[str, int] = field(default_factory=dict)  # event type -> received
    reported: dict[str, int] = field(default_factory=dict)  # counts as of the last flush
    pending: deque[Flight] = field(default_factory=deque)  # flights by age, for their tokens
    flying: dict[bytes, int] = field(default_factory=dict)  # block key -> flights holding it
    gaps: int = 0
    restarts: int = 0
    churn: float = 0.0  # blocks evicted, decayed by CHURN_TAU, as of `churn_at`
    churn_at: float = 0.0


class KvEvents:
    def __init__(
        self,
        index: TokenIndex | None = None,
        capacity: Callable[[str], int | None] | None = None,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        on_events: Callable[[str, str, int], None] | None = None,
        pending_ttl: float = 2.0,
        policy: NetPolicy | None = None,
        local_sockets: bool = False,
        runner: Runner | None = None,
    ) -> None:
        self._policy = policy  # for backends not from the file, as their traffic
        # The app's runner, whose `sleep` is `monotonic`'s clock; None: one of its own, on
        # real time, made when the first chore is (`_chores`).
        self._runner = runner
        self._own_runner: Runner | None = None
        self._retry_wake = Wake()  # a retry owed sooner than the one the chore sleeps for
        self._retrying = False  # `kv_events_retry` registered
        # Backends added at run time may bind and use ipc:// (admin.kv_events_bind_and_ipc).
        self._local_sockets = local_sockets
        self.index = index or TokenIndex()
        self._capacity = capacity or (lambda _name: None)
        self._wall = wall
        self._mono = monotonic
        self._on_events = on_events
        self._pending_ttl = pending_ttl
        # SUB sockets are read synchronously on readiness (no future per message); the replay's
        # DEALER, a rare path, is awaited: one context, seen both ways, made on first use (it
        # starts an I/O thread, which a router without events does not need).
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._async_ctx: zmq.asyncio.Context | None = None
        self._engines: dict[str, Engine] = {}
        self._configs: dict[str, tuple[str, KvEventsConfig]] = {}  # name -> (url, config)
        self._backends: dict[str, Backend] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._poller = zmq.Poller()
        self._by_sock: dict[zmq.Socket[bytes], Feed] = {}
        self._by_monitor: dict[zmq.Socket[bytes], Feed] = {}
        self.dropped = 0  # connections to a publisher that ended (over MAX_MESSAGE_BYTES, ...)
        self._turn = _Turn()  # the pump's
        self._pumping = False  # `kv_events_pump` and `kv_events_flush` registered
        self._started = False
        self._closed = False
        self.batches = 0
        self.malformed = 0

    @property
    def _sync(self) -> zmq.Context[zmq.Socket[bytes]]:
        if self._sync_ctx is None:
            self._sync_ctx = zmq.Context()
        return self._sync_ctx

    @property
    def _ctx(self) -> zmq.asyncio.Context:
        if self._async_ctx is None:
            self._async_ctx = zmq.asyncio.Context.shadow(self._sync.underlying)
        return self._async_ctx

    # --- what routing reads ---------------------------------------------------------------------

    def state(self, backend: str) -> str | None:
        """None: the backend has no events configured."""
        e = self._engines.get(backend)
        if e is None:
            return None
        if not e.feeds:
            return "waiting"  # still asking the engine where it publishes
        states = {f.state for f in e.feeds}
        for s in ("error", "unsure", "replaying", "waiting"):
            if s in states:
                return s
        return "live"

    def live(self, backend: str) -> bool:
        e = self._engines.get(backend)
        return e is not None and bool(e.feeds) and all(f.state == "live" for f in e.feeds)

    def configured(self, backend: str) -> bool:
        return backend in self._engines

    def pending(self, backend: str) -> tuple[int, float]:
        """(uncached tokens of the flights still to prefill on `backend`, seconds since the
        oldest of them was sent)."""
        e = self._engines.get(backend)
        if e is None or not e.pending:
            return 0, 0.0
        now = self._mono()
        horizon = now - self._pending_ttl
        q = e.pending
        while q and (q[0].when < horizon or not q[0].tokens):
            q.popleft()
        if not q:
            return 0, 0.0
        return sum(f.tokens for f in q), now - q[0].when

    def churn(self, backend: str) -> float:
        """Blocks `backend` evicted per second lately (an average over about CHURN_TAU): how
        soon a prompt placed there would be evicted again, once its cache is full."""
        e = self._engines.get(backend)
        if e is None or not e.churn:
            return 0.0
        return e.churn * math.exp((e.churn_at - self._mono()) / CHURN_TAU) / CHURN_TAU

    def flying_blocks(self, backend: str, keys: Sequence[bytes]) -> int:
        """How many of `keys`' leading blocks requests in flight on `backend` carry."""
        e = self._engines.get(backend)
        if e is None or not e.flying or not keys:
            return 0
        return bisect_left(_Keys(keys, e.flying), True)

    def dispatched(
        self, backend: str, uncached_tokens: int, keys: Sequence[bytes] = ()
    ) -> Flight | None:
        """`backend` was sent a prompt: its Flight, to be `prefilled()` and `ended()`."""
        e = self._engines.get(backend)
        if e is None:
            return None
        if len(e.pending) >= PENDING_MAX:
            e.pending.popleft()
        flight = Flight(backend, self._mono(), max(0, uncached_tokens), keys)
        e.pending.append(flight)
        flying = e.flying
        for k in keys:
            flying[k] = flying.get(k, 0) + 1
        return flight

    def ended(self, flight: Flight) -> None:
        """It ended, whichever way: its keys no longer count as held (release, always)."""
        if flight.ended:
            return
        flight.ended = True
        flight.tokens = 0
        e = self._engines.get(flight.backend)
        if e is None:  # the backend was removed
            return
        flying = e.flying
        for k in flight.keys:
            n = flying.get(k, 0)
            if n > 1:
                flying[k] = n - 1
            else:
                flying.pop(k, None)

    def status(self, backend: str) -> dict[str, Any] | None:
        e = self._engines.get(backend)
        if e is None:
            return None
        return {
            "state": self.state(backend),
            "lag_seconds": e.lag,
            "last_event": e.last_event or None,
            "blocks": self.index.blocks(backend),
            "block_size": self.index.block_size(backend),
            "events": dict(e.counts),
            "gaps": e.gaps,
            "restarts": e.restarts,
            # This router's requests there not yet answered, and the blocks of those running.
            "pending_tokens": self.pending(backend)[0],
            "in_flight_blocks": len(e.flying),
            # Where a new prompt would soon be evicted again (a flooded cache): `churn`.
            "evicted_blocks_per_s": round(self.churn(backend), 3),
            "publishers": [
                {
                    "endpoint": f.endpoint,
                    "bind": f.bind,
                    "rank": f.rank,
                    "state": f.state,
                    "seq": f.last_seq,
                    "error": f.error,
                }
                for f in e.feeds
            ],
        }

    def blocks(self) -> dict[str, int]:
        return {n: self.index.blocks(n) for n in self._engines}

    def lags(self) -> dict[str, float]:
        return {n: e.lag for n, e in self._engines.items() if e.lag is not None}

    # --- membership -----------------------------------------------------------------------------

    def sync(self, backends: Iterable[Backend]) -> None:
        """Follow a registry swap: subscribe to new backends, drop removed or changed ones."""
        wanted = {b.name: b for b in backends if b.kv_events is not None}
        for name in list(self._engines):
            b = wanted.get(name)
            if b is None or self._configs.get(name) != (b.url, b.kv_events):
                self._drop(name)
        for name, b in wanted.items():
            self._backends[name] = b
            if name not in self._engines:
                assert b.kv_events is not None
                self._engines[name] = Engine()
                self._configs[name] = (b.url, b.kv_events)
                if self._started:
                    self._open(name)

    def update(self, upserted: Iterable[Backend], removed: Iterable[str]) -> None:
        """`sync` for a change alone (a discovery slice)."""
        for name in removed:
            if name in self._engines:
                self._drop(name)
        for b in upserted:
            if b.name in self._engines and self._configs.get(b.name) != (b.url, b.kv_events):
                self._drop(b.name)
            if b.kv_events is None:
                continue
            self._backends[b.name] = b
            if b.name not in self._engines:
                self._engines[b.name] = Engine()
                self._configs[b.name] = (b.url, b.kv_events)
                if self._started:
                    self._open(b.name)

    def _drop(self, name: str) -> None:
        self.flush()  # what it sent so far still counts
        e = self._engines.pop(name, None)
        self._configs.pop(name, None)
        self._backends.pop(name, None)
        if e is not None:
            for f in e.feeds:
                self._close_feed(f)
        self.index.forget(name)

    async def start(self) -> None:
        self._started = True
        for name in list(self._engines):
            self._open(name)

    def _open(self, name: str) -> None:
        url, cfg = self._configs[name]
        e = self._engines[name]
        if cfg.endpoint is not None:
            addr, bind = resolve(cfg.endpoint, url, cfg.bind)
            replay = resolve(cfg.replay_endpoint, url, False)[0] if cfg.replay_endpoint else None
            self._attach(name, e, Feed(name, addr, bind, cfg.topic.encode(), replay))
        else:
            e.discovering = True
            self._spawn(self._discover(name))

    def _attach(self, name: str, e: Engine, feed: Feed) -> None:
        e.feeds.append(feed)
        b = self._backends.get(name)
        if b is not None and b.source != "file":
            self._spawn(self._vet(name, e, feed, b))
        else:
            self._open_socket(name, e, feed)

    async def _vet(self, name: str, e: Engine, feed: Feed, b: Backend) -> None:
        """A backend added at run time: its feed's endpoints held to the admin rules
        (router/engine/kv_endpoints.py) before a socket opens. Refused, it stays `error`
        until the backend changes; a name that does not resolve yet is tried again."""
        try:
            # A discovery template's own endpoints are the operator's; what the API or an
            # engine names is not.
            if not (self._local_sockets or (b.source != "api" and not feed.learned)):
                reason = local_refusal(feed.endpoint, feed.bind)
                if reason is None and feed.replay is not None:
                    reason = local_refusal(feed.replay, False)
                if reason is not None:
                    raise EndpointRefused(reason)
            policy = self._policy or OPEN
            endpoint = feed.endpoint if feed.bind else await vetted(feed.endpoint, policy)
            replay = None if feed.replay is None else await vetted(feed.replay, policy)
        except EndpointRefused as exc:
            self._failed(name, feed, f"refused: {exc}")
            return
        except (OSError, TimeoutError, UnicodeError) as exc:
            self._failed(name, feed, f"{type(exc).__name__}: {exc}")
            self._retry_later(name, feed)
            return
        if self._closed or self._engines.get(name) is not e or feed not in e.feeds:
            return
        feed.endpoint, feed.replay = endpoint, replay
        self._open_socket(name, e, feed)

    def _failed(self, name: str, feed: Feed, error: str) -> None:
        feed.state, feed.error = "error", error[:200]
        log.warning(
            "kv events: cannot open socket",
            extra={"fields": {"backend": name, "endpoint": feed.endpoint, "error": feed.error}},
        )

    def _open_socket(self, name: str, e: Engine, feed: Feed) -> None:
        refusal = path_refusal(feed.endpoint) if feed.bind else None
        if refusal is not None:  # never another file in its place, whoever asked
            self._failed(name, feed, f"refused: {refusal}")
            self._retry_later(name, feed)
            return
        try:
            sock = self._sync.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, QUEUE_MAX)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.IPV6, "[" in feed.endpoint)  # ZMQ's default: IPv4 only
            sock.setsockopt(zmq.SUBSCRIBE, feed.topic)
            if feed.bind:
                sock.bind(feed.endpoint)
            else:
                sock.connect(feed.endpoint)
        except zmq.ZMQError as exc:
            self._failed(name, feed, f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):
                sock.close(0)
            self._retry_later(name, feed)
            return
        feed.sock = sock
        feed.error = None
        self._poller.register(sock, zmq.POLLIN)
        self._by_sock[sock] = feed
        if not feed.bind:
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            feed.monitor = monitor
            self._poller.register(monitor, zmq.POLLIN)
            self._by_monitor[monitor] = feed
        if not self._pumping:  # only a router with events configured runs the timer
            self._pumping = True
            runner = self._chores()
            runner.every("kv_events_pump", self._pump, PUMP_INTERVAL)
            runner.every("kv_events_flush", self._flush, FLUSH_INTERVAL)
        if feed.replay is not None and feed.last_seq is None:
            # Joining an engine that may have published already (and may stay idle): ask for
            # its history now rather than wait for its next batch to show the hole.
            self._start_replay(feed, 0)

    def _chores(self) -> Runner:
        if self._own_runner is None and self._runner is None:
            self._own_runner = shared_or_own(None)[0]
        runner = self._runner or self._own_runner
        assert runner is not None
        return runner

    def _retry_later(self, name: str, feed: Feed | None) -> None:
        """`feed`'s socket (None: `name`'s discovery) is tried again in RETRY seconds."""
        at = self._mono() + RETRY
        if feed is not None:
            feed.retry_at = at
        else:
            self._engines[name].retry_at = at
        if not self._retrying:
            self._retrying = True
            self._chores().timer("kv_events_retry", self._retry_due, self._retry_wake)
        self._retry_wake.set()

    async def _retry_due(self) -> float | None:
        """The `kv_events_retry` round: what is due is tried again (a discovery question, a
        socket or its vetting); the seconds until the next (None: none owed)."""
        if self._closed:
            return None
        now = self._mono()
        soonest = math.inf
        for name, e in list(self._engines.items()):
            if e.retry_at is not None:
                if e.retry_at <= now:
                    e.retry_at = None
                    self._spawn(self._discover(name))
                else:
                    soonest = min(soonest, e.retry_at)
            for feed in list(e.feeds):
                at = feed.retry_at
                if at is None:
                    continue
                if at > now:
                    soonest = min(soonest, at)
                    continue
                feed.retry_at = None
                e.feeds.remove(feed)
                feed.state = "waiting"
                self._attach(name, e, feed)
        return None if soonest == math.inf else soonest - now

    async def _discover(self, name: str) -> None:
        """Ask the engine where it publishes; without an answer (it may still be starting),
        again in RETRY seconds."""
        b = self._backends.get(name)
        if self._closed or name not in self._engines or b is None:
            return
        try:
            async with asyncio.timeout(DISCOVER_TIMEOUT):
                sources = await self._ask_sources(b)
        except (TimeoutError, httpx.HTTPError, ValueError):
            sources = None
        feeds = _feeds_from(name, b, sources) if isinstance(sources, dict) else []
        e = self._engines.get(name)
        if self._closed or e is None:
            return
        if feeds and self._backends.get(name) is b:
            e.discovering = False
            for f in feeds:
                self._attach(name, e, f)
            return
        self._retry_later(name, None)

    async def _ask_sources(self, b: Backend) -> Any:
        """`GET /kv_event_sources` through a transport made as traffic's (its TLS policy and
        the network policy), read up to `MAX_SOURCES_BODY`; None unless a 200."""
        status, body = await ask(b, b.url + "/kv_event_sources", MAX_SOURCES_BODY, self._policy)
        return json.loads(body) if status == 200 else None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def reset(self, backend: str) -> None:
        """The engine may have restarted (it stopped answering): forget what it held and wait
        for the truth again, asking its replay buffer (a live engine's history rebuilds the
        index at once; a restarted one's is empty) or its next batch (seq 0 after a restart)."""
        e = self._engines.get(backend)
        if e is None:
            return
        self.index.cleared(backend)
        e.pending.clear()
        for f in e.feeds:
            f.last_seq = None
            f.take_held()
            if f.sock is None:
                continue
            if f.replay is not None:
                if f.state != "replaying":
                    self._start_replay(f, 0)
            else:
                f.state = "waiting"

    # --- receiving ------------------------------------------------------------------------------

    async def _pump(self) -> None:
        """The `kv_events_pump` round, every PUMP_INTERVAL: one poll over every SUB socket, then
        each ready one drained.

        A timer, not a reader per descriptor: at a busy fleet's rates (thousands of batches a
        second) a wake-up per batch, with its epoll round and callback, cost as much as
        decoding it; here a wake-up reads everything that arrived in the interval (the lag
        it adds is at most PUMP_INTERVAL), and an idle fleet costs one poll per interval."""
        feeds = self._by_sock
        if self._closed or not feeds:
            return
        try:
            ready = self._poller.poll(0)
        except zmq.ZMQError:
            return
        turn = self._turn
        turn.start()
        for sock, _ in ready:
            if sock in self._by_monitor:
                self._reconnect(self._by_monitor[sock])
                continue
            quota = DRAIN_MAX  # the rest at the next round: others get their turn
            while quota > 0 and (feed := feeds.get(sock)) is not None:
                quota = self._drain(feed, turn, quota)
                if turn.over:  # the loop's other tasks first, then the same socket on
                    await asyncio.sleep(0)
                    if self._closed:
                        return
                    turn.start()

    async def _flush(self) -> None:
        """The `kv_events_flush` round, every FLUSH_INTERVAL."""
        self.flush()

    def _drain(self, feed: Feed, turn: _Turn, quota: int) -> int:
        """Up to `quota` of `feed`'s messages, until none is queued or `turn` is over: what is
        left of the quota when the turn ran out first, else 0."""
        sock = feed.sock
        if sock is None or sock.closed:
            return 0
        recv = sock.recv
        message = self._message
        try:
            while quota > 0:
                frames = _frames(recv)
                quota -= 1
                message(feed, frames)
                if turn.spend(len(frames[-1])):
                    return quota
        except zmq.Again:
            pass
        except zmq.ZMQError:
            pass
        return 0

    def _reconnect(self, feed: Feed) -> None:
        """The connection to `feed`'s publisher ended. ZMQ connects again by itself after a
        network error, never after a protocol error, which a frame over MAX_MESSAGE_BYTES is:
        connect anew either way (what was lost meanwhile is a gap, as ever)."""
        monitor, sock = feed.monitor, feed.sock
        if monitor is None or sock is None or sock.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            while True:
                monitor.recv_multipart(zmq.NOBLOCK)  # only disconnections are watched
        self.dropped += 1
        if self.dropped <= 3 or self.dropped % 1000 == 0:
            log.warning(
                "kv events: publisher connection ended; connecting again",
                extra={"fields": {"backend": feed.backend, "endpoint": feed.endpoint}},
            )
        with contextlib.suppress(zmq.ZMQError):
            sock.disconnect(feed.endpoint)
        with contextlib.suppress(zmq.ZMQError):
            sock.connect(feed.endpoint)

    def _message(self, feed: Feed, frames: list[bytes]) -> None:
        try:
            batch = decode(frames)
        except WireError as exc:
            self.malformed += 1
            if self.malformed <= 3 or self.malformed % 1000 == 0:
                log.warning(
                    "kv events: undecodable message",
                    extra={"fields": {"backend": feed.backend, "error": str(exc)}},
                )
            return
        self.batches += 1
        if feed.state == "replaying" or feed.catching_up:
            feed.hold(batch)
            return
        self._in_order(feed, batch)

    def _in_order(self, feed: Feed, batch: Batch) -> None:
        e = self._engines.get(feed.backend)
        if e is None:
            return
        last = feed.last_seq
        seq = batch.seq
        if last is not None and seq <= last:
            if seq != 0 and batch.ts <= feed.last_ts:
                return  # already applied (a replay overlap: the same batch again)
            # The engine restarted: whatever it held is gone (for every rank: one index). A
            # batch numbered at or below the last one yet built after it is a new publisher
            # whose first batches (seq 0 among them) went out before this socket reconnected.
            e.restarts += 1
            self.index.cleared(feed.backend)
            last = feed.last_seq = None
        if last is None and seq == 0:
            feed.state = "live"
        elif last is None or seq > last + 1:
            start = 0 if last is None else last + 1
            e.gaps += 1 if last is not None else 0
            if feed.replay is not None:
                self._start_replay(feed, start)
                feed.hold(batch)
                return
            self._unsure(feed)
        self._apply(feed, e, batch)

    def _unsure(self, feed: Feed) -> None:
        feed.state = "unsure"
        feed.stored_since_gap = 0

    def _apply(self, feed: Feed, e: Engine, batch: Batch, replayed: bool = False) -> None:
        feed.last_seq = batch.seq
        feed.last_ts = batch.ts
        name = feed.backend
        now = self._wall()
        if not replayed:  # a replayed batch's age is history, not lag
            e.lag = max(0.0, now - batch.ts)
            e.last_event = now
        e.pending.clear()  # what was sent before it is in it, or will not store a block
        cap = self._capacity(name) or DEFAULT_BLOCKS
        stored, removed, cleared, blocks, whole = self.index.apply(name, batch.events, cap)
        if not whole:  # past MAX_BATCH_BLOCKS: the rest of the batch was not applied
            self._unsure(feed)
        elif cleared and feed.state == "unsure":
            feed.state = "live"  # nothing held: the index is exact again
        if feed.state == "unsure":
            feed.stored_since_gap += blocks
            if feed.stored_since_gap >= cap:
                feed.state = "live"
        counts = e.counts
        if stored:
            counts["BlockStored"] = counts.get("BlockStored", 0) + stored
        if removed:
            counts["BlockRemoved"] = counts.get("BlockRemoved", 0) + removed
            at = self._mono()
            e.churn = e.churn * math.exp((e.churn_at - at) / CHURN_TAU) + removed
            e.churn_at = at
        if cleared:
            counts["AllBlocksCleared"] = counts.get("AllBlocksCleared", 0) + cleared
        if batch.unknown:
            counts["unknown"] = counts.get("unknown", 0) + batch.unknown

    def flush(self) -> None:
        """Hand the counts received since the last flush to `on_events` (the Prometheus
        counters): every FLUSH_INTERVAL (`kv_events_flush`), and at each scrape. Per batch, the
        counters' two increments cost a tenth of the ingestion (bench/scenarios/kv.py)."""
        on = self._on_events
        if on is None:
            return
        for name, e in self._engines.items():
            if e.counts == e.reported:
                continue
            for kind, n in e.counts.items():
                delta = n - e.reported.get(kind, 0)
                if delta > 0:
                    on(name, kind, delta)
            e.reported = dict(e.counts)

    def _start_replay(self, feed: Feed, start: int) -> None:
        """Ask for the batches from `start` on; new ones are held meanwhile."""
        feed.state = "replaying"
        feed.replays += 1
        self._spawn(self._replay(feed, start, feed.replays))

    async def _replay(self, feed: Feed, start: int, mine: int) -> None:
        """Ask the engine's replay socket for batches from `start`, then apply them and what
        was held, a turn's budget at a time (`catching_up`: what arrives meanwhile is held
        too, and applied after them)."""
        got, ok = await self._ask_replay(feed, start)
        e = self._engines.get(feed.backend)
        if e is None or feed.state != "replaying" or feed.replays != mine:
            return
        feed.catching_up = True
        try:
            await self._catch_up(feed, e, start, got, ok, mine)
        finally:
            if feed.replays == mine:
                feed.catching_up = False

    async def _catch_up(
        self, feed: Feed, e: Engine, start: int, got: list[Batch], ok: bool, mine: int
    ) -> None:
        held = feed.take_held()
        merged: dict[int, Batch] = {b.seq: b for b in got}
        for b in held:
            merged.setdefault(b.seq, b)
        batches = [merged[k] for k in sorted(merged) if feed.last_seq is None or k > feed.last_seq]
        # Exact again when the replay answered and nothing is missing from `start` on.
        whole = ok and all(b.seq == start + i for i, b in enumerate(batches))
        if whole:
            feed.state = "live"
        else:
            self._unsure(feed)
        replayed = {id(b) for b in got}
        turn = _Turn()
        for batch in batches:
            self._apply(feed, e, batch, replayed=id(batch) in replayed)
            if turn.spend(batch.size) and not await self._next_turn(feed, e, mine, turn):
                return
        # What arrived meanwhile, after them and in order.
        while feed.held:
            todo = feed.take_held()
            for i, batch in enumerate(todo):
                self._in_order(feed, batch)
                if feed.replays != mine:  # a gap in them began the next replay: theirs
                    for later in todo[i + 1 :]:
                        feed.hold(later)
                    return
                if turn.spend(batch.size) and not await self._next_turn(feed, e, mine, turn):
                    return

    async def _next_turn(self, feed: Feed, e: Engine, mine: int, turn: _Turn) -> bool:
        """The event loop's other tasks first; False when this replay no longer applies (the
        feed was dropped or reset, or another replay began)."""
        await asyncio.sleep(0)
        turn.start()
        return (
            not self._closed
            and feed.replays == mine
            and self._engines.get(feed.backend) is e
            and feed in e.feeds
        )

    async def _ask_replay(self, feed: Feed, start: int) -> tuple[list[Batch], bool]:
        """The replay socket's batches from `start`, and whether it said it sent them all
        (within REPLAY_TIMEOUT and REPLAY_MAX_BYTES)."""
        assert feed.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, QUEUE_MAX)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.IPV6, "[" in feed.replay)
        got: list[Batch] = []
        budget = REPLAY_MAX_BYTES
        turn = _Turn()
        try:
            sock.connect(feed.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(REPLAY_TIMEOUT):
                while True:
                    frames = await sock.recv_multipart()
                    # [b"", topic, seq, payload]; the end: [b"", b"", seq -1, b""]
                    frames = frames[1:] if frames and frames[0] == b"" else frames
                    if len(frames) == 3 and int.from_bytes(frames[1], "big", signed=True) < 0:
                        return got, True
                    size = sum(map(len, frames))
                    budget -= size + HOLD_OVERHEAD
                    if budget < 0:
                        log.warning(
                            "kv events: replay answer too large",
                            extra={"fields": {"backend": feed.backend, "bytes": REPLAY_MAX_BYTES}},
                        )
                        return got, False
                    with contextlib.suppress(WireError):
                        got.append(decode(frames))
                    if turn.spend(size):  # a ready message is awaited without yielding
                        await asyncio.sleep(0)
                        turn.start()
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning(
                "kv events: replay failed",
                extra={"fields": {"backend": feed.backend, "error": type(exc).__name__}},
            )
        finally:
            sock.close(0)
        return got, False

    # --- shutdown -------------------------------------------------------------------------------

    def _close_feed(self, feed: Feed) -> None:
        sock, monitor = feed.sock, feed.monitor
        feed.sock = feed.monitor = None
        if monitor is not None:
            if self._by_monitor.pop(monitor, None) is not None:
                with contextlib.suppress(KeyError, zmq.ZMQError):
                    self._poller.unregister(monitor)
            if sock is not None and not sock.closed:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
            monitor.close(0)
        if sock is not None:
            if self._by_sock.pop(sock, None) is not None:
                with contextlib.suppress(KeyError, zmq.ZMQError):
                    self._poller.unregister(sock)
            if not sock.closed:
                sock.close(0)

    async def aclose(self) -> None:
        self._closed = True
        runner, self._own_runner = self._own_runner, None
        if runner is not None:  # the app's stops before its parts close
            await runner.stop()
        self.flush()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        for e in self._engines.values():
            for f in e.feeds:
                self._close_feed(f)
        if self._sync_ctx is not None:
            self._sync_ctx.term()


def _feeds_from(name: str, backend: Backend, sources: dict[str, Any]) -> list[Feed]:
    """Feeds from `/kv_event_sources`: `{rank: {endpoint, replay_endpoint, topic, ...}}`."""
    feeds = []
    for rank, src in sorted(sources.items()):
        if not isinstance(src, dict) or not src.get("enable_kv_cache_events"):
            continue
        endpoint = src.get("endpoint")
        if src.get("publisher") != "zmq" or not isinstance(endpoint, str):
            continue
        if not endpoint.startswith(("tcp://", "ipc://")):
            continue  # inproc: only inside the engine's own process
        # The backend's own `bind` wins, as for a configured endpoint.
        addr, bind = resolve(
            endpoint, backend.url, backend.kv_events.bind if backend.kv_events else None
        )
        replay = src.get("replay_endpoint")
        replay_addr = (
            resolve(replay, backend.url, False)[0] if isinstance(replay, str) and replay else None
        )
        topic = src.get("topic") or ""
        try:
            r = int(rank)
        except ValueError:
            r = 0
        feeds.append(Feed(name, addr, bind, str(topic).encode(), replay_addr, r, learned=True))
    return feeds
