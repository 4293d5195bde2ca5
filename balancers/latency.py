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
- An SLO (`ctx.slo_ttft_ms`, `ctx.slo_tpot_ms`): among the engines predicted to meet it, the
  one with the least headroom (packing: fast engines stay free for tight SLOs); when none is,
  the most headroom (the lowest predicted TTFT). A `sheddable` request none meets, with
  admission on (`LatencyInputs.shed`), is chosen with the reason `slo_unattainable`: the
  request path refuses it (429) and gives the lease back.
- A pinned engine (an echoed `x-session-token`) is kept unless its predicted TTFT is worse than
  the best by more than `LatencyInputs.break_s` (reason `session`).
- Exploration: EXPLORE of the picks without an SLO go to the least-sampled engine predicted
  within EXPLORE_SLACK of the best, so an engine the models pass over still gets samples.
Pure: the models, token loads and readings arrive as data; its only state is its random draw.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from balancers.base import Candidate, Choice
from balancers.cache_aware import CHARS_PER_TOKEN
from balancers.context import NO_CONTEXT, LatencyInputs, PickContext
from balancers.latency_model import Features, Fit
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
        choice = self._load.pick(candidates, ctx)
        if choice is None or ctx.adapter is not None:
            return choice
        return Choice(choice.candidate, "latency_fallback")

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
        scored = self._predict(fresh, ctx, lat)
        best = min(scored, key=_ttft)
        chosen = best
        reason = best[4]
        pinned = lat.pinned
        slo = ctx.slo_ttft_ms
        tpot_slo = ctx.slo_tpot_ms
        if pinned is not None:
            for s in scored:
                if s[0].name == pinned:
                    if s[1] - best[1] <= lat.break_s:
                        return _choice(s, "session", ctx)
                    break
        if slo is not None or tpot_slo is not None:
            ttft_cap = slo / 1000 if slo is not None else float("inf")
            tpot_cap = tpot_slo / 1000 if tpot_slo is not None else float("inf")
            meet = [s for s in scored if s[1] <= ttft_cap and (s[2] or 0.0) <= tpot_cap]
            if meet:
                # Least positive headroom: the slowest engine still within the SLO.
                chosen = max(meet, key=_ttft)
                reason = chosen[4]
            elif lat.shed and ctx.priority == "sheddable":
                return _choice(best, UNATTAINABLE, ctx)
        elif len(scored) > 1 and self._rng.random() < EXPLORE:
            near = best[1] * EXPLORE_SLACK + 0.05
            counts = lat.models.samples
            chosen = min(
                (s for s in scored if s[1] <= near), key=lambda s: counts.get(s[0].name, 0)
            )
            reason = chosen[4]
        return _choice(chosen, reason, ctx)

    def _predict(
        self, pool: Sequence[Candidate], ctx: PickContext, lat: LatencyInputs
    ) -> list[tuple[Candidate, float, float | None, Features, str, int]]:
        """(candidate, predicted TTFT s, predicted TPOT s, features, reason, cached tokens)."""
        models = lat.models
        engines = models.engines
        pooled = models.pooled
        assert pooled is not None
        prompt = lat.prompt_tokens
        cached_of = _cached(ctx, prompt)
        prefill = lat.prefill
        decode = lat.decode
        out: list[tuple[Candidate, float, float | None, Features, str, int]] = []
        for c in pool:
            name = c.name
            cached = cached_of.get(name, 0) if cached_of else 0
            queued = float(prefill.get(name, 0))
            r = c.engine
            if r is None:
                waiting = running = kv = 0.0
            else:
                waiting, running, kv = r.waiting, r.running, r.kv_usage
                if r.tokens_waiting is not None and r.tokens_waiting > queued:
                    queued = r.tokens_waiting
            x: Features = (
                float(prompt - cached),
                queued,
                float(decode.get(name, 0)),
                waiting,
                running,
                kv,
            )
            f: Fit | None = engines.get(name)
            reason = "latency_model"
            if f is None:
                f, reason = pooled, "latency_pooled"
            out.append((c, f.ttft_s(x), f.tpot_s(x), x, reason, cached))
        return out


def _ttft(s: tuple[Candidate, float, float | None, Features, str, int]) -> float:
    return s[1]


def _choice(
    s: tuple[Candidate, float, float | None, Features, str, int], reason: str, ctx: PickContext
) -> Choice:
    hints = ctx.hints
    held = hints.held.get(s[0].name, 0) if hints is not None else 0
    return Choice(s[0], reason, held, s[5], s[1], s[3])


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
