"""Send a prompt to the engine that probably still caches its prefix, unless that engine queues.

With the prompt's hints (`PickContext.hints`: the blocks the prefix index says each candidate
holds, the prompt's home (balancers/prefix_homes.py), the session's ring point, and with KV
events the tokens each engine's own events say it holds), each candidate's cost is the time
this prompt would take there, its own prefill and the work queued ahead of it, in prefills
(`_by_time`; with KV events their exact holdings, wherever the home decides: nothing cached,
or the home keeps most of it) or, with KV events where another engine caches it, in seconds
from the engines' own rates (`_by_cost`), plus the prefill a copy off the prompt's holder or
home displaces (`_displaced`: the copy evicts as much there, prefilled again later); lowest
wins, the home at equal cost when nobody holds the prompt, else `least_load`'s score breaks
ties. A prompt held
nowhere goes to its home (`home`) unless the home's queue costs more than that. With engine
readings a prompt with an established home leaves it only for an engine that can start it now
(nothing waiting, KV free for it) or holds as much of it: a copy behind a queue trades one queue
for another and evicts another prefix there. Without engine
readings a holder over the bounded-load guardrail (ceil(load_factor x (total + 1) / n)
requests, SPILL_MIN_GAP above the least loaded) is passed over (`spill`). An established home
counts as holding its homed blocks where the approximate index guesses less (`_homed`); a new
group cached nowhere is priced in prefills even with events, and a copy off its proposed home
pays the displaced prefill even into room: its home is the partition's choice, under KV
pressure too (docs/balancers.md, "What the index forgets"). A session key goes to
its home on a consistent-hash ring with bounded loads first. A new prompt with no home known
and live events goes where the cache has room (`_with_room`). A LoRA request weighs only the
engines that may run its adapter, each with the adapter's tier (balancers/lora.py). Without
hints the pick is `least_load`'s. Reasons: `session`, `prefix`, `prefix_exact`,
`prefix_approx`, `home` (what the pick held or was), `spill` (the prompt had a holder or an
established home and was moved off it, for the count bound or its queue's cost), `load` (a
prompt nobody holds and with no home yet, placed by load). The whole rule, its terms and the
measurements behind each choice: docs/balancers.md#cache_aware. Pure: the match arrives as
data in the context.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

from balancers.base import Candidate, Choice
from balancers.context import NO_CONTEXT, Hints, KvHints, PickContext
from balancers.least_inflight import weighted_choice
from balancers.least_load import QUEUE_WEIGHT, LeastLoad, now_on
from balancers.lora import ahead, eligible
from balancers.prefix_homes import GROUP_SHARE
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


class CacheAware:
    name: ClassVar[str] = "cache_aware"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = True
    needs_hints: ClassVar[bool] = True
    needs_tokens: ClassVar[bool] = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._load = LeastLoad(self._rng)
        self._rings: dict[frozenset[str], Ring] = {}  # candidate set -> its ring

    def ring(self, names: frozenset[str]) -> Ring:
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) >= 16:  # health and capacity reshape the set; keep recent ones
                self._rings.clear()
            ring = self._rings[names] = Ring(names)
        return ring

    def _least(
        self, ctx: PickContext, pool: Sequence[Candidate], reason: str = "load"
    ) -> Choice | None:
        """least_load's pick, for `reason` (its adapter form for an adapter request: the
        adapter tier's reason)."""
        if ctx.adapter is not None:
            return self._load.for_adapter(pool, ctx.adapter)
        choice = self._load.among(pool)
        return choice if choice is None or reason == "load" else Choice(choice.candidate, reason)

    def _spill(self, ctx: PickContext, pool: Sequence[Candidate]) -> Choice | None:
        """Every holder is over the bound: the least loaded takes it."""
        choice = self._least(ctx, pool)
        return None if choice is None else Choice(choice.candidate, "spill")

    @staticmethod
    def _ahead(ctx: PickContext, c: Candidate) -> float:
        want = ctx.adapter
        return ahead(c, want) if want is not None else 0.0

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext = NO_CONTEXT) -> Choice | None:
        hints = ctx.hints
        if hints is None:
            return self._load.pick(candidates, ctx)
        exclude = ctx.exclude
        pool = [c for c in candidates if c.name not in exclude] if exclude else candidates
        held = hints.held
        if ctx.adapter is not None:
            pool = eligible(pool, ctx.adapter)
        if not pool:
            return None
        kv = hints.kv
        homed = hints.home is not None and any(c.name == hints.home for c in pool)
        if kv is not None and hints.session is None:
            if not homed and not any(kv.cached.get(c.name) for c in pool):
                return self._least(ctx, self._with_room(ctx, kv, pool))
        elif hints.session is None and not homed and not any(c.name in held for c in pool):
            return self._least(ctx, pool)
        if hints.session is not None:
            return self._by_session(ctx, hints.session, held, pool)
        score = self._load.score
        live = [
            (s + QUEUE_WEIGHT * self._ahead(ctx, c) / c.weight, c)
            for c in pool
            if (s := score(c)) != math.inf
        ]
        if not live:  # only stale readings: nothing to weigh the cache against
            return self._least(ctx, pool)
        over = _over_bound([c for _, c in live], ctx.load_factor)

        # A new group cached nowhere has nothing exact to weigh: where its home goes is a
        # partition's question, priced in prefills as without events (`_by_time`). In seconds,
        # the pending prefills of the groups placed just before it sent it off its proposed
        # home: on 2 real engines under pressure 3 of 9 runs homed 5 prefixes on one engine and
        # 3 on the other (the five thrashed); priced in prefills, 4/4 in all 16 approximate runs
        # and in the 3 events runs since.
        # Where the home decides (nothing cached anywhere, or the home keeps most of it) the
        # trade is the partition's too: in prefills, with the events' exact holdings. In
        # seconds, the engines' learnt prefill rates decided it, and those are a request's
        # whole prefill time over its uncached tokens: a home serving hits computes few
        # tokens per prefill, so it looked up to 8x slower per token than its identical peer
        # and its prompts moved off it (issue 52, 2 real engines under pressure: 3 spills
        # and 2 new groups off their home in one run, hit 0.69 against 0.80 without events).
        if kv is not None and not _home_decides(hints, kv, live):
            return self._by_cost(ctx, hints, kv, live, pool, over)
        if all(c.engine is not None for _, c in live):
            return self._by_time(ctx, hints, live, pool)
        per_token = hints.block_chars / CHARS_PER_TOKEN / TOKENS_PER_LOAD
        options: list[tuple[float, Candidate]] = []
        passed_over = False
        nobody = not any(c.name in held for _, c in live)
        for s, c in live:
            blocks = held.get(c.name, 0) or (
                hints.home_blocks if nobody and c.name == hints.home else 0
            )
            if blocks and over(c):
                passed_over = True
                continue
            options.append((s - blocks * per_token, c))
        if not options:  # every holder is over the bound: the least loaded takes it
            return self._spill(ctx, [c for _, c in live if c.name not in held] or pool)
        best = min(cost for cost, _ in options)
        tied = [c for cost, c in options if cost == best]
        return self._settle(hints, tied, passed_over)

    def _by_session(
        self, ctx: PickContext, point: int, held: Mapping[str, int], pool: Sequence[Candidate]
    ) -> Choice | None:
        """The key's home on the ring of every candidate, or the next one clockwise under the
        count bound. Only in-flight counts weigh here, so a stale or not yet scraped engine
        reading moves no session: a moved session loses its whole cache, and a router just
        started (every reading unread) would scatter its first sessions."""
        over = _over_bound(pool, ctx.load_factor)
        by_name = {c.name: c for c in pool}
        for i, name in enumerate(self.ring(frozenset(by_name)).walk(point)):
            c = by_name[name]
            if not over(c):
                return Choice(c, "session" if i == 0 else "spill", held.get(name, 0))
        return self._least(ctx, pool, "spill")

    def _by_time(
        self,
        ctx: PickContext,
        hints: Hints,
        live: Sequence[tuple[float, Candidate]],
        pool: Sequence[Candidate],
    ) -> Choice | None:
        """Every live candidate has a fresh reading: the cost in prefills of this prompt, among
        the engines a homed prompt may move to."""
        held = hints.held
        kv = hints.kv
        prompt = max(1.0, hints.blocks * hints.block_chars / CHARS_PER_TOKEN)
        n = max(1, hints.blocks)
        shares = {c.name: min(1.0, held.get(c.name, 0) / n) for _, c in live}
        if kv is not None:  # live events are exact: their share, and their room
            prompt = max(1.0, kv.tokens)
            for x in kv.exact & shares.keys():
                shares[x] = min(1.0, kv.cached.get(x, 0) / prompt)
        most = max(shares.values(), default=0.0)
        options: list[tuple[float, float, Candidate]] = []
        passed_over = False
        # The prompt's established home, a candidate, keeps it from every engine that cannot
        # start it now (a queue, or no KV free for it) and holds less of it (a holder as good
        # as the home copies nothing: a hot prefix spreads by queue): the cost rule then weighs
        # only the engines that can. A new group's proposed home holds nothing yet, so its
        # cost alone decides (random prompts, each a new group, go by queue). Where every engine
        # queues, a move trades one queue for another and pays a copy that evicts another
        # prefix there; on 2 real engines under KV pressure such moves were the spills left
        # (1-4 a run with events, 0-2 without), and rounds with spills lost hit rate (0.71-0.78
        # against 0.82-0.84) and multiplied TTFT (issue 52). Work-conserving all the same: as
        # soon as an engine has nothing waiting and KV free, a long queue at home flows to it.
        home = hints.home if any(c.name == hints.home for _, c in live) else None
        if hints.home_new:  # a proposal holds nothing yet: its cost decides (below)
            home = None
        kept = 0.0
        if home is not None:
            exact_home = kv is not None and home in kv.exact
            kept = shares[home] if exact_home else _homed(hints, home, shares[home], n)
        for s, c in live:
            r = c.engine
            assert r is not None
            ahead, batch = self._ahead_and_batch(ctx, c, r, prompt)
            share = shares[c.name]
            if home is not None and c.name != home and ahead and (share < kept or not share):
                continue  # a copy behind a queue (above)
            exact = kv is not None and c.name in kv.exact
            # What a copy here throws away of the holder's (or home's) and evicts as much of
            # another prefix here, prefilled once more later (docs/balancers.md#cache_aware).
            # Off a new group's proposed home a copy pays even into room (`_by_cost`).
            if kv is not None and exact:
                free = self._has_room(kv, c, int(prompt)) and not hints.home_new
            else:
                free = c.name in hints.roomy and not hints.home_new
            moved = 0.0 if free else _displaced(hints, c.name, share, most, n)
            uncached = 1.0 - (share if exact else _homed(hints, c.name, share, n))
            # Held nowhere, at equal cost the home wins: balance that saves nothing is no reason
            # to leave the partition (2 real engines: a new group's home 1 x (1 + 3 running)
            # against a copy's (1 + 1) x (1 + 1) went by load's tie-break, off its proposal).
            # A holder's ties still go by load: a hot prefix spreads as soon as it pays.
            tie = -math.inf if c.name == hints.home and not most else s
            options.append(((ahead + (uncached + moved) * (1.0 + batch)) / c.weight, tie, c))
        if not options:  # every holder is over the bound: the least loaded takes it
            return self._spill(ctx, [c for _, c in live if c.name not in held] or pool)
        best = min(options, key=lambda o: o[:2])[:2]
        tied = [c for cost, s, c in options if (cost, s) == best]
        if kv is None:
            return self._settle(hints, tied, passed_over)
        chosen = tied[0] if len(tied) == 1 else weighted_choice(tied, self._rng.random())
        return self._exact(hints, kv, chosen, passed_over or bool(most))

    def _with_room(
        self, ctx: PickContext, kv: KvHints, pool: Sequence[Candidate]
    ) -> Sequence[Candidate]:
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
            if self._ahead_and_batch(ctx, c, r, prompt)[0]:
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
        self, ctx: PickContext, c: Candidate, r: EngineReading, prompt: float
    ) -> tuple[float, float]:
        """Requests ahead of this one on the engine (its queue, an adapter's tier, and one
        more when the prompt would not fit in the KV cache left) and its running batch: the
        reading moved by the router's own requests since it (`least_load.now_on`)."""
        sent = self._load.since(c)
        running, waiting = now_on(r, sent)
        ahead = waiting + self._ahead(ctx, c)
        cap = r.kv_capacity_tokens
        if cap:
            free = min(cap, (1.0 - r.kv_usage) * cap - sent * prompt)
            return ahead + (1.0 if free < prompt else 0.0), running
        return ahead + (1.0 if r.kv_usage >= KV_NEAR_FULL else 0.0), running

    def _by_cost(
        self,
        ctx: PickContext,
        hints: Hints,
        kv: KvHints,
        live: Sequence[tuple[float, Candidate]],
        pool: Sequence[Candidate],
        over: Callable[[Candidate], bool],
    ) -> Choice | None:
        """The expected time to first token on each candidate (module docstring)."""
        prompt = max(1, kv.tokens)
        p_untaught, q_untaught = _peers_rates(live)
        most = min(prompt, max((kv.cached.get(c.name, 0) for _, c in live), default=0))
        n = max(1, hints.blocks)
        options: list[tuple[float, float, Candidate]] = []
        passed_over = False
        settled = hints.home is not None and not hints.home_new
        kept = max(1.0, GROUP_SHARE * most)  # the home's holding that outweighs a guest's
        for s, c in live:
            cached = min(prompt, kv.cached.get(c.name, 0))
            r = c.engine
            if r is None:  # not scraped: in-flight requests stand for the batch
                p, q = p_untaught, q_untaught
                ahead, batch = self._ahead(ctx, c), float(c.inflight)
            else:
                p = r.prefill_s_per_token or p_untaught
                q = r.step_s_per_seq or q_untaught
                ahead, batch = self._ahead_and_batch(ctx, c, r, prompt)
            if cached and r is None and over(c):
                passed_over = True
                continue
            # The prefills sent ahead of ours, less what the engine has had time to do of them.
            before = max(0.0, kv.pending.get(c.name, 0) * p - kv.pending_age.get(c.name, 0.0))
            # A copy here evicts as much of another prefix, prefilled once more later, unless
            # its cache has room: per its live events, else per the index's count.
            # Exact holdings (live events) are the truth: where one is cached, the home yields.
            # ... unless the home still holds most of it (GROUP_SHARE of the best holder's): a
            # guest's full copy outbid a home that had lost a prompt's tail to eviction.
            truth = (
                bool(most)
                and any(kv.cached.get(x) for x in kv.exact)
                and not (hints.home is not None and kv.cached.get(hints.home, 0) >= kept)
            )
            moved = _displaced(hints, c.name, cached / prompt, most / prompt, n, truth) * prompt
            # ... unless it takes the copy without evicting now; but a new group placed off its
            # proposed home only takes that room later, when the caches fill: on 2 real engines
            # under pressure new groups went where the caches still had room, 5 homed on one
            # engine and 3 on the other, and the five thrashed all run.
            live_room = c.name in kv.exact and self._has_room(kv, c, prompt)
            free = truth or not hints.home_new
            if moved and free and (live_room or (c.name not in kv.exact and c.name in hints.roomy)):
                moved = 0.0
            uncached = prompt - cached + moved
            # A prefill delays the running batch as much as ours (the approximate rule's 1 + batch).
            # An established home's prompt weighs prefill and queue only (docs/balancers.md): the
            # learnt decode term priced one more running request above a whole prompt's prefill
            # and moved homed prompts for a batch one request longer (issue 52, events thrash).
            step = 0.0 if settled else batch * q
            cost = (ahead * prompt * p + uncached * p * (1.0 + batch) + before + step) / c.weight
            options.append((cost, s, c))
        if not options:
            return self._spill(ctx, [c for _, c in live if not kv.cached.get(c.name)] or pool)
        best = min(options, key=lambda o: o[:2])[:2]
        tied = [c for cost, s, c in options if (cost, s) == best]
        chosen = tied[0] if len(tied) == 1 else weighted_choice(tied, self._rng.random())
        return self._exact(hints, kv, chosen, passed_over or bool(most))

    @staticmethod
    def _exact(hints: Hints, kv: KvHints, chosen: Candidate, moved: bool) -> Choice:
        """The pick with KV hints, its reason by what its events (or the index) say it holds;
        `moved`: a holder was passed over."""
        cached = min(max(1, kv.tokens), kv.cached.get(chosen.name, 0))
        if cached:
            reason = "prefix_exact" if chosen.name in kv.exact else "prefix_approx"
        elif chosen.name == hints.home:
            reason = "home"
        else:
            reason = "spill" if moved or _anchored(hints) else "load"
        return Choice(chosen, reason, hints.held.get(chosen.name, 0), cached)

    @staticmethod
    def _has_room(kv: KvHints, c: Candidate, prompt: int) -> bool:
        """Its live events say its cache takes the prompt without evicting."""
        r = c.engine
        stored = kv.stored.get(c.name)
        if r is None or stored is None or not r.kv_capacity_tokens:
            return False
        return stored + kv.pending.get(c.name, 0) + prompt <= r.kv_capacity_tokens

    def _settle(self, hints: Hints, tied: Sequence[Candidate], passed_over: bool) -> Choice:
        chosen = tied[0] if len(tied) == 1 else weighted_choice(tied, self._rng.random())
        held = hints.held.get(chosen.name, 0)
        if held:
            return Choice(chosen, "prefix", held)
        if chosen.name == hints.home:
            return Choice(chosen, "home", 0)
        return Choice(chosen, "spill" if passed_over or _anchored(hints) else "load", 0)


def _over_bound(pool: Sequence[Candidate], load_factor: float) -> Callable[[Candidate], bool]:
    """The bounded-load guardrail over `pool`: a candidate over ceil(load_factor x (total + 1)
    / n) requests per weight and SPILL_MIN_GAP above the least loaded is passed over."""
    requests = {c.name: c.inflight / c.weight for c in pool}
    cap = math.ceil(load_factor * (sum(requests.values()) + 1) / len(pool))
    floor = min(requests.values()) + SPILL_MIN_GAP

    def over(c: Candidate) -> bool:
        r = requests[c.name]
        return r + 1 / c.weight > cap and r >= floor

    return over


def _home_decides(hints: Hints, kv: KvHints, live: Sequence[tuple[float, Candidate]]) -> bool:
    """With KV events, the prompt's home (a candidate) is where it belongs: nothing is cached
    anywhere, or the home holds at least GROUP_SHARE of what the best holder holds (a guest's
    full copy does not outbid a home that lost a prompt's tail to eviction)."""
    home = hints.home
    if home is None or not any(c.name == home for _, c in live):
        return False
    most = max((kv.cached.get(c.name, 0) for _, c in live), default=0)
    return not most or kv.cached.get(home, 0) >= max(1.0, GROUP_SHARE * most)


def _anchored(hints: Hints) -> bool:
    """The prompt belonged somewhere (a candidate held part of it, or its group has an
    established home): a pick elsewhere moved it (`spill`), not placed a new one (`load`)."""
    return any(hints.held.values()) or (hints.home is not None and not hints.home_new)


def _homed(hints: Hints, name: str, share: float, blocks: int) -> float:
    """The share of the prompt `name` is taken to hold without KV events: the index's `share`,
    or on the prompt's established home its homed share. The index's LRU guess forgets what
    the engine still holds (it counts CHARS_PER_TOKEN characters a token; vLLM's tokens ran
    longer, so 4 prefixes of 1,024 tokens looked like more than 40 blocks hold), and the home,
    priced as a miss, lost its prompts to a copy elsewhere that evicted another prefix there
    (issue 52: 4-5 spills a run on 2 real engines, hit 0.69-0.72 against the vLLM router's
    0.84). Where the home truly lost it, a copy elsewhere prefills as much and evicts more."""
    if name == hints.home and not hints.home_new:
        return max(share, min(1.0, hints.home_blocks / blocks))
    return share


def _displaced(
    hints: Hints, name: str, share: float, best: float, blocks: int, truth: bool = False
) -> float:
    """The share of the prompt that a pick of `name` (holding `share` of it; the best holder
    `best`) copies away from where it belongs, evicting as much there, to be prefilled again
    later. Off an established home: the homed share, cached here or not (a guest copy takes the
    room of a prefix homed here), unless `truth` (live events say where it is cached). Otherwise
    the best holder's surplus (the truth wins), and
    when nobody holds it, off the home proposed for a new group: all of it."""
    home = hints.home
    if home is not None and not hints.home_new and not truth:
        return 0.0 if name == home else min(1.0, hints.home_blocks / blocks)
    if best > 0:
        return max(0.0, best - share)
    return 0.0 if home is None or name == home else min(1.0, hints.home_blocks / blocks)


def _peers_rates(live: Sequence[tuple[float, Candidate]]) -> tuple[float, float]:
    """The rates for an engine whose histograms have taught none yet: its peers' (the median of
    those taught), else the defaults. A fleet is mostly alike; the defaults are a small GPU's,
    and a CPU engine's learned prefill rate can be 10x them: against the default an engine never
    used looked that much faster than a holder of the prompt, and took it (on 2 real CPU
    engines, a prefix cached on one went to the other)."""
    ps = sorted(r.prefill_s_per_token for _, c in live if (r := c.engine) and r.prefill_s_per_token)
    qs = sorted(r.step_s_per_seq for _, c in live if (r := c.engine) and r.step_s_per_seq)
    p = ps[len(ps) // 2] if ps else DEFAULT_PREFILL_S_PER_TOKEN
    q = qs[len(qs) // 2] if qs else DEFAULT_STEP_S_PER_SEQ
    return p, q
