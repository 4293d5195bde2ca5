"""Engine-aware routing end to end: mock vLLM/SGLang engines, a real router with `least_load`.

Scrape interval 0.1 s, timeout 0.2 s, so every wait here is a poll with a deadline of a few
intervals. Stale after 1 s, the default: a reading goes stale when no scrape has succeeded for that
long, and on a loaded machine a router starved of CPU for a few scrapes would otherwise find its
healthy engines stale too (with every reading stale the pick falls back to least in flight).
"""

from __future__ import annotations

import concurrent.futures
import io
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from router.tools.status import run as status
from tests.support.harness import STARVED_S, Cluster, Proc, backend, control, stats, streamed_chat
from tests.support.wait import wait_for

INTERVAL = 0.1
SCRAPE_TIMEOUT = 0.2
STALE_AFTER = 1.0
ENGINE = ["--engine", "--max-num-seqs", "8", "--kv-tokens", "32768", "--decode-ms", "5"]
ENGINE += ["--decode-ms-per-seq", "0", "--prefill-ms-per-1k", "5"]
ENGINE += ["--background-prompt", "200", "--background-tokens", "100000"]


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, Proc]]:
    c = Cluster()
    try:
        a = c.mock("a", engine_args=ENGINE)
        b = c.mock("b", engine_args=[*ENGINE, "--old-kv-metric"])
        s = c.mock("s", engine_args=[*ENGINE, "--sglang-metrics"])
        router = c.router(
            {
                "backends": [
                    backend("a", a),
                    backend("b", b),
                    backend("s", s, kind="sglang"),
                ],
                "balancer": "least_load",
                "engine_metrics": {
                    "interval": INTERVAL,
                    "timeout": SCRAPE_TIMEOUT,
                    "stale_after": STALE_AFTER,
                },
                "expose_backend_header": True,
                "health": {"interval": 60},
            }
        )
        yield {"a": a, "b": b, "s": s, "router": router}
    finally:
        c.close()


def engines(router: Proc) -> dict[str, dict[str, Any]]:
    r = httpx.get(router.url + "/admin/backends", timeout=STARVED_S)
    r.raise_for_status()
    return {b["name"]: b["engine"] for b in r.json()}


def burst(router: Proc, n: int, max_tokens: int = 20) -> Counter[str]:
    """n concurrent streamed requests; which backend answered each (x-sluicegate-backend)."""

    def one(_: int) -> str:
        r = streamed_chat(router, "hi " * 50, max_tokens)
        assert r.status_code == 200
        return r.headers["x-sluicegate-backend"]

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return Counter(pool.map(one, range(n)))


@pytest.fixture(autouse=True)
def calm(fleet: dict[str, Proc]) -> Iterator[None]:
    yield
    for name in ("a", "b", "s"):
        control(
            fleet[name], background=0, metrics_status=200, metrics_delay_ms=0, metrics_body=None
        )


def test_new_old_and_sglang_names_are_read(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    for name in ("a", "b", "s"):
        control(fleet[name], background=3)
    wait_for(
        lambda: all(
            e["running"] == 3 and e["kv_usage"] > 0 and not e["stale"]
            for e in engines(router).values()
        ),
        "every engine's batch and KV use read, whatever its metric names",
        3,
    )
    seen = engines(router)
    # cache_config_info: num_gpu_blocks x block_size; SGLang does not say.
    assert seen["a"]["kv_capacity_tokens"] == 32768
    assert seen["b"]["kv_capacity_tokens"] == 32768
    assert seen["s"]["kv_capacity_tokens"] is None
    assert seen["a"]["scrape_error"] is None and seen["a"]["scraped_at"] > 0
    # `sluicegate status` shows the engine's own columns.
    out = io.StringIO()
    assert status(router.url, out=out) == 0
    lines = out.getvalue().splitlines()
    head = lines[0].split()
    assert head[:7] == ["BACKEND", "HEALTH", "IN", "FLIGHT", "WAITING", "RUNNING", "KV"]
    assert head[7:10] == ["KV", "EVENTS", "WEIGHT"]  # "-" for a backend without kv_events
    row = next(ln.split() for ln in lines if ln.startswith("s "))
    assert row[3:5] == ["0", "3"] and row[5].endswith("%")


def test_hidden_load_steers_new_requests_away_within_two_intervals(
    fleet: dict[str, Proc],
) -> None:
    router = fleet["router"]
    wait_for(lambda: all(e["running"] == 0 for e in engines(router).values()), "idle", 3)
    control(fleet["a"], background=6)  # requests that never pass through the router
    time.sleep(2 * INTERVAL + 0.05)
    got = burst(router, 12)
    # least_inflight would give `a` a third (4); the engine says it is busy. (Its background
    # requests end and start again, so a reading between two may find it briefly less busy.)
    assert got["a"] <= 2, got
    assert got["b"] + got["s"] >= 10


def test_stale_engine_is_not_preferred(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    control(fleet["a"], background=4)
    control(fleet["b"], metrics_status=404)  # idle, but we can no longer see it
    wait_for(lambda: engines(router)["b"]["stale"], "b stale", STALE_AFTER + 2)
    assert engines(router)["b"]["scrape_error"] == "HTTP 404"
    got = burst(router, 8)
    assert got["b"] == 0, got
    control(fleet["b"], metrics_status=200)
    wait_for(lambda: not engines(router)["b"]["stale"], "b fresh again", 3)


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ({"metrics_status": 404}, "HTTP 404"),
        ({"metrics_delay_ms": 1500}, "timeout"),
        ({"metrics_body": "vllm:num_requests_running{oops 1\n"}, "malformed"),
        ({"metrics_body": "vllm:num_requests_running NaN\n"}, "malformed: NaN"),
        ({"metrics_body": "vllm:num_requests_waiting -3\n"}, "malformed: negative"),
        ({"metrics_body": "vllm:num_requests_waiting 1e12\n"}, "malformed: absurd"),
        ({"metrics_body": "vllm:kv_cache_usage_perc 7\nvllm:num_requests_running 1\n"}, "KV"),
    ],
)
def test_scrape_faults_are_survived(
    fleet: dict[str, Proc], fault: dict[str, Any], error: str
) -> None:
    router = fleet["router"]
    control(fleet["a"], **fault)
    wait_for(
        lambda: error in (engines(router)["a"]["scrape_error"] or ""),
        f"scrape_error {error!r}",
        3,
    )
    wait_for(lambda: engines(router)["a"]["stale"], "a stale", STALE_AFTER + 2)
    # Routing goes on, never to the engine we cannot read while others are fresh.
    got = burst(router, 6, max_tokens=4)
    assert sum(got.values()) == 6 and got["a"] == 0, got
    if "metrics_delay_ms" in fault:
        # One scrape at a time: a new one only after the previous timed out, never one per
        # interval (half the timeout) piling up behind a slow engine (twice as many).
        window = 5 * SCRAPE_TIMEOUT
        before = stats(fleet["a"])["metrics_scrapes"]
        time.sleep(window)
        assert stats(fleet["a"])["metrics_scrapes"] - before <= window / SCRAPE_TIMEOUT + 1
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    line = next(
        x
        for x in text.splitlines()
        if x.startswith('sluicegate_engine_scrape_errors_total{backend="a"}')
    )
    assert float(line.split()[-1]) >= 1
    control(fleet["a"], metrics_status=200, metrics_delay_ms=0, metrics_body=None)
    wait_for(
        lambda: not engines(router)["a"]["stale"] and engines(router)["a"]["scrape_error"] is None,
        "a fresh again after the fault",
        3,
    )


def test_usage_and_metrics_through_the_router(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    client = OpenAI(base_url=router.url + "/v1", api_key="unused")
    chunks = list(
        client.chat.completions.create(
            model="m",
            stream=True,
            max_tokens=5,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "x" * 400}],
        )
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 100 and chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith("tok0")
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    assert 'sluicegate_routing_decisions_total{backend="' in text
    assert 'balancer="least_load"' in text
    for name in ("waiting", "running", "kv_usage"):
        assert f'sluicegate_engine_{name}{{backend="s"}}' in text
    assert 'sluicegate_engine_scrape_age_seconds{backend="a"}' in text


def test_an_absurd_kv_capacity_is_capped_or_ignored(fleet: dict[str, Proc]) -> None:
    """Issue 22, defect 7: an engine's cache_config_info sizes its share of the prefix index;
    a report of 1.6 x 10^9 tokens was believed. Capped at engine_metrics.max_kv_tokens (8 Mi
    tokens); an implausible block size counts as no report (the configured default applies)."""
    router = fleet["router"]
    running = "vllm:num_requests_running 0\n"
    huge = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="100000000"} 1.0\n'
    control(fleet["a"], metrics_body=running + huge)
    wait_for(
        lambda: engines(router)["a"]["kv_capacity_tokens"] == 8 * 1024 * 1024,
        "capacity capped at max_kv_tokens",
        3,
    )
    odd = 'vllm:cache_config_info{block_size="1000000",num_gpu_blocks="1000"} 1.0\n'
    control(fleet["a"], metrics_body=running + odd)
    wait_for(
        lambda: (
            engines(router)["a"]["kv_capacity_tokens"] is None
            and engines(router)["a"]["scrape_error"] is None
        ),
        "an implausible block size taken as no report",
        3,
    )


def test_a_page_of_too_many_series_is_refused_cheaply(fleet: dict[str, Proc]) -> None:
    """Issue 22, defect 9: 4 MB of valid series took 78 ms of the event loop per scrape. More
    than 256 series of a family is no engine's page: refused after reading that many."""
    router = fleet["router"]
    page = "".join(f'vllm:num_requests_running{{engine="{i}"}} 1\n' for i in range(20_000))
    control(fleet["a"], metrics_body=page)
    wait_for(
        lambda: "too many series" in (engines(router)["a"]["scrape_error"] or ""),
        "scrape_error too many series",
        3,
    )
