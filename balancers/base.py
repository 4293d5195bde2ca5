"""The Balancer protocol: given the eligible candidates and one request's context, choose one.

A balancer is pure: no I/O, no health, no clock. Health filters candidates before it is asked;
the in-flight store supplies the loads; the request supplies one `PickContext`
(balancers/context.py): the backends it already tried (`exclude`), the prompt's hints, the
adapter it wants, its SLO and priority. `pick(candidates, ctx)` returns a `Choice`: the
candidate and why it was chosen, as one value, so the caller never reads a reason back off the
balancer (a balancer is shared by concurrent requests). Every balancer declares what it needs:
- `needs_counts`: False when its choice ignores loads, which lets a shared store skip reading
  them (one Redis round trip instead of two);
- `needs_engine`: True when it reads engine metrics: the proxy then hands the store the latest
  `EngineReading`s and each `Candidate` carries its backend's (`engine`, None when the backend
  is not scraped); when False, `engine` stays None (a request for a LoRA adapter reads them
  whatever the balancer);
- `needs_hints`: True when it reads `ctx.hints`: only then does the request hash its prompt,
  look it up in the prefix index and match its tokens against KV events;
- `needs_tokens`: True when it reads `ctx.latency` (`latency`): only then does the request
  count its tokens on the engine it goes to, and feed what it observed back to the models.
A balancer may also offer its policy in the Redis store's own language (`RedisForm`): the store
then picks and counts in one atomic script across replicas, instead of reading counts, picking
here and adding the lease (two round trips, and a race between them); such a choice's reason is
"load". It is used only for a plain context (`PickContext.plain`: no hints, no adapter).
Plugins written to an earlier contract (`pick(candidates, exclude)`, maybe returning a bare
`Candidate`, the declarations optional) are wrapped once where they are loaded
(`balancers.plugin`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from balancers.context import NO_CONTEXT, PickContext
from router.core.engine import EngineReading


# Candidates and choices are values: nothing changes them once built. They are not `frozen`
# only because a frozen dataclass is built through object.__setattr__, field by field: 0.52
# against 0.15 us for a Candidate, and a request builds one per eligible backend.
@dataclass(slots=True, unsafe_hash=True)
class Candidate:
    name: str
    weight: float
    inflight: int
    engine: EngineReading | None = None


@dataclass(slots=True)
class Choice:
    """What a pick chose and what its reason rests on (the request log line, the
    `sluicegate_routing_decisions_total{reason}` label, the trace, the prefix index)."""

    candidate: Candidate
    reason: str = "load"
    held: int = 0  # leading prefix blocks the chosen backend holds (`cache_aware`)
    cached: int = 0  # prompt tokens it holds, per its KV events (`cache_aware` with KV hints)
    # `latency`: its predicted TTFT (s) and the features it rests on (the learning sample's)
    predicted: float | None = None
    features: tuple[float, ...] | None = None


@runtime_checkable
class Balancer(Protocol):
    name: ClassVar[str]
    needs_counts: ClassVar[bool]
    needs_engine: ClassVar[bool]
    needs_hints: ClassVar[bool]
    needs_tokens: ClassVar[bool]

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext = NO_CONTEXT) -> Choice | None:
        """One of `candidates` not in `ctx.exclude`, or None when none is left."""
        ...


@runtime_checkable
class RedisForm(Protocol):
    """The same policy as `pick()`, in Lua, for the Redis in-flight store's acquire script.

    `redis_pick` defines `local function pick(n, load, weight)`: candidates are 1..n, `load(i)`
    is candidate i's count across every replica (false when it is at its `max_inflight`),
    `weight(i)` its weight; it returns the chosen index, or nil when none has room. `load` reads
    Redis on first use, so a policy that looks at two candidates reads two. It must choose as
    `pick()` does: tests/balancers/test_parity.py runs both forms through the same cases.
    """

    redis_pick: ClassVar[str]


def redis_form(balancer: Balancer) -> str | None:
    """The balancer's Lua form, when it offers one."""
    return balancer.redis_pick if isinstance(balancer, RedisForm) else None
