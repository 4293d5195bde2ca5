"""Health and failover end to end: real mock-upstream processes, a real router, the openai SDK.

Short probe intervals keep these quick; every wait is bounded and polls loopback only.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from typing import Any

import httpx
import openai
import pytest

from tests.support.harness import STARVED_S, Cluster, Proc, backend, control, expected_text, stats
from tests.support.wait import wait_for, wait_for_async

FAST_HEALTH = {
    "interval": 0.5,
    "unhealthy_interval": 0.25,
    "timeout": 0.5,
    "unhealthy_threshold": 3,
    "healthy_threshold": 2,
}
MSG = [{"role": "user", "content": "hi"}]


def rows(router: Proc) -> dict[str, dict[str, Any]]:
    r = httpx.get(router.url + "/admin/backends", timeout=STARVED_S)
    r.raise_for_status()
    return {row["name"]: row for row in r.json()}


def sdk(router: Proc, timeout: float = 20) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=router.url + "/v1", api_key="client-key", max_retries=0, timeout=timeout
    )


def ids_seen(*mocks: Proc) -> Counter[str]:
    return Counter(r["request_id"] for m in mocks for r in stats(m)["recent"])


def test_500_before_streaming_is_served_by_another_backend(procs: Cluster) -> None:
    a, b = procs.mock("a", tokens=6), procs.mock("b", tokens=6)
    router = procs.router(
        {
            "backends": [backend("a", a), backend("b", b)],
            "balancer": "round_robin",
            "outlier": {"consecutive_failures": 100},
        }
    )
    control(a, fail_status=500)
    client = sdk(router)
    for i in range(4):
        stream = client.chat.completions.create(
            model="m", messages=MSG, stream=True, extra_headers={"x-request-id": f"req-{i}"}
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == expected_text(6)
    on_a = [r["request_id"] for r in stats(a)["recent"]]
    on_b = Counter(r["request_id"] for r in stats(b)["recent"])
    assert on_a, "round robin never offered the failing backend"
    for rid in on_a:
        assert on_b[rid] == 1, f"{rid} failed on a and was not retried on b"
    assert sum(on_b.values()) == 4
    assert rows(router)["a"]["consecutive_failures"] == len(on_a)


def test_mid_stream_failure_is_never_retried_with_migration_off(procs: Cluster) -> None:
    a, b = procs.mock("a"), procs.mock("b")
    # With migration on, such a stream goes on elsewhere (tests/request/migration/).
    config = {"backends": [backend("a", a), backend("b", b)], "migration": {"enabled": False}}
    router = procs.router(config)
    for m in (a, b):
        control(m, die_after=3, tokens=10)
    client = sdk(router)
    for i in range(4):
        text = ""
        with pytest.raises(openai.APIError):
            stream = client.chat.completions.create(
                model="m", messages=MSG, stream=True, extra_headers={"x-request-id": f"mid-{i}"}
            )
            for c in stream:
                if c.choices:
                    text += c.choices[0].delta.content or ""
        assert text == expected_text(3)  # each token once: nothing replayed from elsewhere
    seen = ids_seen(a, b)
    assert seen == Counter({f"mid-{i}": 1 for i in range(4)})


def test_hanging_backend_times_out_moves_on_and_is_ejected(procs: Cluster) -> None:
    a, b = procs.mock("a", tokens=4), procs.mock("b", tokens=4)
    router = procs.router(
        {
            "backends": [
                backend("a", a),
                backend("b", b),
                backend("a-solo", a, {"solo": "mock-model"}),
            ],
            "balancer": "round_robin",
            "timeouts": {"read": 1.0},
            # Its /health answers at once, so every probe must pass: a probe that timed out on a
            # loaded machine (0.5 s) counted as "seen down while ejected", and good probes then
            # readmitted the doubled ejection, one request too many.
            "health": {**FAST_HEALTH, "timeout": 4 * FAST_HEALTH["timeout"]},
            "outlier": {"consecutive_failures": 2},
        }
    )
    control(a, hang=True)
    client = sdk(router)
    for _ in range(6):  # non-streaming: nothing is sent until the answer is whole
        r = client.chat.completions.create(model="m", messages=MSG)
        assert r.choices[0].message.content == expected_text(4)
    row = rows(router)["a"]
    assert row["healthy"] is False and row["ejected_until"] is not None
    assert row["reason"] == "ejected: 2 consecutive failures (timeout)"
    hung = stats(a)["requests"]
    assert hung == 2
    # Its /health still answers, as a restarted backend's would: good probes readmit it once,
    # requests find it hung again (each moves on to b), and the doubled ejection that follows is
    # not undone by probes alone.
    # healthy_threshold probes at unhealthy_interval
    wait_for(lambda: rows(router)["a"]["healthy"] is True, "a readmitted", 2 * 0.25 * 1.1 + 4)
    for _ in range(6):
        r = client.chat.completions.create(model="m", messages=MSG)
        assert r.choices[0].message.content == expected_text(4)
    row = rows(router)["a"]
    assert row["healthy"] is False and row["times_ejected"] == 2
    hung = stats(a)["requests"]
    assert hung == 4
    # Four probe rounds of a, all good: eight probes of its mock (a-solo's, every `interval`,
    # among them) hold at least four of a's, every `unhealthy_interval`.
    probes = stats(a)["probes"]
    wait_for(lambda: stats(a)["probes"] >= probes + 8, "8 more probes of a", 10)
    for _ in range(3):
        client.chat.completions.create(model="m", messages=MSG)
    assert stats(a)["requests"] == hung
    assert rows(router)["a"]["healthy"] is False

    # With no other backend, the timeout surfaces as a clear 504.
    started = time.monotonic()
    resp = httpx.post(router.url + "/v1/chat/completions", json={"model": "solo"}, timeout=10)
    assert resp.status_code == 504
    assert resp.json()["error"]["code"] == "upstream_timeout"
    assert 0.9 <= time.monotonic() - started < 5


def test_retry_after_cools_the_backend_down(procs: Cluster) -> None:
    a, b = procs.mock("a", tokens=3), procs.mock("b", tokens=3)
    router = procs.router(
        {
            "backends": [backend("a", a), backend("b", b), backend("a-solo", a, ["solo"])],
            "balancer": "round_robin",
        }
    )
    control(a, fail_status=429, retry_after=30)
    client = sdk(router)
    # The cooldown is the 429's 30 s from when it came, sometime between these two instants
    # (a loaded machine may take seconds over the five requests).
    sent = time.time()
    for _ in range(5):
        r = client.chat.completions.create(model="m", messages=MSG)
        assert r.choices[0].message.content == expected_text(3)
    answered = time.time()
    assert stats(a)["requests"] == 1  # asked once, then left alone
    row = rows(router)["a"]
    assert row["healthy"] is False and row["cooldown_until"] is not None
    assert sent + 30 - 0.01 <= row["cooldown_until"] <= answered + 30 + 0.01
    assert row["consecutive_failures"] == 0  # a 429 is not a failure of the backend

    # With nowhere else to go the backend's own 429 is forwarded; then it is left alone even
    # though no backend of the model is healthy (no panic-mode hammering of a 429).
    url = router.url + "/v1/chat/completions"
    sent = time.monotonic()
    first = httpx.post(url, json={"model": "solo"}, timeout=10)
    assert first.status_code == 429 and first.headers["retry-after"] == "30"
    second = httpx.post(url, json={"model": "solo"}, timeout=10)
    between = time.monotonic() - sent  # at most this much of the 30 s had passed
    assert second.status_code == 503
    assert second.json()["error"]["code"] == "no_capacity"
    assert round(30 - between) <= int(second.headers["retry-after"]) <= 30
    assert stats(a)["requests"] == 2


def test_retry_budget_and_attempts_bound_the_retries(procs: Cluster) -> None:
    mocks = [procs.mock(n, tokens=3) for n in "abcd"]
    fleet = [backend(m_name, m) for m_name, m in zip("abcd", mocks, strict=True)]
    generous = procs.router({"backends": fleet, "outlier": {"consecutive_failures": 100}})
    broke = procs.router(
        {
            "backends": fleet,
            "outlier": {"consecutive_failures": 100},
            "retries": {"budget_percent": 0, "min_retries": 0},
        }
    )
    for m in mocks:
        control(m, fail_status=500)

    def upstream_requests() -> int:
        return sum(stats(m)["requests"] for m in mocks)

    r = httpx.post(generous.url + "/v1/chat/completions", json={"model": "m"}, timeout=10)
    assert r.status_code == 500 and upstream_requests() == 3  # attempts: 3 of the 4
    r = httpx.post(broke.url + "/v1/chat/completions", json={"model": "m"}, timeout=10)
    assert r.status_code == 500 and upstream_requests() == 4  # no budget: no retry


def test_deadline_stops_failover(procs: Cluster) -> None:
    a, b = procs.mock("a"), procs.mock("b")
    router = procs.router(
        {
            "backends": [backend("a", a), backend("b", b)],
            "balancer": "round_robin",  # a first
            "timeouts": {"read": 1.0},
            "retries": {"deadline": 0.5},
        }
    )
    control(a, hang=True)
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "m"}, timeout=10)
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert stats(a)["requests"] == 1 and stats(b)["requests"] == 0


def test_probes_take_a_loading_backend_out_and_back(procs: Cluster) -> None:
    a, b = procs.mock("a", tokens=3), procs.mock("b", tokens=3)
    router = procs.router({"backends": [backend("a", a), backend("b", b)], "health": FAST_HEALTH})
    client = sdk(router)
    control(a, health_status=503)
    took = wait_for(lambda: rows(router)["a"]["healthy"] is False, "a out of rotation", 1.5 + 2)
    assert rows(router)["a"]["reason"] == "probe failed (status_503)"
    control(a, reset_stats=True)
    for _ in range(6):
        client.chat.completions.create(model="m", messages=MSG)
    assert stats(a)["requests"] == 0
    control(a, health_status=200)
    back = wait_for(
        lambda: rows(router)["a"]["healthy"] is True,
        "a back in rotation",
        2 * 0.5 + 1 + 1,
    )
    row = rows(router)["a"]
    assert row["last_probe_latency_ms"] is not None and row["reason"] is None
    print(f"\nprobe: out after {took:.2f}s (bound 1.5s), back after {back:.2f}s (bound 2.0s)")


def test_new_backend_is_probed_at_once_with_its_key(procs: Cluster) -> None:
    a, pace = procs.mock("a"), procs.mock("pace")
    control(a, reset_stats=True)  # the harness's own readiness check hit /health
    router = procs.router(
        {
            "backends": [
                backend("a", a, kind="openai", api_key="sk-probe-secret"),
                # The router's own probe schedule as the test's clock.
                backend("pace", pace, health={"interval": 0.1}),
            ],
            "health": {"interval": 60},
        }
    )
    wait_for(lambda: stats(a)["probes"] >= 1, "a probed", 5)
    assert stats(a)["last_probe_authorization"] == "Bearer sk-probe-secret"
    paced = stats(pace)["probes"]
    wait_for(lambda: stats(pace)["probes"] >= paced + 5, "5 probes of pace", 10)  # 0.5 s of it
    assert stats(a)["probes"] == 1  # the next one is a minute away
    assert "sk-probe-secret" not in httpx.get(router.url + "/admin/backends").text
    assert "sk-probe-secret" not in router.log()


async def _load(
    url: str, stop: asyncio.Event, outcomes: Counter[str], workers: int, tokens: int
) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=15)

    async def worker() -> None:
        while not stop.is_set():
            started = False
            text = ""
            try:
                stream = await client.chat.completions.create(model="m", messages=MSG, stream=True)
                started = True
                async for c in stream:
                    if c.choices:
                        text += c.choices[0].delta.content or ""
            except openai.APIError:
                outcomes["ended_mid_stream" if started else "failed"] += 1
                continue
            outcomes["ok" if text == expected_text(tokens) else "wrong_text"] += 1

    try:
        await asyncio.gather(*(worker() for _ in range(workers)))
    finally:
        await client.close()


@pytest.mark.slow
def test_kill9_under_load_ejects_and_restart_readmits(procs: Cluster) -> None:
    tokens, workers, itl_ms = 16, 8, 25  # ~0.4 s streams: several are on c when it dies
    mocks = {n: procs.mock(n, tokens=tokens, itl_ms=itl_ms) for n in "abc"}
    router = procs.router(
        {
            "backends": [backend(n, m) for n, m in mocks.items()],
            "health": FAST_HEALTH,
            "timeouts": {"connect": 1, "read": 5},
        }
    )
    c_port = mocks["c"].port
    outcomes: Counter[str] = Counter()
    figures: dict[str, float] = {}

    async def scenario() -> None:
        stop = asyncio.Event()
        load = asyncio.ensure_future(_load(router.url, stop, outcomes, workers, tokens))
        try:
            # Steady state over three backends: every worker has finished a stream.
            await asyncio.to_thread(
                wait_for,
                lambda: outcomes["ok"] >= workers and stats(mocks["c"])["requests"] > 0,
                10,
            )
            assert stats(mocks["c"])["requests"] > 0
            await asyncio.to_thread(mocks["c"].kill9)
            figures["ejected_s"] = await asyncio.to_thread(
                wait_for, lambda: rows(router)["c"]["healthy"] is False, 10
            )
            # Keep the load on while c is gone: every worker finishes two more streams.
            ok = outcomes["ok"]
            await asyncio.to_thread(wait_for, lambda: outcomes["ok"] >= ok + 2 * workers, 10)
            c2 = await asyncio.to_thread(procs.mock, "c", c_port, 0, itl_ms, tokens)
            figures["back_s"] = await asyncio.to_thread(
                wait_for, lambda: stats(c2)["requests"] > 0, 10
            )
            ok = outcomes["ok"]  # and one more stream each once it is back
            await asyncio.to_thread(wait_for, lambda: outcomes["ok"] >= ok + workers, 10)
        finally:
            stop.set()
            await asyncio.wait_for(load, 30)

    asyncio.run(scenario())
    total = outcomes.total()
    print(
        f"\nkill -9 under load: {total} requests, {outcomes['failed']} failed before streaming, "
        f"{outcomes['ended_mid_stream']} streams already on it ended with the error event, "
        f"{outcomes['wrong_text']} wrong texts; ejected after {figures['ejected_s']:.2f}s "
        f"(bound 1.5s), traffic again {figures['back_s']:.2f}s after restart (bound 2.0s)"
    )
    # Out once, back once: by the outlier detector's run of failed attempts (`ejected`), and
    # by the probes (`unhealthy`, also while ejected), or by the probes alone where a starved
    # load generator sent too few requests to c for a run of failures.
    events = [
        e["event"]
        for line in router.log().splitlines()
        if line.startswith("{") and (e := json.loads(line)).get("backend") == "c" and "event" in e
    ]
    assert "ejected" in events or "unhealthy" in events, events
    for loss, back in (("ejected", "ejection over"), ("unhealthy", "healthy")):
        assert events.count(loss) <= 1, events
        assert loss not in events or events[events.index(loss) :].count(back) == 1, events
    assert outcomes["failed"] == 0, outcomes
    assert outcomes["wrong_text"] == 0, outcomes
    assert outcomes["ended_mid_stream"] <= workers, outcomes
    assert outcomes["ok"] > 3 * workers, outcomes
    # interval x unhealthy_threshold, and healthy_threshold x interval + 1 s; +1 s of slack for a
    # shared 2-core machine (the measured figures are printed above).
    assert figures["ejected_s"] <= 0.5 * 3 + 1.0
    assert figures["back_s"] <= 2 * 0.5 + 1 + 1.0


def test_monitor_probes_added_backends_at_once_and_stops_for_removed(procs: Cluster) -> None:
    from health.monitor import HealthMonitor
    from health.state import HealthBook
    from router.core.backend import Backend
    from router.core.settings import BackendConfig, HealthConfig

    a, b = procs.mock("a"), procs.mock("b")
    for m in (a, b):
        control(m, reset_stats=True)
    ba, bb = (Backend.from_config(BackendConfig(**backend(n, m))) for n, m in (("a", a), ("b", b)))

    async def main() -> None:
        book = HealthBook(HealthConfig(interval=30.0))
        monitor = HealthMonitor(book)
        book.sync([ba])
        monitor.sync([ba])
        await monitor.start()
        try:
            await asyncio.to_thread(wait_for, lambda: stats(a)["probes"] >= 1, 5)
            assert stats(b)["probes"] == 0
            book.sync([bb])
            monitor.sync([bb])  # b added, a removed
            # At once: the next round would be 30 s away.
            await asyncio.to_thread(wait_for, lambda: stats(b)["probes"] >= 1, 10)
            assert monitor.probing() == {"b"}  # a's task is gone
            # The mock counts a probe when it arrives; the book records it once answered.
            await wait_for_async(
                lambda: book.describe("b")["last_probe_latency_ms"] is not None,
                "b's answered probe recorded in the book",
            )
        finally:
            await monitor.aclose()

    asyncio.run(main())
