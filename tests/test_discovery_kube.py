"""Kubernetes discovery end to end: a real router process lists and watches EndpointSlices on a
fake API server (tests/fake_kube.py, the real wire protocol) through a kubeconfig file and the
real client library, and routes to real mock engines as pods scale, drain, vanish, and as the
API server loses events, expires versions and goes away."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.fake_kube import FakeKube, endpoint
from tests.harness import Cluster, Proc, control, free_port, stats

MODEL = "mock-model"


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKube]:
    fk = FakeKube(free_port(), bookmark_every=0.3)
    try:
        yield fk
    finally:
        fk.close()


@pytest.fixture(scope="module")
def mocks(module_procs: Cluster) -> dict[str, Proc]:
    return {n: module_procs.mock(n, tokens=4) for n in ("a", "b", "c")}


TOKEN = "admin-token-for-discovery"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def router(module_procs: Cluster, kube: FakeKube) -> Proc:
    """One router for every test here (starting one costs seconds). A 1 s resync: the lost
    DELETE heals fast, and re-lists keep failing while the API server is down."""
    return start_router(module_procs, kube, resync=1, env={"SLUICEGATE_ADMIN_TOKEN": TOKEN})


@pytest.fixture(autouse=True)
def _clean(kube: FakeKube, mocks: dict[str, Proc]) -> Iterator[None]:
    for m in mocks.values():
        control(m, reset_stats=True, tokens=4, itl_ms=0, ttft_ms=0)
    yield
    for ns, name in list(kube.slices):
        kube.delete_slice(name, ns)
    kube.up()  # a test that took the API server down gets it back


def put(kube: FakeKube, mock: Proc, name: str, silent: bool = False, **cond: Any) -> None:
    """One slice per mock: each has its own port (all mocks listen on 127.0.0.1)."""
    ports = [{"name": "http", "port": mock.port}]
    kube.put_slice(name, [endpoint("127.0.0.1", **cond)], ports, silent=silent)


def start_router(
    procs: Cluster,
    kube: FakeKube,
    resync: float = 300,
    env: dict[str, str] | None = None,
    **extra: Any,
) -> Proc:
    source = {
        "kind": "kubernetes",
        "namespace": "models",
        "service": "vllm",
        "port": "http",
        "models": "auto",
        "backend": {"max_inflight": 64},
        "resync": resync,
        "backoff_max": 0.5,
        "kubeconfig": str(kube.kubeconfig(procs.tmp / f"kubeconfig-{free_port()}")),
        **extra,
    }
    return procs.router(
        {
            "discovery": [source],
            "health": {"interval": 0.5, "timeout": 2, "unhealthy_threshold": 1},
            "drain_grace": 30,
        },
        env=env,
    )


def backends(router: Proc) -> dict[str, dict[str, Any]]:
    r = httpx.get(router.url + "/admin/backends", timeout=5, headers=AUTH)
    r.raise_for_status()
    return {b["url"]: b for b in r.json()}


def wait_for(check: Callable[[], bool], deadline: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < deadline:
        if check():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not within {deadline}s: {what}")


_CLIENTS: dict[str, openai.OpenAI] = {}


def chat(router: Proc, stream: bool = False) -> str:
    # One client per router, shared by threads: building one costs ~0.1 s of CPU.
    client = _CLIENTS.get(router.url)
    if client is None:
        client = _CLIENTS[router.url] = openai.OpenAI(
            base_url=router.url + "/v1", api_key="unused", max_retries=0
        )
    if stream:
        out = client.chat.completions.create(
            model=MODEL, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    return resp.choices[0].message.content or ""


def metric(router: Proc, name: str, **labels: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            got = head[len(name) :].strip("{}")
            if all(part in got.split(",") for part in want.split(",") if part):
                total += float(value)
    return total


def streams(router: Proc, n: int) -> tuple[list[threading.Thread], list[str], list[BaseException]]:
    done: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            done.append(chat(router, stream=True))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, done, errors


def test_scale_up_drain_and_removal_never_cut_a_stream(
    router: Proc, kube: FakeKube, mocks: dict[str, Proc]
) -> None:
    a, b = mocks["a"], mocks["b"]
    put(kube, a, "vllm-a")
    removed = metric(router, "sluicegate_discovery_events_total", event="removed")
    wait_for(lambda: a.url in backends(router), 10, "the first endpoint is discovered")
    assert backends(router)[a.url]["source"] == "kubernetes"
    assert backends(router)[a.url]["models"] == {MODEL: MODEL}  # models: auto asked it

    # Scale up: the new ready endpoint gets traffic within 2 s.
    put(kube, b, "vllm-b")
    t0 = time.monotonic()
    while stats(b)["requests"] == 0:
        chat(router)
        assert time.monotonic() - t0 < 2.0, "the new endpoint got no traffic within 2 s"

    # Terminating: 20 streams in flight on b all complete; no new request goes to b.
    for m in (a, b):
        control(m, itl_ms=100, tokens=30, reset_stats=True)
    threads, done, errors = streams(router, 40)
    wait_for(lambda: stats(a)["requests"] + stats(b)["requests"] == 40, 5, "40 streams started")
    on_b = stats(b)["requests"]
    assert on_b >= 15, (backends(router), stats(a)["requests"])  # about 20 on b
    control(a, itl_ms=0, tokens=4)  # the checks below need quick answers from a
    put(kube, b, "vllm-b", ready=False, serving=True, terminating=True)
    wait_for(lambda: backends(router)[b.url]["draining"], 2, "b draining")
    for _ in range(10):
        chat(router)
    assert stats(b)["requests"] == on_b, "a terminating endpoint got a new request"

    # Deleted while its streams run: it stays (draining) until they end, then goes.
    kube.delete_slice("vllm-b")
    time.sleep(0.3)
    assert b.url in backends(router), "removed while its streams were still running"
    for t in threads:
        t.join(30)
    assert errors == [] and len(done) == 40
    assert stats(b)["completed"] == on_b and stats(b)["aborted"] == 0
    wait_for(lambda: b.url not in backends(router), 3, "b removed after its streams ended")
    assert list(backends(router)) == [a.url]
    assert metric(router, "sluicegate_discovery_events_total", event="removed") == removed + 1
    assert metric(router, "sluicegate_discovery_backends", source="kubernetes") == 1


def test_410_gone_relists_without_duplicates_or_losses(
    router: Proc, kube: FakeKube, mocks: dict[str, Proc]
) -> None:
    a, b, c = mocks["a"], mocks["b"], mocks["c"]
    put(kube, a, "vllm-a")
    put(kube, b, "vllm-b")
    wait_for(lambda: set(backends(router)) == {a.url, b.url}, 10, "both discovered")
    lists = kube.requests.count("list")
    put(kube, c, "vllm-c", silent=True)  # only a re-list can show it
    kube.expire()  # the history is compacted: resuming the watch gets 410 Gone
    kube.drop_watches()
    wait_for(lambda: set(backends(router)) == {a.url, b.url, c.url}, 5, "c after the re-list")
    assert "410" in kube.requests and kube.requests.count("list") > lists
    r = httpx.get(router.url + "/admin/backends", timeout=5, headers=AUTH).json()
    assert len(r) == 3 and len({x["name"] for x in r}) == 3
    assert metric(router, "sluicegate_discovery_events_total", event="expired") >= 1


def test_api_server_down_under_load_removes_nothing_and_fails_nothing(
    router: Proc, kube: FakeKube, mocks: dict[str, Proc]
) -> None:
    a, b = mocks["a"], mocks["b"]
    put(kube, a, "vllm-a")
    put(kube, b, "vllm-b")
    errors_before = metric(router, "sluicegate_discovery_events_total", event="error")
    wait_for(lambda: set(backends(router)) == {a.url, b.url}, 10, "both discovered")
    stop = threading.Event()
    results: list[str] = []
    errors: list[BaseException] = []

    def load() -> None:
        while not stop.is_set():
            try:
                results.append(chat(router, stream=True))
            except BaseException as exc:
                errors.append(exc)

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        kube.down()
        # 3 s: several failed reconnects at the capped backoff (0.5 s here); the issue says
        # 10 s, the meaning (repeated API errors never shrink the fleet) holds at 3.
        end = time.monotonic() + 3
        while time.monotonic() < end:
            assert set(backends(router)) == {a.url, b.url}
            time.sleep(0.2)
        ready = httpx.get(router.url + "/readyz", timeout=5)
        assert ready.status_code == 200
        (src,) = ready.json()["discovery"]
        assert src["stale"] is True and src["backends"] == 2
        assert metric(router, "sluicegate_discovery_last_sync_seconds", source="kubernetes") > 2
        assert (
            metric(router, "sluicegate_discovery_events_total", event="error") >= errors_before + 2
        )
        kube.up()
        wait_for(
            lambda: not httpx.get(router.url + "/readyz").json()["discovery"][0]["stale"],
            5,
            "fresh again once the API server is back",
        )
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert errors == [] and len(results) > 20
    assert set(backends(router)) == {a.url, b.url}


def test_admin_patch_on_a_discovered_backend_survives_relists_and_a_lost_delete_heals(
    router: Proc, kube: FakeKube, mocks: dict[str, Proc]
) -> None:
    a, b = mocks["a"], mocks["b"]
    put(kube, a, "vllm-a")
    put(kube, b, "vllm-b")
    wait_for(lambda: set(backends(router)) == {a.url, b.url}, 10, "both discovered")
    name_b = backends(router)[b.url]["name"]
    patch = {"draining": True, "weight": 3}
    r = httpx.patch(router.url + f"/admin/backends/{name_b}", json=patch, headers=AUTH)
    assert r.status_code == 200, r.text
    lists = kube.requests.count("list")
    wait_for(lambda: kube.requests.count("list") >= lists + 2, 5, "two more re-lists")
    again = httpx.get(router.url + f"/admin/backends/{name_b}", headers=AUTH).json()
    assert again["draining"] is True and again["weight"] == 3 and again["source"] == "kubernetes"
    control(b, reset_stats=True)
    for _ in range(6):
        chat(router)
    assert stats(b)["requests"] == 0
    r = httpx.patch(
        router.url + f"/admin/backends/{name_b}", json={"draining": False}, headers=AUTH
    )
    assert r.status_code == 200

    # A DELETE lost while the watch was down: gone at the next full re-list.
    c = mocks["c"]
    put(kube, c, "vllm-c")
    wait_for(lambda: c.url in backends(router), 3, "c discovered")
    lists = kube.requests.count("list")
    kube.drop_watches()
    kube.delete_slice("vllm-c", silent=True)  # the DELETE event is lost
    wait_for(lambda: c.url not in backends(router), 3, "gone after the next full re-list")
    assert kube.requests.count("list") > lists  # a re-list, not the watch, removed it
    assert set(backends(router)) == {a.url, b.url}


def test_a_slice_without_the_named_port_keeps_its_last_endpoints(
    router: Proc, kube: FakeKube, mocks: dict[str, Proc]
) -> None:
    a = mocks["a"]
    put(kube, a, "vllm-a")
    wait_for(lambda: set(backends(router)) == {a.url}, 5, "a discovered")
    before = metric(router, "sluicegate_discovery_events_total", event="bad_port")
    kube.put_slice("vllm-a", [endpoint("127.0.0.1")], [{"name": "grpc", "port": 9}])
    wait_for(
        lambda: metric(router, "sluicegate_discovery_events_total", event="bad_port") > before,
        3,
        "the bad answer counted",
    )
    assert set(backends(router)) == {a.url}  # one bad answer never empties the fleet
    assert chat(router)
    assert "no such port" in router.log()
