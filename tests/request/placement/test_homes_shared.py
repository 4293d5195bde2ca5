"""The prefix homes table shared in Redis: a prefix every engine has evicted goes back to the same
home whichever replica routes it (issue 52: "its home engine, shared across replicas").

Real processes: one redis-server, two mock engines, two routers with `balancer: cache_aware`
sharing Redis, the openai SDK as the client. The prefix
index is bounded to one prompt per backend (`affinity.capacity_tokens`), so the second prompt
sent to a backend evicts the first from the index: what is left to remember where the first
lives is its home.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from tests.support.harness import Cluster, Proc, backend, wait_http

BLOCK_CHARS = 256
PROMPT_BLOCKS = 8  # each prompt: exactly this many blocks, the index's bound per backend


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Any]]:
    c = Cluster()
    try:
        redis = c.redis()
        mocks = {n: c.mock(n) for n in ("a", "b")}
        config = {
            "backends": [backend(n, m) for n, m in mocks.items()],
            "balancer": "cache_aware",
            "affinity": {
                "block_chars": BLOCK_CHARS,
                "capacity_tokens": PROMPT_BLOCKS * BLOCK_CHARS // 4,
            },
            "expose_backend_header": True,
            "health": {"interval": 60},
        }
        shared = {"SLUICEGATE_REDIS_URL": redis.url, "SLUICEGATE_REDIS_TIMEOUT": "1"}
        routers = [c.router(config, env=shared, wait=False) for _ in range(2)]
        for r in routers:
            wait_http(r.url + "/healthz", proc=r.popen)
        yield {"routers": routers}
    finally:
        c.close()


def prompt(k: int) -> str:
    text = f"Prefix {k}: the customer's handbook, section {k}. " * 80
    return text[: PROMPT_BLOCKS * BLOCK_CHARS]


def send(router: Proc, k: int) -> str:
    sdk = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=20)
    raw = sdk.completions.with_raw_response.create(model="m", prompt=prompt(k), max_tokens=2)
    return raw.headers["x-sluicegate-backend"]


def test_an_evicted_prefix_goes_home_through_either_replica(fleet: dict[str, Any]) -> None:
    first, second = fleet["routers"]
    # Through the first replica: six new groups, each homed where homes are fewest.
    homes = [send(first, k) for k in range(6)]
    # A backend home to three or more: its first two are gone from the index (the index keeps
    # one prompt per backend) but keep their home.
    h = max(set(homes), key=homes.count)
    i, j = [k for k, name in enumerate(homes) if name == h][:2]
    # The other replica sends both home. With a table per replica it had never seen them: two
    # new groups there, the second placed where its own homes are fewest, so apart.
    assert [send(second, i), send(second, j)] == [h, h], homes
