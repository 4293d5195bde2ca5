"""The router's hop marker and its confined admin API, on a real router (2 workers).

Issue 22, defect 11: a backend pointing at the router looped 17+ hops; the admin API could make
the router send any of its environment variables, to any address (metadata, 0.0.0.0)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.harness import Cluster, Proc, backend, free_port, stats

TOKEN = "admin-token-hops"
RIGHT = {"authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    mock = module_procs.mock("m", tokens=2)
    # A second mock on another loopback address, which the policy below denies to the admin API.
    other = module_procs.mock("other", tokens=2, host="127.0.0.2")
    port = free_port()
    router = module_procs.router(
        {
            "backends": [
                backend("mock", mock),
                # Points back at the router itself: a loop waiting to happen.
                {"name": "self", "url": f"http://127.0.0.1:{port}", "models": ["loop"]},
            ],
            "health": {"enabled": False},
        },
        workers=2,
        port=port,
    )
    # Admin changes reach every worker only through Redis: one worker for the admin tests.
    single = module_procs.router(
        {
            "backends": [backend("file-other", other, {"other": "mock-model"})],
            "health": {"enabled": False},
            "admin": {"denied_backend_networks": ["169.254.0.0/16", "0.0.0.0/8", "127.0.0.2/32"]},
        },
        env={
            "SLUICEGATE_ADMIN_TOKEN": TOKEN,
            "BACKEND_KEY_HOPS": "backend-key-hops",
            "UNRELATED_SECRET": "do-not-send-me",
        },
    )
    return {"mock": mock, "other": other, "router": router, "admin": single}


def post(router: Proc, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    return httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def seen_hops(mock: Proc) -> list[str]:
    return [rec["headers"].get("x-sluicegate-hop") for rec in stats(mock)["recent"]]


def test_a_backend_pointing_at_the_router_is_refused_not_looped(fleet: dict[str, Proc]) -> None:
    r = post(fleet["router"], {**CHAT, "model": "loop"})
    assert r.status_code == 508, r.text
    assert r.json()["error"]["code"] == "loop_detected"
    assert r.headers["x-request-id"]
    metrics = httpx.get(fleet["router"].url + "/metrics", timeout=10).text
    assert "sluicegate_loops_refused_total" in metrics


def test_every_upstream_request_carries_one_marker_shared_by_the_workers(
    fleet: dict[str, Proc],
) -> None:
    router, mock = fleet["router"], fleet["mock"]
    for _ in range(12):  # a fresh connection each: both workers answer some
        assert post(router, CHAT).status_code == 200
    marks = seen_hops(mock)[-12:]
    assert len(set(marks)) == 1 and marks[0], marks
    own = marks[0]
    # A marker from another router in front is kept, and ours appended.
    assert post(router, CHAT, {"x-sluicegate-hop": "edge-router"}).status_code == 200
    assert seen_hops(mock)[-1] == f"edge-router, {own}"
    # A request that already passed us (in any position) is refused before any backend sees it.
    before = stats(mock)["requests"]
    for mark in (own, f"edge-router, {own.upper()}", f"a,{own},b"):
        r = post(router, CHAT, {"x-sluicegate-hop": mark})
        assert r.status_code == 508 and r.json()["error"]["code"] == "loop_detected", mark
    many = ", ".join(f"router-{i}" for i in range(8))
    r = post(router, CHAT, {"x-sluicegate-hop": many})
    assert r.status_code == 508 and r.json()["error"]["code"] == "too_many_hops"
    assert stats(mock)["requests"] == before


def admin_post(router: Proc, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(router.url + "/admin/backends", json=body, headers=RIGHT, timeout=30)


def test_admin_api_key_env_is_confined_to_the_prefix(fleet: dict[str, Proc]) -> None:
    router, mock = fleet["admin"], fleet["mock"]
    for name in ("UNRELATED_SECRET", "HOME", "PATH", "SLUICEGATE_ADMIN_TOKEN"):
        r = admin_post(router, {**backend("env-x", mock), "api_key_env": name})
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["message"].startswith("api_key_env"), name
        assert "do-not-send-me" not in r.text
    keyed = {**backend("env-ok", mock, {"keyed": "mock-model"}), "api_key_env": "BACKEND_KEY_HOPS"}
    r = admin_post(router, keyed)
    assert r.status_code == 201, r.text
    assert post(router, {**CHAT, "model": "keyed"}).status_code == 200
    assert stats(mock)["recent"][-1]["authorization"] == "Bearer backend-key-hops"


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254",
        "http://169.254.169.254:80/latest",
        "http://[::ffff:169.254.169.254]:80",
        "http://2852039166:80",  # the metadata address as one number: judged as resolved
        "http://0.0.0.0:8080",
        "http://0:8080",
        "http://127.0.0.2:9",  # denied by this router's admin.denied_backend_networks
    ],
)
def test_admin_urls_in_denied_networks_are_refused(fleet: dict[str, Proc], url: str) -> None:
    r = admin_post(fleet["admin"], {"name": "net-x", "url": url, "models": ["x"]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("url:")


def test_file_backends_are_the_operators_and_loopback_stays_allowed(
    fleet: dict[str, Proc],
) -> None:
    router, mock = fleet["admin"], fleet["mock"]
    # 127.0.0.2 is denied to the admin API here, not to the file's own entry.
    assert post(router, {**CHAT, "model": "other"}).status_code == 200
    r = admin_post(
        router, {"name": "by-name", "url": f"http://localhost:{mock.port}", "models": ["named"]}
    )
    assert r.status_code == 201, r.text
    assert post(router, {**CHAT, "model": "named"}).status_code == 200
