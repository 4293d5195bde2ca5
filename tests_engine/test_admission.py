"""Admission on real readings: with every engine saturated by direct traffic (its own queue at
`saturation.waiting`), a request through the router waits in the router's queue, reaches no
engine, and goes through once the engines' readings say they have room again."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx

from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster, in_flight
from tests.support.wait import wait_for
from tests_engine.support import DirectLoad, Words, metrics, router_metrics, rows, start_router

INTERVAL, RECHECK = 0.1, 0.25
# 12 x 15 blocks against 64: about 4 run, and the queue never drops near 0 between streams.
STREAMS, PROMPT_TOKENS, MAX_TOKENS = 12, 1200, 600
HOLD_S = 3.0  # the request stays queued this long while the engines stay saturated


def test_admission_queues_on_engine_readings_and_releases_when_they_drop(
    fleet: Fleet, procs: Cluster, tmp_path: Path
) -> None:
    router = start_router(
        procs,
        fleet,
        {
            "balancer": "least_load",
            # Readings of a starved engine may come late: a stale one counts as no reading,
            # which admits (fails open), so they are kept fresh longer than any scrape here.
            "engine_metrics": {"interval": INTERVAL, "timeout": 10.0, "stale_after": 30.0},
            # Saturated while a request waits in the engine's own queue; KV alone never.
            "admission": {
                "max_wait": 120,
                "recheck": RECHECK,
                "saturation": {"waiting": 1, "kv_usage": 1.0},
            },
        },
    )
    words = Words(fleet, seed=12)
    loads = [
        DirectLoad(e, words, STREAMS, PROMPT_TOKENS, MAX_TOKENS, tmp_path) for e in fleet.engines
    ]
    result: dict[str, object] = {}
    try:

        def saturated() -> bool:
            return all(
                not row["engine"]["stale"] and row["engine"]["waiting"] >= 1
                for row in rows(router).values()
            )

        wait_for(saturated, "both engines queue, as the router reads them", 60.0, 0.05)

        def ask() -> None:
            r = httpx.post(
                router.url + "/v1/chat/completions",
                json={
                    "model": fleet.engines[0].model,
                    "messages": [{"role": "user", "content": "let me in"}],
                    "max_tokens": 4,
                },
                timeout=180,
            )
            result["status"] = r.status_code
            result["done_at"] = time.monotonic()

        client = threading.Thread(target=ask)
        client.start()
        wait_for(
            lambda: router_metrics(router).get("sluicegate_queue_depth", 0) == 1,
            "the request waits in the router's queue",
            10.0,
        )
        held_until = time.monotonic() + HOLD_S
        while time.monotonic() < held_until:
            # Queued, not on an engine: nothing in flight through the router.
            assert saturated(), "the direct load let up: the test cannot hold the request"
            assert "status" not in result
            assert in_flight(router) == 0
            time.sleep(0.1)
        assert all(metrics(e)["vllm:num_requests_waiting"] >= 1 for e in fleet.engines)
    finally:
        for load in loads:
            load.stop()  # the curls go; the engines abort their streams
    released = time.monotonic()
    client.join(60.0)
    assert result.get("status") == 200, result
    # Readings show room within a scrape or two, the queue looks at once (a new reading wakes
    # it) or at its next recheck; the request itself then takes about one prefill + 4 tokens.
    took = float(result["done_at"]) - released  # type: ignore[arg-type]
    assert took <= 5 * INTERVAL + RECHECK + 2.0, took
    assert router_metrics(router).get("sluicegate_queue_depth", 0) == 0
    assert in_flight(router) == 0
