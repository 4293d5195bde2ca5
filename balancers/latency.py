"""Send a request where its first token is predicted to come soonest, or, with an SLO, where it
still meets its SLO with the least room to spare.

Each candidate's TTFT is predicted by the engine's own learnt line (balancers/latency_model.py,
reason `latency_model`), else by the pool's (`latency_pooled`); with no pooled model yet the
pick is `least_load`'s (`latency_fallback`), as it is for a LoRA request. The features are the
prompt's uncached tokens there (the prompt less what the KV-event or approximate index says the
engine holds: the prefix credit), the router's own prefill and decode tokens in flight there
(`ctx.latency`; an engine's `vllm:num_tokens_waiting` when larger), and its waiting, running and
KV usage readings. A stale reading's engine is passed over while a fresh one is left.

- No SLO: the lowest predicted TTFT wins.
- An SLO (`ctx.slo_ttft_ms`, `ctx.slo_tpot_ms`), less the time the request spends in the
  admission queue (`LatencyInputs.queued_s`): among the engines predicted to meet it with their
  model's margin (prediction x `Fit.spread`), the one with the least headroom (packing: fast
  engines stay free for tight SLOs) when recent requests carried a tighter TTFT SLO
  (`LatencyInputs.tightest_ms`), else the lowest predicted; when none is, the most headroom
  (the lowest predicted TTFT). A `sheddable` request none reaches even on the bare prediction
  (or, before any model, whose queue wait alone exceeds it), with admission on
  (`LatencyInputs.shed`), is chosen with the reason `slo_unattainable`: the request path
  refuses it (429) and gives the lease back.
- A pinned engine (an echoed `x-session-token`) is kept unless its predicted TTFT is worse than
  the best by more than `LatencyInputs.break_s` (reason `session`).
- Exploration: EXPLORE of the picks without an SLO go to the least-sampled engine predicted
  within EXPLORE_SLACK of the best, so an engine the models pass over still gets samples.
Pure: the models, token loads and readings arrive as data; its only state is its random draw.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import ClassVar

from balancers.base import Candidate, Choice
from balancers.cache_aware import CHARS_PER_TOKEN
from balancers.context import NO_CONTEXT, LatencyInputs, PickContext
from balancers.latency_model import Features
from balancers.least_load import LeastLoad

EXPLORE = 0.02  # share of picks without an SLO that explore
EXPLORE_SLACK = 1.5  # an explored engine is predicted within this times the best (+50 ms)
UNATTAINABLE = "slo_unattainable"


class Latency:
    name: ClassVar[str] = "latency"
    needs_counts: ClassVar[bool] = True
    needs_engine: ClassVar[bool] = True
    needs_hints: ClassVar[bool] = True
    needs_tokens: ClassVar[bool] = True

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()
        self._load = LeastLoad(self._rng)

    def _fallback(self, candidates: Sequence[Candidate], ctx: PickContext) -> Choice | None:
        """least_load's pick; with the inputs, its features still go along: the samples that
        teach the first models come from these picks."""
        choice = self._load.pick(candidates, ctx)
        lat = ctx.latency
        if choice is None or ctx.adapter is not None:
            return choice
        c = choice.candidate
        if lat is None:
            return Choice(c, "latency_fallback")
        reason = "latency_fallback"
        slo = ctx.slo_ttft_ms
        if slo is not None and lat.queued_s * 1000 > slo and _sheds(ctx, lat):
            reason = UNATTAINABLE  # no model yet, but the queue alone takes longer
        cached = _cached(ctx, lat.prompt_tokens)
        features = self._features(c, lat, cached)
        held = ctx.hints.held.get(c.name, 0) if ctx.hints is not None else 0
        tokens = cached.get(c.name, 0) if cached else 0
        return Choice(c, reason, held, tokens, None, features)

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext = NO_CONTEXT) -> Choice | None:
        lat = ctx.latency
        if lat is None or lat.models.pooled is None or ctx.adapter is not None:
            return self._fallback(candidates, ctx)
        exclude = ctx.exclude
        pool = [c for c in candidates if c.name not in exclude] if exclude else candidates
        if not pool:
            return None
        fresh = [c for c in pool if c.engine is None or not c.engine.stale]
        if not fresh:
            return self._fallback(pool, ctx)
        cached = _cached(ctx, lat.prompt_tokens)
        pooled = lat.models.pooled
        scored = self._predict(fresh, lat, cached)
        best = min(scored, key=_first)
        chosen = best
        reason = ""
        pinned = lat.pinned
        slo = ctx.slo_ttft_ms
        tpot_slo = ctx.slo_tpot_ms
        if pinned is not None:
            for s in scored:
                if s[1].name == pinned:
                    if s[0] - best[0] <= lat.break_s:
                        return self._choice(s, "session", ctx, lat, cached)
                    break
        if slo is not None or tpot_slo is not None:
            # The SLO counts from the request's arrival: its time in the queue is spent.
            ttft_cap = slo / 1000 - lat.queued_s if slo is not None else math.inf
            reach = [s for s in scored if s[0] <= ttft_cap]
            if tpot_slo is not None:
                tpot_cap = tpot_slo / 1000
                reach = [s for s in reach if self._tpot(s, lat, cached) <= tpot_cap]
            models = lat.models
            meet = [
                s
                for s in reach
                if s[0] * (models.engines.get(s[1].name) or pooled).spread <= ttft_cap
            ]
            if meet:
                if slo is not None and slo > lat.tightest_ms:
                    # Least positive headroom: the slowest engine still within the SLO, the
                    # faster ones kept for the tighter SLOs that recent requests carried.
                    chosen = max(meet, key=_first)
                else:  # none tighter to keep them for: the lowest prediction within it
                    chosen = min(meet, key=_first)
            elif not reach and _sheds(ctx, lat):
                reason = UNATTAINABLE
        elif len(scored) > 1 and self._rng.random() < EXPLORE:
            near = best[0] * EXPLORE_SLACK + 0.05
            counts = lat.models.samples
            chosen = min(
                (s for s in scored if s[0] <= near), key=lambda s: counts.get(s[1].name, 0)
            )
        return self._choice(chosen, reason, ctx, lat, cached)

    @staticmethod
    def _predict(
        pool: Sequence[Candidate], lat: LatencyInputs, cached: dict[str, int] | None
    ) -> list[tuple[float, Candidate]]:
        """(predicted TTFT s, candidate) of each; inline, since this is the per-request cost
        (bench/oneoff/latency_pick.py)."""
        models = lat.models
        engines = models.engines
        pooled = models.pooled
        assert pooled is not None
        prompt = lat.prompt_tokens
        prefill = lat.prefill
        decode = lat.decode
        out: list[tuple[float, Candidate]] = []
        for c in pool:
            name = c.name
            f = engines.get(name) or pooled
            w = f.ttft
            q: float = prefill.get(name, 0)
            r = c.engine
            y = w[0] + w[1] * (prompt - (cached.get(name, 0) if cached else 0))
            y += w[3] * decode.get(name, 0)
            if r is not None:
                t = r.tokens_waiting
                if t is not None and t > q:
                    q = t
                y += w[4] * r.waiting + w[5] * r.running + w[6] * r.kv_usage
            y += w[2] * q
            out.append((0.0 if y < 0.0 else (f.ceiling if y > f.ceiling else y), c))
        return out

    @staticmethod
    def _features(c: Candidate, lat: LatencyInputs, cached: dict[str, int] | None) -> Features:
        name = c.name
        q = float(lat.prefill.get(name, 0))
        r = c.engine
        waiting = running = kv = 0.0
        if r is not None:
            waiting, running, kv = r.waiting, r.running, r.kv_usage
            if r.tokens_waiting is not None and r.tokens_waiting > q:
                q = r.tokens_waiting
        held = cached.get(name, 0) if cached else 0
        return (
            float(lat.prompt_tokens - held),
            q,
            float(lat.decode.get(name, 0)),
            waiting,
            running,
            kv,
        )

    def _tpot(
        self, s: tuple[float, Candidate], lat: LatencyInputs, cached: dict[str, int] | None
    ) -> float:
        models = lat.models
        f = models.engines.get(s[1].name) or models.pooled
        assert f is not None
        got = f.tpot_s(self._features(s[1], lat, cached))
        return 0.0 if got is None else got

    def _choice(
        self,
        s: tuple[float, Candidate],
        reason: str,
        ctx: PickContext,
        lat: LatencyInputs,
        cached: dict[str, int] | None,
    ) -> Choice:
        c = s[1]
        if not reason:
            reason = "latency_model" if c.name in lat.models.engines else "latency_pooled"
        hints = ctx.hints
        held = hints.held.get(c.name, 0) if hints is not None else 0
        tokens = cached.get(c.name, 0) if cached else 0
        return Choice(c, reason, held, tokens, s[0], self._features(c, lat, cached))


def _sheds(ctx: PickContext, lat: LatencyInputs) -> bool:
    """A request this balancer may refuse for its SLO: `sheddable`, with admission on."""
    return lat.shed and ctx.priority == "sheddable"


def _first(s: tuple[float, Candidate]) -> float:
    return s[0]


def _cached(ctx: PickContext, prompt: int) -> dict[str, int] | None:
    """Backend -> prompt tokens it holds: its KV events' (exact) or the approximate index's
    blocks in tokens; None without hints."""
    hints = ctx.hints
    if hints is None:
        return None
    kv = hints.kv
    if kv is not None:
        return {n: min(prompt, t) for n, t in kv.cached.items()}
    if not hints.held:
        return None
    per_block = hints.block_chars // CHARS_PER_TOKEN
    return {n: min(prompt, b * per_block) for n, b in hints.held.items()}
