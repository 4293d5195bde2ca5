"""The admin API on a real router: auth on every route, register/route, aliases, drain, delete."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.support.harness import Cluster, Proc, backend, control, stats
from tests.support.wait import wait_for

TOKEN = "admin-token-for-tests"
RIGHT = {"authorization": f"Bearer {TOKEN}"}
WRONG = {"authorization": "Bearer not-the-token"}


def text(n: int) -> str:
    return "".join(f"tok{i} " for i in range(n))


def sdk(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def admin(router: Proc, method: str, path: str = "", **kw: Any) -> httpx.Response:
    kw.setdefault("headers", RIGHT)
    return httpx.request(method, router.url + "/admin/backends" + path, timeout=30, **kw)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"}
    if code is not None:
        assert err["code"] == code
    return str(err["message"])


@pytest.fixture(scope="module")
def mocks(module_procs: Cluster) -> dict[str, Proc]:
    return {"a": module_procs.mock("a", tokens=6), "b": module_procs.mock("b", tokens=6)}


@pytest.fixture(autouse=True)
def _reset(request: pytest.FixtureRequest) -> None:
    if "mocks" in request.fixturenames or "two" in request.fixturenames:
        for mock in request.getfixturevalue("mocks").values():
            control(mock, reset_stats=True, tokens=6, itl_ms=0, ttft_ms=0)


def test_every_admin_route_needs_the_token(procs: Cluster, mocks: dict[str, Proc]) -> None:
    a, b = mocks["a"], mocks["b"]
    router = procs.router({"backends": [backend("a", a)]}, env={"SLUICEGATE_ADMIN_TOKEN": TOKEN})
    new = backend("n1", b, {"n": "mock-model"})
    calls: list[tuple[str, str, dict[str, Any], int]] = [
        ("GET", "", {}, 200),
        ("GET", "/a", {}, 200),
        ("POST", "", {"json": new}, 201),
        ("PATCH", "/n1", {"json": {"weight": 3}}, 200),
        ("DELETE", "/n1", {}, 200),
    ]
    for method, path, kw, ok in calls:
        for headers, code in (
            ({}, "missing_admin_token"),
            (WRONG, "invalid_admin_token"),
            ({"authorization": f"Basic {TOKEN}"}, "missing_admin_token"),
            ({"authorization": f"Bearer {TOKEN}x"}, "invalid_admin_token"),
        ):
            r = admin(router, method, path, headers=headers, **kw)
            assert_openai_error(r, 401, code)
            assert r.headers["www-authenticate"] == "Bearer"
        r = admin(router, method, path, **kw)
        assert r.status_code == ok, (method, path, r.text)
    # The refused calls changed nothing: n1 was created once, patched once, deleted once.
    assert [b["name"] for b in admin(router, "GET").json()] == ["a"]


@pytest.mark.parametrize("env", [{}, {"SLUICEGATE_ADMIN_TOKEN": ""}], ids=["unset", "empty"])
def test_without_a_token_changes_are_off_and_reads_on(
    procs: Cluster, mocks: dict[str, Proc], env: dict[str, str]
) -> None:
    a = mocks["a"]
    router = procs.router({"backends": [backend("a", a)]}, env=env)
    assert admin(router, "GET", headers={}).status_code == 200
    assert admin(router, "GET", "/a", headers={}).status_code == 200
    for method, path, kw in (
        ("POST", "", {"json": backend("x", a)}),
        ("PATCH", "/a", {"json": {"weight": 2}}),
        ("DELETE", "/a", {}),
    ):
        for headers in ({}, RIGHT):
            r = admin(router, method, path, headers=headers, **kw)
            msg = assert_openai_error(r, 403, "admin_disabled")
            assert "SLUICEGATE_ADMIN_TOKEN" in msg
    assert admin(router, "GET", "/a", headers={}).json()["weight"] == 1.0


@pytest.fixture
def two(procs: Cluster, mocks: dict[str, Proc]) -> dict[str, Proc]:
    a, b = mocks["a"], mocks["b"]
    router = procs.router(
        {
            "backends": [backend("a", a, {"m": "mock-model"})],
            "balancer": "round_robin",
            # No probes: their client's connections would blur the pool checks below.
            "health": {"enabled": False},
        },
        env={"SLUICEGATE_ADMIN_TOKEN": TOKEN},
    )
    return {"a": a, "b": b, "router": router}


def test_register_over_the_api_and_route_to_it(two: dict[str, Proc]) -> None:
    router, b = two["router"], two["b"]
    with pytest.raises(openai.NotFoundError):
        sdk(router).chat.completions.create(model="public-b", messages=[])
    r = admin(router, "POST", json=backend("b", b, {"public-b": "b-own-id"}, weight=2))
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["name"] == "b" and body["source"] == "api" and body["weight"] == 2
    assert body["models"] == {"public-b": "b-own-id"}
    assert admin(router, "GET", "/b").json()["url"] == b.url

    ids = {m.id for m in sdk(router).models.list()}
    assert ids == {"m", "public-b"}
    stream = sdk(router).chat.completions.create(model="public-b", messages=[], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text(6)
    seen = stats(b)["recent"]
    assert len(seen) == 1 and seen[0]["model"] == "b-own-id"


def test_an_alias_reaches_every_backend_that_serves_it(two: dict[str, Proc]) -> None:
    router, a, b = two["router"], two["a"], two["b"]
    r = admin(router, "POST", json=backend("b", b, {"m": "b-model", "only-b": "b-model"}))
    assert r.status_code == 201
    for _ in range(6):
        out = sdk(router).completions.create(model="m", prompt="x", max_tokens=2)
        assert out.choices[0].text == text(2)
    models_a = [rec["model"] for rec in stats(a)["recent"]]
    models_b = [rec["model"] for rec in stats(b)["recent"]]
    assert models_a == ["mock-model"] * 3
    assert models_b == ["b-model"] * 3


def test_validation_duplicates_and_unknown_names(two: dict[str, Proc]) -> None:
    router, b = two["router"], two["b"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({**backend("x", b), "url": "ftp://nowhere"}, "url"),
        ({**backend("x", b), "weight": -1}, "weight"),
        ({**backend("x", b), "colour": "red"}, "colour"),
        ({"name": "x", "url": b.url}, "models"),
        ({**backend("x", b), "models": []}, "models"),
        ({**backend("x", b), "kind": "azure"}, "kind"),
        ({**backend("bad name!", b)}, "name"),
        ({**backend("x", b), "api_key_env": "NO_SUCH_VARIABLE_SET"}, "api_key_env"),
    ]
    for body, field in cases:
        msg = assert_openai_error(admin(router, "POST", json=body), 400, "invalid_field")
        assert msg.startswith(field), (field, msg)
    r = admin(router, "POST", content=b"{not json", headers={**RIGHT, "content-type": "x"})
    assert assert_openai_error(r, 400).startswith("body")
    assert assert_openai_error(admin(router, "POST", json=[1]), 400).startswith("body")

    assert_openai_error(admin(router, "POST", json=backend("a", b)), 409, "backend_exists")
    assert admin(router, "POST", json=backend("x", b)).status_code == 201
    assert_openai_error(admin(router, "POST", json=backend("x", b)), 409, "backend_exists")

    for method, kw in (("GET", {}), ("PATCH", {"json": {"weight": 2}}), ("DELETE", {})):
        assert_openai_error(admin(router, method, "/nope", **kw), 404, "backend_not_found")
    for patch, field in (
        ({"url": "http://127.0.0.1:1"}, "url"),
        ({"weight": 0}, "weight"),
        ({"draining": "yes"}, "draining"),
        ({"max_inflight": 0}, "max_inflight"),
        ({"models": {}}, "models"),
    ):
        msg = assert_openai_error(admin(router, "PATCH", "/x", json=patch), 400, "invalid_field")
        assert msg.startswith(field), (field, msg)
    # Refused changes left both entries as they were.
    assert admin(router, "GET", "/x").json()["weight"] == 1.0
    assert admin(router, "GET", "/a").json()["models"] == {"m": "mock-model"}


def test_patch_a_file_entry_and_an_api_entry(two: dict[str, Proc]) -> None:
    router, b = two["router"], two["b"]
    r = admin(router, "PATCH", "/a", json={"weight": 5, "models": ["m", "m2"], "max_inflight": 7})
    assert r.status_code == 200, r.text
    got = r.json()
    assert (got["weight"], got["max_inflight"], got["source"]) == (5, 7, "file")
    assert got["models"] == {"m": "m", "m2": "m2"}
    admin(router, "POST", json=backend("b", b))
    r = admin(router, "PATCH", "/b", json={"max_inflight": None, "weight": 0.5})
    assert (r.json()["weight"], r.json()["max_inflight"]) == (0.5, None)
    assert {m.id for m in sdk(router).models.list()} == {"m", "m2"}


def _stream_in_thread(router: Proc, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            stream = sdk(router).chat.completions.create(model="m", messages=[], stream=True)
            out["text"] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            out["ended"] = time.monotonic()
        except Exception as exc:  # reported by the assertion on out["text"]
            out["error"] = repr(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def established_to(port: int) -> int:
    """Open TCP connections to a loopback port, as the kernel lists them (IPv4)."""
    count = 0
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            remote, state = fields[2], fields[3]
            if state == "01" and int(remote.split(":")[1], 16) == port:
                count += 1
    return count


def _wait_running(mock: Proc, n: int) -> None:
    wait_for(lambda: stats(mock)["running"] == n, f"{mock.url} with {n} running")


def test_drain_and_delete_with_a_stream_in_flight(two: dict[str, Proc]) -> None:
    router, a, b = two["router"], two["a"], two["b"]
    admin(router, "POST", json=backend("b", b))
    # 40 tokens 50 ms apart: the stream lasts ~2 s, long enough to act while it runs.
    control(b, tokens=40, itl_ms=50)

    # Drain a: everything goes to b.
    r = admin(router, "PATCH", "/a", json={"draining": True})
    assert r.json()["draining"] is True
    out: dict[str, Any] = {}
    t = _stream_in_thread(router, out)
    _wait_running(b, 1)
    assert established_to(b.port) >= 1

    # Put a back and delete b while its stream runs.
    admin(router, "PATCH", "/a", json={"draining": False})
    deleted: dict[str, Any] = {}

    def delete() -> None:
        started = time.monotonic()
        deleted["response"] = admin(router, "DELETE", "/b")
        deleted["seconds"] = time.monotonic() - started

    d = threading.Thread(target=delete, daemon=True)
    d.start()
    wait_for(lambda: admin(router, "GET", "/b").json().get("draining") is True, "b draining", 5)
    # New requests while b drains go elsewhere.
    for _ in range(4):
        assert sdk(router).completions.create(model="m", prompt="x", max_tokens=2)
    assert stats(b)["requests"] == 1
    assert stats(a)["requests"] == 4

    t.join(15)
    d.join(15)
    assert out.get("text") == text(40), out
    resp = deleted["response"]
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"name": "b", "deleted": True, "in_flight_at_removal": 0}
    assert stats(b)["completed"] == 1 and stats(b)["aborted"] == 0
    assert deleted["seconds"] > 0.5  # it waited for the stream rather than cutting it
    assert_openai_error(admin(router, "GET", "/b"), 404)
    assert [x["name"] for x in admin(router, "GET").json()] == ["a"]
    assert sdk(router).completions.create(model="m", prompt="x", max_tokens=1)
    assert stats(b)["requests"] == 1
    # The deleted backend's pool is closed once its stream ended (swept every second); sooner
    # than the mock's own 5 s keep-alive timeout would close it.
    end = out["ended"] + 3
    while established_to(b.port):
        assert time.monotonic() < end, "the deleted backend's connections stayed open"
        time.sleep(0.05)


def test_deleting_a_file_entry_without_redis_lasts_until_restart(
    procs: Cluster, mocks: dict[str, Proc]
) -> None:
    a, b = mocks["a"], mocks["b"]
    config = {"backends": [backend("a", a), backend("b", b)]}
    env = {"SLUICEGATE_ADMIN_TOKEN": TOKEN}
    router = procs.router(config, env=env)
    assert admin(router, "DELETE", "/b").status_code == 200
    assert [x["name"] for x in admin(router, "GET").json()] == ["a"]
    assert admin(router, "GET", "/a").json()["registry_store"] == "local"
    router.stop()
    again = procs.router(config, env=env)
    assert [x["name"] for x in admin(again, "GET").json()] == ["a", "b"]


def test_all_backends_draining_is_503(two: dict[str, Proc]) -> None:
    router = two["router"]
    admin(router, "PATCH", "/a", json={"draining": True})
    with pytest.raises(openai.InternalServerError) as info:
        sdk(router).completions.create(model="m", prompt="x", max_tokens=1)
    assert info.value.status_code == 503
    admin(router, "PATCH", "/a", json={"draining": False})
    assert sdk(router).completions.create(model="m", prompt="x", max_tokens=1)
