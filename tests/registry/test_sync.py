"""One registry across replicas: router processes sharing one real redis-server see each other's
changes within 2 s (pub/sub, and the periodic resync when a message is lost), keep them across
restarts, and agree on who wins a race."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.support.harness import Cluster, Proc, backend, stats
from tests.support.wait import wait_for

pytestmark = pytest.mark.redis

TOKEN = "admin-token-for-redis-tests"
RIGHT = {"authorization": f"Bearer {TOKEN}"}
# Pub/sub is immediate; a lost message is caught by the periodic resync (`registry_resync`,
# 1 s by default): twice that.
PROPAGATION_S = 2 * 1.0


def admin(router: Proc, method: str, path: str = "", **kw: Any) -> httpx.Response:
    # A fresh connection per call: with several workers each call may land on another one.
    return httpx.request(
        method, router.url + "/admin/backends" + path, headers=RIGHT, timeout=30, **kw
    )


def names(router: Proc) -> list[str]:
    r = admin(router, "GET")
    assert r.status_code == 200, r.text
    return [b["name"] for b in r.json()]


def seen_within(check: Callable[[], bool], seconds: float = PROPAGATION_S) -> float:
    """Seconds until check() held; fails when it did not within `seconds`."""
    start = time.monotonic()
    while True:
        if check():
            return time.monotonic() - start
        assert time.monotonic() - start < seconds, f"not seen within {seconds}s"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def shared(module_procs: Cluster) -> dict[str, Any]:
    r = module_procs.redis()
    a = module_procs.mock("a", tokens=4)
    b = module_procs.mock("b", tokens=4)
    config = {"backends": [backend("a", a, {"m": "mock-model"})]}
    env = {"SLUICEGATE_ADMIN_TOKEN": TOKEN, "SLUICEGATE_REDIS_URL": r.url}
    return {"redis": r, "a": a, "b": b, "config": config, "env": env}


@pytest.fixture(autouse=True)
def _empty_registry(request: pytest.FixtureRequest) -> None:
    if "shared" in request.fixturenames:
        url = request.getfixturevalue("shared")["redis"].url
        with redis.Redis.from_url(url) as client:
            client.flushdb()


def start_router(procs: Cluster, shared: dict[str, Any], workers: int = 1) -> Proc:
    return procs.router(shared["config"], env=shared["env"], workers=workers)


def test_two_replicas_see_each_others_changes(procs: Cluster, shared: dict[str, Any]) -> None:
    r1 = start_router(procs, shared)
    r2 = start_router(procs, shared)
    b = shared["b"]
    lags: list[float] = []

    assert admin(r1, "POST", json=backend("b", b, {"mb": "mock-model"})).status_code == 201
    lags.append(seen_within(lambda: "b" in names(r2)))
    client = openai.OpenAI(base_url=r2.url + "/v1", api_key="x", max_retries=0)
    before = stats(b)["requests"]
    assert (
        client.completions.create(model="mb", prompt="x").choices[0].text == "tok0 tok1 tok2 tok3 "
    )
    assert stats(b)["requests"] == before + 1

    assert admin(r2, "PATCH", "/b", json={"weight": 4}).status_code == 200
    lags.append(seen_within(lambda: admin(r1, "GET", "/b").json()["weight"] == 4))
    assert admin(r1, "PATCH", "/a", json={"draining": True}).status_code == 200
    lags.append(seen_within(lambda: admin(r2, "GET", "/a").json()["draining"] is True))

    assert admin(r2, "DELETE", "/b").status_code == 200
    lags.append(seen_within(lambda: "b" not in names(r1)))
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=r1.url + "/v1", api_key="x", max_retries=0).completions.create(
            model="mb", prompt="x"
        )
    print(f"propagation seconds: {[round(x, 3) for x in lags]}")


def test_changes_survive_a_restart_and_reach_a_restarted_replica(
    procs: Cluster, shared: dict[str, Any]
) -> None:
    r1 = start_router(procs, shared)
    r2 = start_router(procs, shared)
    assert (
        admin(r1, "POST", json=backend("b", shared["b"], {"mb": "mock-model"})).status_code == 201
    )
    assert admin(r1, "PATCH", "/a", json={"weight": 9}).status_code == 200
    r1.stop()
    # Changed while r1 is down: it must find these when it comes back.
    assert (
        admin(r2, "POST", json=backend("c", shared["b"], {"mc": "mock-model"})).status_code == 201
    )
    assert admin(r2, "DELETE", "/b").status_code == 200

    back = start_router(procs, shared)
    assert names(back) == ["a", "c"]
    assert admin(back, "GET", "/a").json()["weight"] == 9
    assert admin(back, "GET", "/c").json()["source"] == "api"
    # And the restarted one is a full member again: its changes reach r2.
    assert admin(back, "PATCH", "/c", json={"weight": 2}).status_code == 200
    seen_within(lambda: admin(r2, "GET", "/c").json()["weight"] == 2)


def test_a_lost_message_heals_within_two_seconds(procs: Cluster, shared: dict[str, Any]) -> None:
    r1 = start_router(procs, shared)
    r2 = start_router(procs, shared)
    with redis.Redis.from_url(shared["redis"].url) as client:
        # Both routers subscribe after they answer /healthz: wait until both have.
        wait_for(lambda: len(client.client_list(_type="pubsub")) >= 2, "both subscribed", 10)
        # Cut every subscriber: the change below is published to nobody.
        killed = client.client_kill_filter(_type="pubsub")
        assert killed >= 2
    assert admin(r1, "POST", json=backend("b", shared["b"])).status_code == 201
    lag = seen_within(lambda: "b" in names(r2))
    print(f"healed after {lag:.3f}s")


def test_a_change_never_published_is_picked_up_by_the_resync(
    procs: Cluster, shared: dict[str, Any]
) -> None:
    r1 = start_router(procs, shared)
    r2 = start_router(procs, shared)
    # A change whose message nobody got: written and counted, never published.
    record = {"config": backend("quiet", shared["b"])}
    with redis.Redis.from_url(shared["redis"].url) as client:
        client.hset("{sluicegate:registry}:records", "quiet", json.dumps(record))
        client.incr("{sluicegate:registry}:version")
    lags = [seen_within(lambda r=r: "quiet" in names(r)) for r in (r1, r2)]
    print(f"resync picked it up after {[round(x, 3) for x in lags]}s")


def test_every_worker_sees_a_change(procs: Cluster, shared: dict[str, Any]) -> None:
    r1 = start_router(procs, shared)
    many = start_router(procs, shared, workers=2)

    def started() -> set[int]:
        return {
            json.loads(line)["pid"]
            for line in many.log().splitlines()
            if line.startswith("{") and '"started"' in line
        }

    # /healthz answered from one worker; the other may still be starting on a busy machine (it
    # loads the registry at its start, and logs no change then): the change comes after both.
    wait_for(lambda: len(started()) == 2, "both workers started", within=60)
    assert admin(r1, "POST", json=backend("b", shared["b"])).status_code == 201

    def workers_with_b() -> set[int]:
        pids = set()
        for line in many.log().splitlines():
            if line.startswith("{") and '"registry changed"' in line:
                entry = json.loads(line)
                if "b" in entry["backends"]:
                    pids.add(entry["pid"])
        return pids

    seen_within(lambda: len(workers_with_b()) == 2)
    for _ in range(20):
        assert "b" in names(many)


def _race(r1: Proc, r2: Proc, body: dict[str, Any]) -> list[int]:
    statuses: list[int] = []
    go = threading.Barrier(2)

    def post(router: Proc, url: str) -> None:
        go.wait(5)
        statuses.append(admin(router, "POST", json={**body, "url": url}).status_code)

    threads = [
        threading.Thread(target=post, args=(r1, "http://127.0.0.1:9")),
        threading.Thread(target=post, args=(r2, "http://127.0.0.2:9")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return statuses


def test_a_race_for_one_name_has_one_winner(procs: Cluster, shared: dict[str, Any]) -> None:
    r1 = start_router(procs, shared)
    r2 = start_router(procs, shared)
    for round_ in range(5):
        name = f"race{round_}"
        assert sorted(_race(r1, r2, backend(name, shared["b"]))) == [201, 409]
        seen_within(
            lambda name=name: _url(r1, name) is not None and _url(r1, name) == _url(r2, name)
        )


def _url(router: Proc, name: str) -> str | None:
    # The loser may not have heard of the winner yet: a 404 here means "not yet", not a failure.
    r = admin(router, "GET", f"/{name}")
    return str(r.json()["url"]) if r.status_code == 200 else None


def test_changes_are_refused_while_redis_is_down_and_resume_after(
    procs: Cluster, shared: dict[str, Any]
) -> None:
    own_redis = procs.redis()
    env = {**shared["env"], "SLUICEGATE_REDIS_URL": own_redis.url}
    router = procs.router(shared["config"], env=env)
    assert admin(router, "POST", json=backend("b", shared["b"])).status_code == 201
    port = own_redis.port
    own_redis.stop()
    r = admin(router, "POST", json=backend("c", shared["b"]))
    assert r.status_code == 503 and r.json()["error"]["code"] == "registry_unavailable"
    # Routing keeps working on the last known set.
    assert names(router) == ["a", "b"]
    assert redis_url_absent(r.text, own_redis.url)
    procs.redis(port=port)  # empty: nothing was saved
    seen_within(lambda: names(router) == ["a"], seconds=10)
    assert admin(router, "POST", json=backend("c", shared["b"])).status_code == 201


def redis_url_absent(text: str, url: str) -> bool:
    return url not in text and "127.0.0.1:" not in text
