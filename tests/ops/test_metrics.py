"""GET /metrics after real traffic through a router with two uvicorn workers.

Each scrape is answered by whichever worker accepts it, so every assertion below holds only if
the workers' values are merged (multiprocess mode): a per-worker registry would show a share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import httpx
import openai
import pytest
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from balancers.context import NO_CONTEXT
from balancers.inflight.local import LocalInflight
from balancers.round_robin import RoundRobin
from router.core.backend import Backend
from router.ops.metrics import MeteredInflight, Metrics
from tests.support.harness import STARVED_S, Cluster, Proc, backend, control, free_port
from tests.support.wait import wait_for

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    good = module_procs.mock("good", tokens=20)
    flaky = module_procs.mock("flaky", tokens=20)
    slow = module_procs.mock("slow", itl_ms=50, tokens=400)
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = module_procs.router(
        {
            "backends": [
                backend("good", good, {"m": "mock-model", "r": "mock-model"}),
                backend("flaky", flaky, {"f": "mock-model"}),
                backend("slow", slow, {"s": "mock-model"}),
                {"name": "dead", "url": dead_url, "models": ["dead-only", "r"]},
            ],
            "balancer": "round_robin",
            # One probe at start, then none during the module: `dead` stays in rotation for the
            # retry test however long the tests before it take on a loaded machine.
            "health": {"interval": 300, "unhealthy_interval": 300},
        },
        workers=2,
    )
    return {"good": good, "flaky": flaky, "slow": slow, "router": router}


def scrape(router: Proc) -> Samples:
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= set(lbl))


def read_events(lines: Iterator[str], n: int) -> int:
    seen = 0
    while seen < n:
        if next(lines).startswith("data: "):
            seen += 1
    return seen


def worker_pids(router: Proc) -> list[int]:
    pids = []
    for line in router.log().splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec["msg"].startswith("Started server process"):
                pids.append(int(rec["pid"]))
    return pids


def request_pids(router: Proc, since: int = 0) -> set[int]:
    """The workers that logged a request, in the log past character `since`."""
    out = set()
    for line in router.log()[since:].splitlines():
        if line.startswith("{") and '"msg": "request"' in line:
            out.add(int(json.loads(line)["pid"]))
    return out


def test_counts_from_both_workers_are_merged(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    control(fleet["good"], itl_ms=5, tokens=20)
    before = scrape(router)
    log_start = len(router.log())
    batch = 16

    async def one(client: openai.AsyncOpenAI) -> str:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main() -> list[str]:
        # One client per request: separate connections, so both workers accept some.
        clients = [
            openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
            for _ in range(batch)
        ]
        try:
            return await asyncio.gather(*(one(c) for c in clients))
        finally:
            for c in clients:
                await c.close()

    # Which worker accepts a connection is the kernel's choice: send batches of new connections
    # until both workers have served some (a loaded machine may hand a whole batch to one).
    texts: list[str] = []
    for _ in range(8):
        texts += asyncio.run(main())
        with contextlib.suppress(AssertionError):  # not yet: another batch
            wait_for(lambda: len(request_pids(router, log_start)) >= 2, "both workers served", 2.0)
            break
    n = len(texts)
    control(fleet["good"], itl_ms=0)
    assert all(t.count("tok") == 20 for t in texts)
    assert len(request_pids(router, log_start)) >= 2  # both workers served some of them
    for _ in range(6):  # any worker may answer a scrape; each must show all n
        after = scrape(router)
        done = value(after, "sluicegate_requests_total", model="m", backend="good", status="200")
        assert done - value(before, "sluicegate_requests_total", model="m", status="200") == n
        ttft = "sluicegate_time_to_first_token_seconds_count"
        assert value(after, ttft, model="m") - value(before, ttft, model="m") == n
        dur = "sluicegate_request_duration_seconds_count"
        assert value(after, dur, model="m") - value(before, dur, model="m") == n
        attempts = "sluicegate_upstream_attempts_total"
        assert value(after, attempts, backend="good") - value(before, attempts, backend="good") >= n
        assert value(after, "sluicegate_backend_in_flight", backend="good") == 0
        assert value(after, "sluicegate_response_bytes_total", model="m") > value(
            before, "sluicegate_response_bytes_total", model="m"
        )


def test_failed_backend_connect_errors_and_retries(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    before = scrape(router)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
    for _ in range(3):
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model="dead-only", messages=[])
        assert info.value.status_code == 502
    for _ in range(6):  # `r` alternates dead/good per worker: some go to dead first, then retry
        r = client.chat.completions.create(model="r", messages=[], max_tokens=2)
        assert r.choices[0].message.content == "tok0 tok1 "
    after = scrape(router)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("sluicegate_requests_total", model="dead-only", status="502") == 3
    assert delta("sluicegate_requests_total", model="r", backend="good", status="200") == 6
    retries = delta("sluicegate_retries_total", model="r")
    assert retries >= 1
    assert delta("sluicegate_upstream_errors_total", backend="dead", kind="connect") == 3 + retries
    assert delta("sluicegate_upstream_attempts_total", backend="dead") == 3 + retries


def test_mid_stream_and_status_failures(fleet: dict[str, Proc]) -> None:
    router, flaky = fleet["router"], fleet["flaky"]
    before = scrape(router)
    control(flaky, die_after=2, tokens=10)
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={"model": "f", "stream": True}
    ) as r:
        text = r.read().decode()
    assert "upstream_mid_stream" in text
    control(flaky, die_after=-1, fail_status=503)
    r2 = httpx.post(router.url + "/v1/chat/completions", json={"model": "f"})
    assert r2.status_code == 503
    control(flaky, fail_status=0)
    after = scrape(router)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    errors = "sluicegate_upstream_errors_total"
    assert delta(errors, backend="flaky", kind="mid_stream") == 1
    assert delta(errors, backend="flaky", kind="status") == 1
    assert delta("sluicegate_requests_total", model="f", backend="flaky", status="200") == 1
    assert delta("sluicegate_requests_total", model="f", backend="flaky", status="503") == 1


def test_disconnect_counted_and_in_flight_released(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    before = scrape(router)
    with (
        httpx.Client(timeout=10) as c,
        c.stream(
            "POST", router.url + "/v1/chat/completions", json={"model": "s", "stream": True}
        ) as r,
    ):
        # Keep the iterator: closing it (as `break` out of a for loop would) closes the stream.
        lines = r.iter_lines()
        assert read_events(lines, 3) == 3
        # The stream is open: the gauge shows it, whichever worker holds it or answers.
        assert value(scrape(router), "sluicegate_backend_in_flight", backend="slow") == 1

    def settled() -> bool:
        now = scrape(router)
        gone = value(now, "sluicegate_client_disconnects_total", model="s") - value(
            before, "sluicegate_client_disconnects_total", model="s"
        )
        return gone == 1 and value(now, "sluicegate_backend_in_flight", backend="slow") == 0

    wait_for(settled, "the disconnect counted, nothing in flight")


def test_killed_workers_stop_counting_in_flight(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    served_before = value(scrape(router), "sluicegate_requests_total", model="m")
    assert served_before >= 16
    pids = worker_pids(router)[-2:]
    assert len(pids) == 2
    with (
        httpx.Client(timeout=10) as c,
        c.stream(
            "POST", router.url + "/v1/chat/completions", json={"model": "s", "stream": True}
        ) as r,
    ):
        lines = r.iter_lines()
        assert read_events(lines, 1) == 1
        assert value(scrape(router), "sluicegate_backend_in_flight", backend="slow") == 1
        for pid in pids:  # the router's workers: started by this test's router process
            os.kill(pid, signal.SIGKILL)
    wait_for(lambda: len(worker_pids(router)) >= len(pids) + 2, "two new workers", 30)
    wait_for(lambda: httpx.get(router.url + "/readyz", timeout=2).status_code == 200, "ready")
    after = scrape(router)
    # The dead worker's stream no longer counts; what the dead workers served still does.
    assert value(after, "sluicegate_backend_in_flight", backend="slow") == 0
    assert value(after, "sluicegate_requests_total", model="m") == served_before


def _samples(text: bytes) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_state_hooks_move_gauges() -> None:
    m = Metrics()
    m.backends_known(["a", "b"])
    start = _samples(m.render())
    assert value(start, "sluicegate_backend_healthy", backend="a") == 1
    m.health_changed("a", False, "probe_failed")
    m.ejected("b", "consecutive_5xx", 30)
    m.redis_fallback(True)
    s = _samples(m.render())
    assert value(s, "sluicegate_backend_healthy", backend="a") == 0
    assert value(s, "sluicegate_backend_healthy", backend="b") == 0
    ejections = "sluicegate_backend_ejections_total"
    assert value(s, ejections, backend="a", reason="probe_failed") == 1
    assert value(s, ejections, backend="b", reason="consecutive_5xx") == 1
    assert value(s, "sluicegate_redis_fallback") == 1
    m.health_changed("a", True, "probe_ok")
    m.redis_fallback(False)
    s = _samples(m.render())
    assert value(s, "sluicegate_backend_healthy", backend="a") == 1
    assert value(s, ejections, backend="a") == 1  # recovering is not an ejection
    assert value(s, "sluicegate_redis_fallback") == 0


def test_metered_store_counts_a_lease_once() -> None:
    m = Metrics()
    inner: Any = LocalInflight()
    store = MeteredInflight(inner, m)
    b = Backend("a", "http://a", "vllm", MappingProxyType({"m": "m"}))

    async def main() -> None:
        lease = await store.acquire([b], RoundRobin(), NO_CONTEXT)
        assert lease is not None
        assert value(_samples(m.render()), "sluicegate_backend_in_flight", backend="a") == 1
        store.release(lease)
        store.release(lease)  # a second release (finally after finally) must not go negative
        s = _samples(m.render())
        assert value(s, "sluicegate_backend_in_flight", backend="a") == 0
        assert value(s, "sluicegate_upstream_attempts_total", backend="a") == 1
        assert await store.counts(["a"]) == {"a": 0}
        assert store.kind == "local"
        fallback = "sluicegate_redis_fallback"
        assert value(_samples(m.render()), fallback) == 0
        inner.degraded = True  # as a shared store does while Redis is unreachable
        await store.acquire([b], RoundRobin(), NO_CONTEXT)
        assert value(_samples(m.render()), fallback) == 1
        inner.degraded = False
        store.check_fallback()  # also called by GET /metrics
        assert value(_samples(m.render()), fallback) == 0

    asyncio.run(main())


def test_serve_drains_workers_and_removes_its_metrics_dir(procs: Cluster, tmp_path: Path) -> None:
    up = procs.mock("up", itl_ms=20, tokens=60)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    router = procs.router({"backends": [backend("up", up)]}, workers=2, env={"TMPDIR": str(tmp)})
    (metrics_dir,) = tmp.glob("sluicegate-metrics-*")
    with (
        httpx.Client(timeout=20) as c,
        c.stream(
            "POST", router.url + "/v1/chat/completions", json={"model": "m", "stream": True}
        ) as r,
    ):
        lines = r.iter_lines()
        assert read_events(lines, 1) == 1
        router.signal(signal.SIGTERM)
        rest = list(lines)  # the stream in flight finishes although the router is stopping
    text = "\n".join(rest)
    assert all(f"tok{i} " in text for i in range(1, 60))
    assert [ln for ln in rest if ln][-1] == "data: [DONE]"
    assert router.popen.wait(20) == 0
    assert not metrics_dir.exists()


def test_ejection_moves_health_metrics(procs: Cluster) -> None:
    """A backend ejected by passive detection shows as unhealthy with an ejection counted."""
    bad = procs.mock("bad")
    good = procs.mock("good")
    control(bad, fail_status=500)
    router = procs.router(
        {
            "backends": [backend("bad", bad), backend("good", good)],
            "balancer": "round_robin",
            "outlier": {"consecutive_failures": 2, "max_ejection_percent": 50},
            "health": {"interval": 60},
        }
    )
    for _ in range(6):
        assert httpx.post(router.url + "/v1/completions", json={"model": "m"}).status_code == 200
    text = httpx.get(router.url + "/metrics").text
    assert 'sluicegate_backend_healthy{backend="bad"} 0.0' in text
    assert 'sluicegate_backend_healthy{backend="good"} 1.0' in text
    ejections = [
        line
        for line in text.splitlines()
        if line.startswith("sluicegate_backend_ejections_total{") and '"bad"' in line
    ]
    assert ejections and float(ejections[0].rsplit(" ", 1)[1]) >= 1, ejections


def test_every_metric_is_one_row_and_one_typed_attribute() -> None:
    """`Metrics` is built from its table: each row names an attribute declared with the row's
    kind, and each declared metric attribute has exactly one row (a misspelt row would leave the
    attribute unset until first use)."""
    from typing import get_type_hints

    from router.ops.metrics import ROWS, Metrics

    declared = {
        k: v for k, v in get_type_hints(Metrics).items() if v in (Counter, Gauge, Histogram)
    }
    assert sorted(r.attr for r in ROWS) == sorted(declared)
    assert len({r.name for r in ROWS}) == len(ROWS)
    m = Metrics()
    for row in ROWS:
        assert type(getattr(m, row.attr)) is declared[row.attr] is row.kind
