"""What one request brings to a pick, as data: `PickContext` (Envoy's `LoadBalancerContext`).

The request path builds one per attempt and hands it to `Balancer.pick(candidates, ctx)`; each
policy reads what it needs and ignores the rest, so a new input (an SLO, a gateway's subset) is
a field here, not another wrapper around the balancer. Everything here is computed outside the
balancers (the prefix index, KV events, the LoRA registry) and never changed once built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from dataclasses import dataclass, field

from balancers.latency_model import NO_MODELS, Models


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
    """The prompt's prefix as the index sees it, and the session it names."""

    blocks: int  # blocks in the request's prefix chain
    block_chars: int
    held: Mapping[str, int]  # backend -> how many leading blocks the index says it holds
    session: int | None = None  # the session key's point on the ring (None: no session)
    kv: KvHints | None = None  # token-level holdings, when the model's backends publish events
    # The prompt's home (balancers/prefix_homes.py): where its group lives, or where a new group
    # goes; `home_blocks`: its leading blocks homed there (the whole prompt for a new group).
    home: str | None = None
    home_blocks: int = 0
    home_new: bool = False  # `home` is only proposed: no prompt of its group was sent yet
    # Backends whose cache, as the index counts it, takes this prompt without evicting.
    roomy: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class AdapterWant:
    """The LoRA adapter a request names, and what the router knows of it (balancers/lora.py)."""

    name: str
    on_demand: bool = False  # it is in `lora.sources` and load_on_demand is on
    failed: frozenset[str] = field(default_factory=frozenset)  # backends not to load it on
    loaded: frozenset[str] = field(default_factory=frozenset)  # backends the router loaded it on
    # backends the router just unloaded it from (their readings may still list it)
    unloaded: frozenset[str] = field(default_factory=frozenset)
    # backend -> adapters this router has requests in flight for there (exact, no scrape lag)
    flights: Mapping[str, frozenset[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LatencyInputs:
    """What `balancer: latency` reads besides the candidates: the learnt models, the router's
    own token load per engine (read during the pick only: the request path moves it between
    picks), the prompt's length in tokens, the engine an echoed `x-session-token` names, and
    the time the request spends in the admission queue before it is sent."""

    models: Models = NO_MODELS
    prefill: Mapping[str, int] = field(default_factory=dict)  # backend -> prompt tokens queued
    decode: Mapping[str, int] = field(default_factory=dict)  # backend -> decode tokens left
    prompt_tokens: int = 0
    pinned: str | None = None
    break_s: float = 0.2  # affinity.session_break_ms: a pin's allowance over the best
    shed: bool = False  # admission is on: a sheddable request may be refused for its SLO
    # Seconds in the admission queue before dispatch (waited, or predicted to wait if it
    # would queue now): added to each engine's predicted TTFT where it is held against the SLO.
    queued_s: float = 0.0
    # The tightest TTFT SLO (ms) among the recent requests that carried one: packing keeps
    # fast engines free only when there is a tighter SLO to keep them for.
    tightest_ms: float = math.inf


@dataclass(frozen=True, slots=True)
class PickContext:
    """One attempt's inputs to a pick. `exclude`: backends this request already tried (the
    stores leave them out too); `hints`: the prompt's prefix and session (built only for a
    balancer that declares `needs_hints`); `adapter`: the LoRA adapter wanted; `load_factor`:
    the bounded-load factor of affinity (`affinity.load_factor`); `slo_ttft_ms`,
    `slo_tpot_ms` and `priority`: the request's latency objectives and admission band;
    `latency`: the models and token loads (built only for a balancer that declares
    `needs_tokens`)."""

    exclude: Set[str] = frozenset()
    hints: Hints | None = None
    adapter: AdapterWant | None = None
    load_factor: float = 1.25
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    priority: str | None = None
    latency: LatencyInputs | None = None

    @property
    def plain(self) -> bool:
        """Nothing but exclusions: a policy's load-only form (its Lua, `RedisForm`) may pick."""
        return self.hints is None and self.adapter is None


NO_CONTEXT = PickContext()
