"""Migration's bounds on a fleet that keeps breaking (issue 46, case 15).

- An engine that breaks every stream mid-way was never ejected (it kept half the traffic): each
  answer's start counted as a success and reset its consecutive failures before the break was
  counted. A break mid-answer is that engine's failure, and a success is an answer that came
  whole, so it reaches `outlier.consecutive_failures`.
- One request that kills every engine working on it (a poison request) reached all 6 engines:
  each migration ran the failover loop again (`retries.attempts` engines each). It reaches at
  most 1 + `max_migrations` engines, plain retries included.

Real mock engines that break on purpose (`fail_at`, `die_after`), a real router, the openai
SDK. Probes are off: only what real traffic says counts here.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.support.harness import (
    STARVED_S,
    Cluster,
    Proc,
    backend,
    control,
    expected_text,
    in_flight,
    stats,
)
from tests.support.hostile_backend import HostileBackend

MSG: list[Any] = [{"role": "user", "content": "tell me a story"}]
TOKENS = 20
FAILURES = 3  # outlier.consecutive_failures


def sdk(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0, timeout=20)


def row(router: Proc, name: str) -> dict[str, Any]:
    r = httpx.get(f"{router.url}/admin/backends/{name}", timeout=STARVED_S)
    r.raise_for_status()
    return dict(r.json())


def test_an_engine_breaking_every_stream_mid_way_is_ejected(procs: Cluster) -> None:
    good, bad = procs.mock("good", tokens=TOKENS), procs.mock("bad", tokens=TOKENS)
    router = procs.router(
        {
            "backends": [backend("good", good), backend("bad", bad)],
            "balancer": "round_robin",
            "retries": {"attempts": 1},
            "health": {"enabled": False},
            "outlier": {"consecutive_failures": FAILURES},
        }
    )
    control(bad, fail_at=[5])  # every stream it serves breaks after 5 tokens
    client = sdk(router)

    def ask() -> None:
        stream = client.chat.completions.create(
            model="m", messages=MSG, stream=True, max_tokens=TOKENS
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == expected_text(TOKENS)  # continued on `good`: the client sees no break

    # Round robin: `bad` gets every other request, each of them broken mid-way.
    for _ in range(2 * FAILURES + 2):
        if stats(bad)["requests"] == FAILURES:
            break
        ask()
    assert stats(bad)["requests"] == FAILURES
    state = row(router, "bad")
    assert state["healthy"] is False
    assert state["reason"] == f"ejected: {FAILURES} consecutive failures (mid_stream)"
    for _ in range(4):
        ask()
    assert stats(bad)["requests"] == FAILURES  # ejected: no more of the traffic
    assert in_flight(router) == 0


@pytest.mark.parametrize(("model", "max_migrations"), [("m", 2), ("m-once", 1)])
def test_a_request_that_kills_its_engines_reaches_at_most_1_plus_max_migrations(
    procs: Cluster, hostile: HostileBackend, model: str, max_migrations: int
) -> None:
    # Six engines, each closing the connection once it has read the request (`close`): as
    # engines a request kills would. Each is its own backend (the stand-in counts them all).
    names = [f"e{i}" for i in range(6)]
    router = procs.router(
        {
            "backends": [
                {"name": n, "url": hostile.url, "models": {"m": "close", "m-once": "close"}}
                for n in names
            ],
            "balancer": "round_robin",
            # Plain retries would reach every engine too: the bound covers them.
            "retries": {"attempts": 6},
            "health": {"enabled": False},
            "outlier": {"consecutive_failures": 1000},
            "migration": {
                "max_migrations": 2,
                "models": {"m-once": {"max_migrations": 1}},
            },
        }
    )
    rid = f"poison-{model}"
    with pytest.raises(openai.APIStatusError) as caught:
        sdk(router).chat.completions.create(
            model=model, messages=MSG, max_tokens=TOKENS, extra_headers={"x-request-id": rid}
        )
    assert caught.value.status_code == 502
    error = caught.value.response.json()["error"]
    assert error["type"] == "upstream_error", error
    assert hostile.seen[rid] == 1 + max_migrations
    assert in_flight(router) == 0
