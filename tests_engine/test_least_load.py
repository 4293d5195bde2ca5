"""`least_load` on real readings: it reads what the engines report and avoids the one that
traffic sent to it directly (not through the router) has made busy."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx

from router.engine.parse import parse
from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster
from tests.support.wait import wait_for
from tests_engine.support import (
    DirectLoad,
    Words,
    kv_capacity_blocks,
    metrics,
    metrics_of,
    rows,
    start_router,
)

INTERVAL = 0.1  # engine_metrics.interval of the router under test
STREAMS, PROMPT_TOKENS, MAX_TOKENS = 8, 1200, 600  # 8 x 15 blocks: more than 64 fit, some wait
REQUESTS = 12


def test_least_load_reads_the_engines_and_avoids_the_busy_one(
    fleet: Fleet, procs: Cluster, tmp_path: Path
) -> None:
    idle, busy = fleet.engines
    router = start_router(
        procs,
        fleet,
        # A starved engine's page may come late: readings are kept fresh longer than any
        # scrape here (a stale one is no reading at all).
        {
            "balancer": "least_load",
            "engine_metrics": {"interval": INTERVAL, "timeout": 10.0, "stale_after": 30.0},
        },
    )
    blocks, block_size = kv_capacity_blocks(busy)
    words = Words(fleet, seed=11)
    with DirectLoad(busy, words, STREAMS, PROMPT_TOKENS, MAX_TOKENS, tmp_path):

        def loaded() -> bool:
            m = metrics(busy)
            return m["vllm:num_requests_waiting"] >= 1 and m["vllm:num_requests_running"] >= 2

        wait_for(loaded, "direct traffic queues on the busy engine", 60.0, 0.1)
        # The router's readings are the engine's: sampled a few intervals after the engine's own.
        wait_for(
            lambda: rows(router)[f"engine-{busy.index}"]["engine"]["waiting"] >= 1,
            "the router reads the busy engine's queue",
            20 * INTERVAL + 5.0,
        )
        # The router's parser on the engine's real page reads what Prometheus' own parser reads.
        page = httpx.get(busy.metrics_url, timeout=10).content
        theirs, parsed = metrics_of(page), parse(page, "vllm")
        assert (parsed.waiting, parsed.running) == (
            theirs["vllm:num_requests_waiting"],
            theirs["vllm:num_requests_running"],
        )
        assert parsed.kv_usage == theirs["vllm:kv_cache_usage_perc"]
        assert parsed.preemptions == theirs["vllm:num_preemptions_total"]
        assert parsed.kv_capacity_tokens == blocks * block_size
        reading = rows(router)[f"engine-{busy.index}"]["engine"]
        assert reading["stale"] is False and reading["scrape_error"] is None
        assert reading["kv_capacity_tokens"] == blocks * block_size
        # Read at another moment than the page above: a stream may just have ended and its
        # successor not yet be scheduled, so only the sum is bounded below.
        assert 1 <= reading["running"] + reading["waiting"] <= STREAMS, reading
        assert 0 < reading["kv_usage"] <= 1
        calm = rows(router)[f"engine-{idle.index}"]["engine"]
        assert (calm["running"], calm["waiting"]) == (0, 0)
        assert calm["kv_capacity_tokens"] == blocks * block_size

        served: Counter[str] = Counter()
        with httpx.Client(base_url=router.url, timeout=60) as client:
            for i in range(REQUESTS):
                r = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": idle.model,
                        "messages": [{"role": "user", "content": f"short question {i}"}],
                        "max_tokens": 8,
                    },
                )
                assert r.status_code == 200, r.text
                served[r.headers["x-sluicegate-backend"]] += 1
            still = metrics(busy)
        assert still["vllm:num_requests_waiting"] >= 1  # it stayed busy the whole time
    assert served == {f"engine-{idle.index}": REQUESTS}, served
