"""Model fallbacks: which model a request goes to when its own cannot serve it (docs/fallbacks.md).

`Fallbacks` holds the configured chains (`fallbacks`, `context_window_fallbacks`,
`content_policy_fallbacks`, LiteLLM's names) by model; a model without any costs a request one
dict miss. A request whose model has some gets a `Route`: the chains of the model it asked for,
the models tried so far, the key's allowed models, and the body's own `"fallbacks"` (which may
only narrow the chain). `Route.next(reason, snapshot)` is the next model to try, or None: then the
client gets the original error. A target's chains are not followed: every fallback of a request
comes from the chains of the model it named, in their order.

`context_limit` and `too_long` are the context-window check before the call: the request's
prompt plus its `max_tokens`, against the shortest `max_model_len` its model's engines report in
`/v1/models` (router/engine/scraper.py); no report, no check. The prompt counts as its model's
tokenizer counts it (`affinity.tokenizers`), and as 0 for a model without one: a guess (bytes / 4
is one) would send away prompts that fit, and the engine's own context-length 400 sends a prompt
that does not fit on after the call anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from router.core.backend import Backend
from router.core.engine import EngineReading
from router.core.errors import FallbackReason
from router.core.settings import API_FORMATS, FALLBACK_KEYS, FallbackChain, Settings

# The body member a client turns fallbacks off with (`"fallbacks": []`), never sent upstream.
BODY_MEMBER = "fallbacks"


@dataclass(frozen=True, slots=True)
class Chains:
    """One model's chains, by the configuration key each comes from."""

    error: FallbackChain | None = None  # `fallbacks`: errors, and streams broken mid-way
    context_window: FallbackChain | None = None
    content_policy: FallbackChain | None = None

    def for_reason(self, reason: FallbackReason) -> FallbackChain | None:
        if reason is FallbackReason.CONTEXT_WINDOW:
            return self.context_window
        if reason is FallbackReason.CONTENT_POLICY:
            return self.content_policy
        if reason is FallbackReason.MID_STREAM:
            chain = self.error
            return chain if chain is not None and chain.mid_stream == "continue" else None
        return self.error

    @property
    def reads_refusals(self) -> bool:
        """A 400 of this model is read and classified (else it streams to the client as is)."""
        return self.context_window is not None or self.content_policy is not None


class Fallbacks:
    def __init__(self, settings: Settings) -> None:
        by_model: dict[str, dict[str, FallbackChain]] = {}
        fields = ("error", "context_window", "content_policy")
        for key, field in zip(FALLBACK_KEYS, fields, strict=True):
            for model, chain in getattr(settings, key).items():
                by_model.setdefault(model, {})[field] = chain
        self.chains: dict[str, Chains] = {m: Chains(**c) for m, c in by_model.items()}

    def route(
        self, model: str, allowed: Set[str] | None, only: Sequence[str] | None
    ) -> Route | None:
        """The request's route among its model's chains; None (the common case) when it has
        none, or the body's `"fallbacks": []` turned them off."""
        chains = self.chains.get(model)
        if chains is None or (only is not None and not only):
            return None
        return Route(chains, model, allowed, frozenset(only) if only is not None else None)

    def table(self) -> list[dict[str, Any]]:
        """Every chain, for the admin API and the console."""
        rows: list[dict[str, Any]] = []
        for model, chains in sorted(self.chains.items()):
            for key, chain in zip(
                FALLBACK_KEYS,
                (chains.error, chains.context_window, chains.content_policy),
                strict=True,
            ):
                if chain is not None:
                    rows.append(
                        {
                            "model": model,
                            "kind": key,
                            "to": list(chain.models),
                            "mid_stream": chain.mid_stream if key == "fallbacks" else None,
                        }
                    )
        return rows


class Route:
    """A request's way along its model's chains."""

    __slots__ = ("allowed", "chains", "only", "origin", "tried")

    def __init__(
        self, chains: Chains, origin: str, allowed: Set[str] | None, only: Set[str] | None
    ) -> None:
        self.chains = chains
        self.origin = origin  # the model the client asked for
        self.allowed = allowed  # the client key's models (None: any)
        self.only = only  # the body's `"fallbacks"` list (None: the whole chain)
        self.tried = {origin}

    def next(
        self,
        reason: FallbackReason,
        by_model: Mapping[str, Sequence[Backend]],
        api: str = "openai",
    ) -> str | None:
        """The next model of the chain for `reason` that the key may use and some backend serves
        now in the request's API format (`api`: openai or anthropic); None when none is left
        (the client gets the original error)."""
        chain = self.chains.for_reason(reason)
        if chain is None:
            return None
        for target in chain.models:
            if target in self.tried:
                continue
            if self.only is not None and target not in self.only:
                continue
            if self.allowed is not None and target not in self.allowed:
                continue
            if not any(api in API_FORMATS[b.kind] for b in by_model.get(target, ())):
                continue
            self.tried.add(target)
            return target
        return None


def body_fallbacks(payload: dict[str, Any]) -> list[str] | str | None:
    """The body's `"fallbacks"`: a list of model names, None when absent, or why it is refused."""
    value = payload.get(BODY_MEMBER)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return "`fallbacks` must be a list of model names ([] turns fallbacks off)"
    return value


def context_limit(backends: Sequence[Backend], readings: Mapping[str, EngineReading]) -> int | None:
    """The shortest context the model's engines report; None when none reports one."""
    limit: int | None = None
    for b in backends:
        reading = readings.get(b.name)
        if reading is not None and reading.max_model_len is not None:
            if limit is None or reading.max_model_len < limit:
                limit = reading.max_model_len
    return limit


def too_long(prompt_tokens: int, payload: dict[str, Any], limit: int) -> bool:
    """Do the prompt's tokens (counted, never guessed: 0 when unknown) plus the `max_tokens` it
    asks for exceed `limit`?"""
    asked = payload.get("max_completion_tokens") or payload.get("max_tokens") or 0
    if not isinstance(asked, int) or isinstance(asked, bool):
        asked = 0
    return prompt_tokens + asked > limit
