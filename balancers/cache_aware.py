"""Send a prompt to the engine that probably still caches its prefix, unless that engine queues.

cost(c) = (queue(c) + uncached(c) x (1 + batch(c))) / weight      (lowest wins; ties: least_load)

in prefills of this prompt, i.e. in time, ours and that of the requests we would delay:
- uncached(c): the share of the prompt c would prefill, 1 minus the leading blocks the prefix
  index says c was last sent (`Hints.held` of `Hints.blocks`);
- batch(c): the requests running there (engine reading, plus those we sent since it, less
  ours that ended since: those come off its queue first, `least_load.now_on`): a prefill
  delays each of them as much as ours (vLLM computes it inside the batch's steps, chunked or
  not), so a full prefill on a busy engine costs 1 + batch, a cached prompt nearly nothing;
- queue(c): requests waiting there (each about one prefill ahead of ours: ours is the best
  guess of a neighbour's length), plus 1 when our prompt would not fit in the KV it has free
  (kv_usage x `kv_capacity_tokens`, less one prompt per request we sent since the reading):
  admission then waits for a running request to end (without a reported capacity: kv_usage
  >= KV_NEAR_FULL). A queue costs our time only, not the batch's.
Why not `least_load`'s score minus cached tokens / TOKENS_PER_LOAD, as before: its units do not
map onto time. Continuous batching absorbs a running request (a fraction of a millisecond per
step, against tens of milliseconds per 1k prefilled tokens), KV use costs nothing until
admission runs out of blocks (vLLM counts running requests' blocks; cached free ones are
evictable), a queued request costs a whole prefill. One fixed rate misprices some term: at 250
tokens per unit, 3-5 running requests plus half-full KV (16 x kv_usage) outweighed a
2-5k-token cached prompt (`docs/benchmarks.md`). Here running requests and KV enter only as
what they cost in time; least_load's score only breaks ties (with no holder among the
candidates the pick is `least_load`'s; with KV events, among the engines with cache room, below).
Guardrail (bounded loads, Mirrokni et al.): a holder is passed over when its requests in flight
through sluicegate (`Candidate.inflight` per weight: exact, and shared across replicas through
Redis) plus this one exceed ceil(load_factor x (total + 1) / n) over the n candidates, are
SPILL_MIN_GAP above the least loaded (a lease not released yet must not break affinity at low
load), AND its engine is saturated (queue(c) > 0: continuous batching no longer absorbs one more
request); without a reading the count bound alone decides. A hot prefix spills as soon as its
holder starts queuing; ordinary fluctuation inside a batch does not (at 3-5 requests per engine
the count bound alone sent 7-11 % of requests to a full prefill). If every holder is passed
over, the least loaded candidate (`least_load`'s pick) takes it and joins the holders (the proxy
records it). Candidates without an engine reading (`kind: openai`, not scraped) have no queue
or batch to read: then cost = in-flight per weight - cached tokens / TOKENS_PER_LOAD (an
in-flight request may be running or queued; 4 of them ~ one 1k-token prefill), count bound only.
Session affinity comes first when the request names a session (`Hints.session`: the ring point
of its key): consistent hashing with bounded loads over the candidates (balancers/session_ring.py),
the key's home unless it is over the count bound (`affinity.load_factor`), else the next backend
clockwise under it (a backend whose engine reading is stale is left off the ring until it is read
again).
Reasons: `session` (the key's home), `prefix` (the pick holds part of the prompt), `spill` (a
holder or the key's home was passed over for the bound), `load` (no candidate holds any of the
prompt, or the holder's queue outweighed the prefill saved).
With KV events (`Hints.kv`: the prompt's token ids matched against what each engine's own events
say it holds, router/engine/kv_index.py) the cost is the request's expected time to first token,
in seconds, from rates each engine's histograms teach (router/engine/calibrate.py):
  cost(c) = (ahead(c) x prompt x p(c) + uncached(c) x p(c) + before(c)
             + (running(c) + sent(c)) x q(c)) / weight
- p(c): prefill seconds per uncached token (vLLM's request_prefill_time_seconds over the prompt
  tokens it computed), DEFAULT_PREFILL_S_PER_TOKEN until learned; q(c): decode-step seconds per
  running sequence (inter_token_latency_seconds over num_requests_running), DEFAULT_STEP_S_PER_SEQ
  until learned. Their ratio is the exchange rate between a cached token and a running request:
  on a CPU engine, where prefill is cheap and decode contention dominates, a holder with a few
  more running requests loses to an idle engine; on a GPU serving a 70B model it is the reverse;
- uncached(c): prompt tokens c would compute: all but what its events say it holds, or what
  requests in flight there carry (exact), when its events are live, else what the approximate
  index guesses (`Hints.held` blocks);
- before(c): the prefills of requests sent to c since its last event and not yet answered
  (`pending(c)` uncached tokens, router/engine/kv_events.py `Flight`) x p(c), less the
  seconds since the oldest of them was sent (the engine has been at them since), so a burst
  does not pile onto one holder, and a second request of a prompt still prefilling joins it
  (the prompt counts as held there: it waits for the rest of that prefill only, not a prefill
  of its own elsewhere);
- ahead(c), sent(c), running(c) and the guardrail as above.
Reasons then: `prefix_exact` (the pick holds part of the prompt, per its live events),
`prefix_approx` (per the approximate index: its events are not live), `spill`, `load`.
A new home (no candidate holds any of the prompt) with every candidate's events live: least_load's
pick among the engines whose free cache takes at least half as many prompts of this length,
without evicting, as the roomiest one's (KV capacity less the tokens their events say they
hold, `KvHints.stored`, less those pending), those queuing left out; when every cache would
evict (a warm fleet: caches fill and stay full), least_load's pick among the engines evicting
least (`KvHints.churn`, blocks per second lately: at most twice the lowest, plus CHURN_NOISE),
where a prompt stays longest and what it evicts is the stalest (with no eviction rate known,
among all). Why: a
restarted engine's customers are held nowhere once its index is dropped, and placed by load
alone they landed on engines with full caches, each evicting another customer's prompt (a miss
more, and another re-home), while the emptied engine, which the approximate index keeps sending
them to, stayed half empty; hidden clients filling caches likewise (any room at all, not half
the most, cut `--only kv` hidden's hit rate from 0.90 to 0.88 and tripled its TTFT p90). Why
not only the roomiest: that overrides load on every other new prompt (one more pending prompt
is less room, 7 against 6), and on 2 real engines put misses, the slowest requests, behind busy
batches (TTFT p99 1.3x the approximate index's, where load placed them).
A request for a LoRA adapter (`Hints.adapter`, or `for_adapter()` without hints; balancers/lora.py)
is weighed only among engines serving it (or, with load on demand and none serving it, among
engines running LoRA), and its tier there adds lora.AHEAD[tier] requests to `ahead(c)`: running
it 0, a free slot 0.25, waiting for a slot 1, to be loaded first 4 (+0.25 per adapter running);
without engine readings, QUEUE_WEIGHT x that to the in-flight cost. Prefix blocks are keyed by
adapter (router/request/prefix.py), so an adapter's prefix never counts as the base model's.
It only ever sees eligible candidates (health, ejection, draining, `max_inflight` and the retry's
`exclude` are applied before), so affinity never overrides them. Pure: the match arrives as data
through `with_hints()`, which returns this request's picker; plain `pick()` is `least_load`'s.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import ClassVar

from balancers.base import Balancer, Candidate, Choice
from balancers.least_inflight import weighted_choice
from balancers.least_load import QUEUE_WEIGHT, LeastLoad, now_on
from balancers.lora import AdapterWant, ahead, eligible
from balancers.session_ring import Ring
from router.core.engine import EngineReading

CHARS_PER_TOKEN = 4
TOKENS_PER_LOAD = 250.0  # only when a candidate has no engine reading
SPILL_MIN_GAP = 2.0
KV_NEAR_FULL = 0.9  # only when the engine does not report its KV capacity
CHURN_NOISE = 1.0  # blocks evicted per second: engines within this of twice the least tie
# Until an engine's histograms have taught its own: a small model on one GPU, or the mock.
DEFAULT_PREFILL_S_PER_TOKEN = 20e-6  # 20 ms per 1k tokens
DEFAULT_STEP_S_PER_SEQ = 0.5e-3  # each running sequence adds 0.5 ms to a decode step


@dataclass(frozen=True, slots=True)
class KvHints:
    """The prompt in tokens, and what each candidate holds of it."""

    tokens: int  # the prompt's token count
    cached: Mapping[str, int]  # backend -> leading prompt tokens it holds
    exact: frozenset[str]  # backends whose `cached` comes from live KV events
    pending: Mapping[str, int] = field(default_factory=dict)  # uncached, sent, not answered
    # backend -> tokens its KV cache holds, per its live events (all it holds, any prompt's)
    stored: Mapping[str, int] = field(default_factory=dict)
    # backend -> seconds since the oldest of its pending requests was sent
    pending_age: Mapping[str, float] = field(default_factory=dict)
    # backend -> blocks its cache evicted per second lately, per its live events
    churn: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Hints:
    """What one request brings to the choice, computed outside the balancer."""

    blocks: int  # blocks in the request's prefix chain
    block_chars: int
    held: Mapping[str, int]  # backend -> how many leading blocks the index says it holds
    session: int | None = None  # the session key's point on the ring (None: no session)
    kv: KvHints | None = None  # token-level holdings, when the model's backends publish events
    adapter: AdapterWant | None = None  # the LoRA adapter the request names


class CacheAware:
    name: ClassVar[str] = "cache_aware"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = True

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._load = LeastLoad(self._rng)
        self._rings: dict[frozenset[str], Ring] = {}  # candidate set -> its ring

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Choice | None:
        return self._load.pick(candidates, exclude)

    def for_adapter(self, want: AdapterWant) -> Balancer:
        return self._load.for_adapter(want)

    def with_hints(self, hints: Hints, load_factor: float) -> HintedPick:
        return HintedPick(self, hints, load_factor)

    def ring(self, names: frozenset[str]) -> Ring:
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) >= 16:  # health and capacity reshape the set; keep recent ones
                self._rings.clear()
            ring = self._rings[names] = Ring(names)
        return ring


class HintedPick:
    """One request's `cache_aware` picker: its choice says why (reason, blocks or tokens held)."""

    name: ClassVar[str] = "cache_aware"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = True

    def __init__(self, owner: CacheAware, hints: Hints, load_factor: float) -> None:
        self._owner = owner
        self._load = owner._load
        self._hints = hints
        self._factor = load_factor
        want = hints.adapter
        self.adapter_aware = want is not None
        self._adapter_load = self._load.for_adapter(want) if want is not None else None

    def _least(self, pool: Sequence[Candidate], reason: str = "load") -> Choice | None:
        """least_load's pick, for `reason` (its adapter form for an adapter request: the
        adapter tier's reason)."""
        if self._adapter_load is not None:
            return self._adapter_load.pick(pool)
        choice = self._load.pick(pool)
        return choice if choice is None or reason == "load" else Choice(choice.candidate, reason)

    def _spill(self, pool: Sequence[Candidate]) -> Choice | None:
        """Every holder is over the bound: the least loaded takes it."""
        choice = self._least(pool)
        return None if choice is None else Choice(choice.candidate, "spill")

    def _ahead(self, c: Candidate) -> float:
        want = self._hints.adapter
        return ahead(c, want) if want is not None else 0.0

    def pick(
        self, candidates: Sequence[Candidate], exclude: Set[str] = frozenset()
    ) -> Choice | None:
        pool = [c for c in candidates if c.name not in exclude] if exclude else candidates
        hints = self._hints
        held = hints.held
        if hints.adapter is not None:
            pool = eligible(pool, hints.adapter)
        if not pool:
            return None
        kv = hints.kv
        if kv is not None and hints.session is None:
            if not any(kv.cached.get(c.name) for c in pool):
                return self._least(self._with_room(kv, pool))
        elif hints.session is None and not any(c.name in held for c in pool):
            return self._least(pool)
        score = self._load.score
        live = [
            (s + QUEUE_WEIGHT * self._ahead(c) / c.weight, c)
            for c in pool
            if (s := score(c)) != math.inf
        ]
        if not live:  # only stale readings: nothing to weigh the cache against
            return self._least(pool)
        requests = {c.name: c.inflight / c.weight for _, c in live}
        cap = math.ceil(self._factor * (sum(requests.values()) + 1) / len(live))
        floor = min(requests.values()) + SPILL_MIN_GAP

        def over(c: Candidate) -> bool:
            r = requests[c.name]
            return r + 1 / c.weight > cap and r >= floor

        if hints.session is not None:
            by_name = {c.name: c for _, c in live}
            ring = self._owner.ring(frozenset(by_name))
            for i, name in enumerate(ring.walk(hints.session)):
                c = by_name[name]
                if not over(c):
                    return Choice(c, "session" if i == 0 else "spill", held.get(name, 0))
            return self._least(pool, "spill")

        if kv is not None:
            return self._by_cost(kv, live, pool, over)
        if all(c.engine is not None for _, c in live):
            return self._by_time(live, pool, over)
        per_token = hints.block_chars / CHARS_PER_TOKEN / TOKENS_PER_LOAD
        options: list[tuple[float, Candidate]] = []
        passed_over = False
        for s, c in live:
            blocks = held.get(c.name, 0)
            if blocks and over(c):
                passed_over = True
                continue
            options.append((s - blocks * per_token, c))
        if not options:  # every holder is over the bound: the least loaded takes it
            return self._spill([c for _, c in live if c.name not in held] or pool)
        best = min(cost for cost, _ in options)
        tied = [c for cost, c in options if cost == best]
        return self._settle(tied, passed_over)

    def _by_time(
        self,
        live: Sequence[tuple[float, Candidate]],
        pool: Sequence[Candidate],
        over: Callable[[Candidate], bool],
    ) -> Choice | None:
        """Every live candidate has a fresh reading: the cost in prefills of this prompt."""
        hints = self._hints
        held = hints.held
        prompt = max(1.0, hints.blocks * hints.block_chars / CHARS_PER_TOKEN)
        options: list[tuple[float, float, Candidate]] = []
        passed_over = False
        for s, c in live:
            r = c.engine
            assert r is not None
            ahead, batch = self._ahead_and_batch(c, r, prompt)
            blocks = held.get(c.name, 0)
            if blocks and ahead and over(c):
                passed_over = True
                continue
            uncached = 1.0 - min(1.0, blocks / max(1, hints.blocks))
            options.append(((ahead + uncached * (1.0 + batch)) / c.weight, s, c))
        if not options:  # every holder is over the bound: the least loaded takes it
            return self._spill([c for _, c in live if c.name not in held] or pool)
        best = min(options, key=lambda o: o[:2])[:2]
        return self._settle([c for cost, s, c in options if (cost, s) == best], passed_over)

    def _with_room(self, kv: KvHints, pool: Sequence[Candidate]) -> Sequence[Candidate]:
        """A new home: the engines whose free cache takes at least half as many prompts like
        this one, without evicting, as the roomiest, among those not queuing (module
        docstring)."""
        stored = kv.stored
        if not stored:
            return pool
        prompt = max(1, kv.tokens)
        pending = kv.pending
        room: list[tuple[int, Candidate]] = []
        full: list[Candidate] = []
        for c in pool:
            r = c.engine
            held = stored.get(c.name)
            if r is None or held is None or not r.kv_capacity_tokens or r.stale:
                return pool  # its room is not known: nothing to weigh
            if self._ahead_and_batch(c, r, prompt)[0]:
                continue
            fits = (r.kv_capacity_tokens - held - pending.get(c.name, 0)) // prompt
            if fits > 0:
                room.append((fits, c))
            else:
                full.append(c)
        if room:
            ample = (max(f for f, _ in room) + 1) // 2
            return [c for f, c in room if f >= ample]
        if not full or not kv.churn:
            return pool
        # Every cache would evict: where it evicts least, the prompt stays longest.
        churn = kv.churn
        slow = min(churn.get(c.name, 0.0) for c in full) * 2 + CHURN_NOISE
        return [c for c in full if churn.get(c.name, 0.0) <= slow]

    def _ahead_and_batch(
        self, c: Candidate, r: EngineReading, prompt: float
    ) -> tuple[float, float]:
        """Requests ahead of this one on the engine (its queue, an adapter's tier, and one
        more when the prompt would not fit in the KV cache left) and its running batch: the
        reading moved by the router's own requests since it (`least_load.now_on`)."""
        sent = self._load.since(c)
        running, waiting = now_on(r, sent)
        ahead = waiting + self._ahead(c)
        cap = r.kv_capacity_tokens
        if cap:
            free = min(cap, (1.0 - r.kv_usage) * cap - sent * prompt)
            return ahead + (1.0 if free < prompt else 0.0), running
        return ahead + (1.0 if r.kv_usage >= KV_NEAR_FULL else 0.0), running

    def _by_cost(
        self,
        kv: KvHints,
        live: Sequence[tuple[float, Candidate]],
        pool: Sequence[Candidate],
        over: Callable[[Candidate], bool],
    ) -> Choice | None:
        """The expected time to first token on each candidate (module docstring)."""
        prompt = max(1, kv.tokens)
        options: list[tuple[float, float, Candidate]] = []
        passed_over = False
        for s, c in live:
            cached = min(prompt, kv.cached.get(c.name, 0))
            r = c.engine
            if r is None:  # not scraped: in-flight requests stand for the batch
                p, q = DEFAULT_PREFILL_S_PER_TOKEN, DEFAULT_STEP_S_PER_SEQ
                ahead, batch = self._ahead(c), float(c.inflight)
            else:
                p = r.prefill_s_per_token or DEFAULT_PREFILL_S_PER_TOKEN
                q = r.step_s_per_seq or DEFAULT_STEP_S_PER_SEQ
                ahead, batch = self._ahead_and_batch(c, r, prompt)
            if cached and (ahead or r is None) and over(c):
                passed_over = True
                continue
            # The prefills sent ahead of ours, less what the engine has had time to do of them.
            before = max(0.0, kv.pending.get(c.name, 0) * p - kv.pending_age.get(c.name, 0.0))
            cost = (ahead * prompt * p + (prompt - cached) * p + before + batch * q) / c.weight
            options.append((cost, s, c))
        if not options:
            return self._spill([c for _, c in live if not kv.cached.get(c.name)] or pool)
        best = min(options, key=lambda o: o[:2])[:2]
        tied = [c for cost, s, c in options if (cost, s) == best]
        chosen = tied[0] if len(tied) == 1 else weighted_choice(tied, self._owner._rng.random())
        cached = min(prompt, kv.cached.get(chosen.name, 0))
        if cached:
            reason = "prefix_exact" if chosen.name in kv.exact else "prefix_approx"
        else:
            reason = "spill" if passed_over else "load"
        return Choice(chosen, reason, self._hints.held.get(chosen.name, 0), cached)

    def _settle(self, tied: Sequence[Candidate], passed_over: bool) -> Choice:
        chosen = tied[0] if len(tied) == 1 else weighted_choice(tied, self._owner._rng.random())
        held = self._hints.held.get(chosen.name, 0)
        return Choice(chosen, "prefix" if held else ("spill" if passed_over else "load"), held)
