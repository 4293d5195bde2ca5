"""Whether a request is split between a prefill and a decode engine: one pure function.

The decode engine is chosen first (by the model's own balancer, over the decode pool, with the
prompt's prefix holdings as hints), because it holds the request for its whole life: its
batch, its KV for every generated token, and whatever prefix it already caches. Only then is
it known how much of the prompt would still be computed, and that is what a prefill engine can
take off it. llm-d's prefix-based decider: split when the part of the prompt not cached on the
chosen decode engine is at least `min_uncached_tokens`; a shorter remainder is cheaper to
compute where it is than to compute elsewhere and move over the network. The prefill engine is
chosen after that, by the same balancer's scoring over the prefill pool.

Reasons (the `result` label of sluicegate_disaggregated_requests_total, with the outcomes
router/request/placement/pd.py adds): `disaggregated` (split), `short` (the whole prompt is under
the threshold), `cached` (the decode engine holds enough of it), `no_prefill` (no prefill engine can
take it now), `client_params` (the client sent its own `kv_transfer_params`: passed on as sent).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Split:
    split: bool
    reason: str
    uncached: int  # prompt tokens the decode engine would compute itself


def decide(
    prompt_tokens: int,
    cached_on_decode: int,
    min_uncached_tokens: int,
    prefill_available: bool,
    client_params: bool = False,
) -> Split:
    """`prompt_tokens`: the prompt's length (exact, or the router's estimate);
    `cached_on_decode`: leading tokens of it the chosen decode engine holds."""
    uncached = max(0, prompt_tokens - max(0, cached_on_decode))
    if client_params:
        return Split(False, "client_params", uncached)
    if uncached < min_uncached_tokens:
        return Split(False, "short" if prompt_tokens < min_uncached_tokens else "cached", uncached)
    if not prefill_available:
        return Split(False, "no_prefill", uncached)
    return Split(True, "disaggregated", uncached)
