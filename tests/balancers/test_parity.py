"""A balancer's two forms, Python (`pick`) and Redis (`redis_pick`, run inside the shared store's
acquire script), make the same choices on the same cases: weights, ties, exclusions, full
backends. For ties the choice is random in both, so both must reach exactly the same tied set."""

from __future__ import annotations

import asyncio
import uuid
from types import MappingProxyType

import pytest
import redis

from balancers.base import Balancer, Candidate, Choice, redis_form
from balancers.context import NO_CONTEXT, PickContext
from balancers.inflight.redis import RedisInflight
from balancers.least_inflight import LeastInflight
from balancers.round_robin import RoundRobin
from router.core.backend import Backend
from tests.support.harness import Cluster, Proc

pytestmark = pytest.mark.redis

SAMPLES = 40  # a fair tie of 4 is missed by 40 draws with probability < 1e-4

# (weights, counts, max_inflight per backend (None: no cap), excluded names, the expected set)
CASES = [
    ("idle, equal weights: all tie", [1, 1, 1, 1], [0, 0, 0, 0], [None] * 4, set(), "abcd"),
    ("the least loaded wins", [1, 1, 1], [3, 1, 2], [None] * 3, set(), "b"),
    ("loads relative to weight", [1, 2], [2, 2], [None] * 2, set(), "b"),
    ("weighted tie", [1, 2, 3], [1, 2, 3], [None] * 3, set(), "abc"),
    ("exclusion removes the least loaded", [1, 1, 1], [0, 1, 1], [None] * 3, {"a"}, "bc"),
    ("a full backend is skipped", [1, 1, 1], [2, 3, 3], [2, None, 5], set(), "bc"),
    ("every backend full: none", [1, 1], [1, 4], [1, 4], set(), ""),
    ("full and excluded together", [1, 1, 1, 1], [1, 0, 1, 2], [1, None, None, None], {"b"}, "c"),
]

NAMES = "abcdefgh"


def backends(weights: list[float], caps: list[int | None]) -> list[Backend]:
    return [
        Backend(n, "http://127.0.0.1:9", "vllm", MappingProxyType({"m": "m"}), w, cap)
        for n, w, cap in zip(NAMES, weights, caps, strict=False)
    ]


def python_choices(
    bal: Balancer, bs: list[Backend], counts: list[int], exclude: set[str]
) -> set[str]:
    """What the in-process stores do: offer the backends with room, let the balancer pick."""
    offered = [
        Candidate(b.name, b.weight, c)
        for b, c in zip(bs, counts, strict=False)
        if b.max_inflight is None or c < b.max_inflight
    ]
    seen: set[str] = set()
    for _ in range(SAMPLES):
        picked = bal.pick(offered, PickContext(exclude))
        if picked is not None:
            seen.add(picked.candidate.name)
    return seen


def redis_choices(
    url: str, bal: Balancer, bs: list[Backend], counts: list[int], exclude: set[str]
) -> set[str]:
    """The shared store's one-script pick over real Redis, with the counts placed there."""
    prefix = uuid.uuid4().hex
    with redis.Redis.from_url(url) as r:
        for b, c in zip(bs, counts, strict=False):
            for i in range(c):  # leases that expire far after the injected clock's now
                r.zadd("{" + prefix + "}:inflight:" + b.name, {f"other:{i}": 10**13})

    async def body() -> set[str]:
        store = RedisInflight(url, prefix=prefix, heartbeat=False, timeout=1.0, clock=lambda: 1e6)
        await store.start()
        seen: set[str] = set()
        try:
            for _ in range(SAMPLES):
                lease = await store.acquire(bs, bal, PickContext(exclude))
                if lease is None:
                    continue
                seen.add(lease.backend)
                store.release(lease)
                await store.flush()
            assert store.fallbacks == 0  # every pick was Redis's, none the local fallback's
        finally:
            await store.aclose()
        return seen

    return asyncio.run(body())


@pytest.fixture(scope="module")
def rds(module_procs: Cluster) -> Proc:
    return module_procs.redis()


@pytest.mark.parametrize(("what", "weights", "counts", "caps", "exclude", "expected"), CASES)
def test_least_inflight_python_and_redis_forms_choose_alike(
    rds: Proc,
    what: str,
    weights: list[float],
    counts: list[int],
    caps: list[int | None],
    exclude: set[str],
    expected: str,
) -> None:
    bs = backends(weights, caps)
    assert redis_form(LeastInflight()) is not None  # found through the balancer itself
    in_python = python_choices(LeastInflight(), bs, counts, exclude)
    in_redis = redis_choices(rds.url, LeastInflight(), bs, counts, exclude)
    assert in_python == set(expected), what
    assert in_redis == in_python, what


def test_a_balancer_without_a_redis_form_is_asked_in_python(rds: Proc) -> None:
    """Round robin offers no Lua: the store lets it pick and only checks room atomically."""
    assert redis_form(RoundRobin()) is None
    bs = backends([1, 1, 1], [None, 1, None])
    assert redis_choices(rds.url, RoundRobin(), bs, [0, 1, 0], set()) == {"a", "c"}


def test_a_subclass_that_changes_the_policy_can_drop_the_redis_form(rds: Proc) -> None:
    """The form is the class's: a subclass whose `pick` differs sets `redis_pick = None`, and
    the store then asks its Python `pick` (so the two can't silently drift)."""

    class MostInflight(LeastInflight):
        redis_pick = None  # type: ignore[assignment]

        def pick(self, candidates, ctx=NO_CONTEXT):  # type: ignore[no-untyped-def]
            pool = [c for c in candidates if c.name not in ctx.exclude]
            most = max(pool, key=lambda c: c.inflight, default=None)
            return Choice(most) if most else None

    assert redis_form(MostInflight()) is None
    bs = backends([1, 1, 1], [None] * 3)
    assert redis_choices(rds.url, MostInflight(), bs, [1, 3, 2], set()) == {"b"}
