"""Poisoned backend definitions are refused at the edge, from every source, and a bad record that
reached Redis anyway is skipped (logged, counted) without crashing or blocking any replica.

The admin cases run as the issue reproduced them: Redis and two router replicas; after each
rejected call nothing is stored, both replicas still apply a PATCH, and a new replica starts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis
from pydantic import ValidationError

from router.core.backend import Backend
from router.core.settings import BackendConfig, ConfigError, load_settings
from tests.support.harness import STARVED_S, Cluster, Proc, backend
from tests.support.wait import wait_for

TOKEN = "admin-token-for-edge-tests"
AUTH = {"authorization": f"Bearer {TOKEN}"}
RECORDS = "{sluicegate:registry}:records"

# (what is wrong, the fields to set, the field the error must name)
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("non-Latin-1 header value", {"headers": {"x-team": "caf€"}}, "headers"),
    ("CR/LF in a header value", {"headers": {"x-team": "a\r\nx-evil: 1"}}, "headers"),
    ("header name not a token", {"headers": {"x team:": "a"}}, "headers"),
    ("framing header", {"headers": {"content-length": "0"}}, "headers"),
    ("hop-by-hop header", {"headers": {"Transfer-Encoding": "chunked"}}, "headers"),
    ("host header", {"headers": {"host": "elsewhere"}}, "headers"),
    ("CR/LF in the URL", {"url": "http://127.0.0.1:9/v\r\nx-evil: 1"}, "url"),
    ("NUL in the URL", {"url": "http://127.0.0.1:9/\x00"}, "url"),
    ("port out of range", {"url": "http://127.0.0.1:99999"}, "url"),
    ("port zero", {"url": "http://127.0.0.1:0"}, "url"),
    ("credentials in the URL", {"url": "http://user:hunter22@127.0.0.1:9"}, "url"),
    ("CR/LF in the key", {"api_key": "sk-abc\r\nx-evil: 1"}, "api_key"),
    ("non-Latin-1 key", {"api_key": "sk-€€€€€€€€"}, "api_key"),
    ("key header not a token", {"key_header": "x-key\r\nx-evil"}, "key_header"),
    ("key header reserved", {"key_header": "content-length"}, "key_header"),
]


def base(**extra: Any) -> dict[str, Any]:
    return {"name": "x", "url": "http://127.0.0.1:9", "models": ["m"], **extra}


@pytest.mark.parametrize(("what", "fields", "field"), BAD, ids=[b[0] for b in BAD])
def test_backend_config_refuses(what: str, fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        BackendConfig.model_validate(base(**fields))
    err = info.value.errors()[0]
    assert err["loc"][0] == field
    # The message never quotes the offending value (it may be a secret).
    assert "evil" not in str(err["msg"]) and "hunter22" not in str(err["msg"])


def test_ordinary_values_pass() -> None:
    cfg = BackendConfig.model_validate(
        base(
            url="https://[::1]:8443/openai",
            headers={"x-ms-client-request-source": "sluicegate", "x-tag": "naïve\tvalue"},
            api_key="sk-abcdef123456",
            key_header="api-key",
        )
    )
    b = Backend.from_config(cfg)
    assert (b"x-tag", "naïve\tvalue".encode("latin-1")) in b.auth_headers
    assert (b"api-key", b"sk-abcdef123456") in b.auth_headers


def test_from_config_gives_a_value_error_never_an_encode_error() -> None:
    unchecked = BackendConfig.model_construct(**{**BackendConfig(**base()).__dict__})
    object.__setattr__(unchecked, "headers", {"x-team": "caf€"})
    with pytest.raises(ValueError, match=r"headers\.x-team") as info:
        Backend.from_config(unchecked)
    assert not isinstance(info.value, UnicodeEncodeError)


def test_yaml_file_and_environment_name_the_field(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        json.dumps({"backends": [base(headers={"x-team": "caf€"})]}, ensure_ascii=False),
        encoding="utf-8",
    )
    with pytest.raises(ConfigError, match=r"backends\[0\]\(x\)\.headers"):
        load_settings(path)
    path.write_text(json.dumps({"backends": [base(url="http://h:99999")]}))
    with pytest.raises(ConfigError, match=r"backends\[0\]\(x\)\.url: .*port"):
        load_settings(path)
    # A key read from the environment is checked like one written in the file.
    monkeypatch.setenv("EDGE_TEST_KEY", "sk-abc\r\nx-evil: 1")
    path.write_text(json.dumps({"backends": [base(api_key_env="EDGE_TEST_KEY")]}))
    with pytest.raises(ConfigError, match="api_key_env"):
        load_settings(path)
    monkeypatch.delenv("EDGE_TEST_KEY")
    monkeypatch.setenv("SLUICEGATE_BACKENDS", json.dumps([base(headers={"content-length": "0"})]))
    with pytest.raises(ConfigError, match="headers"):
        load_settings()


# -- Redis and two replicas --------------------------------------------------------------------


def admin(router: Proc, method: str, path: str = "", **kw: Any) -> httpx.Response:
    return httpx.request(
        method, router.url + "/admin/backends" + path, headers=AUTH, timeout=30, **kw
    )


def within(check: Callable[[], bool], seconds: float = 3.0) -> None:
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, "not seen in time"
        time.sleep(0.02)


def weight_of(router: Proc, name: str) -> float:
    return float(admin(router, "GET", "/" + name).json()["weight"])


def invalid_records_metric(router: Proc) -> float:
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    for line in text.splitlines():
        if line.startswith("sluicegate_registry_invalid_records_total "):
            return float(line.split()[1])
    raise AssertionError("sluicegate_registry_invalid_records_total not exported")


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Any]:
    r = module_procs.redis()
    a = module_procs.mock("a", tokens=2)
    config = {"backends": [backend("a", a, {"m": "mock-model"})]}
    env = {"SLUICEGATE_ADMIN_TOKEN": TOKEN, "SLUICEGATE_REDIS_URL": r.url}
    r1 = module_procs.router(config, env=env)
    r2 = module_procs.router(config, env=env)
    return {"redis": r, "a": a, "config": config, "env": env, "replicas": [r1, r2]}


def patch_reaches_both(fleet: dict[str, Any], weight: float) -> None:
    r1, r2 = fleet["replicas"]
    assert admin(r1, "PATCH", "/a", json={"weight": weight}).status_code == 200
    within(lambda: weight_of(r2, "a") == weight)
    assert weight_of(r1, "a") == weight


def test_rejected_admin_calls_store_nothing_and_break_nothing(
    fleet: dict[str, Any], module_procs: Cluster
) -> None:
    r1 = fleet["replicas"][0]
    store = redis.Redis.from_url(fleet["redis"].url)
    for i, (what, fields, field) in enumerate(BAD):
        body = backend("bad", fleet["a"], {"mb": "mock-model"}, **fields)
        r = admin(r1, "POST", json=body)
        assert r.status_code == 400, (what, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_field"
        assert err["message"].startswith(field), (what, err["message"])
        assert store.hget(RECORDS, "bad") is None, what
        patch_reaches_both(fleet, float(i + 2))
    # Patches take the same checks: nothing stored, the backend unchanged.
    assert admin(r1, "PATCH", "/a", json={"models": {"m": ""}}).status_code == 400
    # A new replica starts on what is stored and routes.
    r3 = module_procs.router(fleet["config"], env=fleet["env"])
    assert weight_of(r3, "a") == float(len(BAD) + 1)
    client = openai.OpenAI(base_url=r3.url + "/v1", api_key="x", max_retries=0)
    assert client.completions.create(model="m", prompt="x").choices[0].text
    r3.stop()


def test_a_bad_record_in_redis_is_skipped_logged_and_counted(
    fleet: dict[str, Any], module_procs: Cluster
) -> None:
    r1, r2 = fleet["replicas"]
    store = redis.Redis.from_url(fleet["redis"].url)
    before = invalid_records_metric(r2)
    good = backend("good", fleet["a"], {"mg": "mock-model"})
    # As an older version or a hand edit could have left them: each would have crashed startup.
    store.hset(
        RECORDS,
        "euro",
        json.dumps({"config": {**good, "name": "euro", "headers": {"x-team": "caf€"}}}),
    )
    store.hset(
        RECORDS,
        "crlf",
        json.dumps({"config": {**good, "name": "crlf", "url": "http://127.0.0.1:9/\r\n"}}),
    )
    store.hset(RECORDS, "junk", "{not json")
    store.incr("{sluicegate:registry}:version")
    store.publish("{sluicegate:registry}:changes", "euro")
    # Other changes still go through, on both replicas, and a new replica starts.
    assert admin(r1, "POST", json=good).status_code == 201
    within(lambda: "good" in [b["name"] for b in admin(r2, "GET").json()])
    names = [b["name"] for b in admin(r2, "GET").json()]
    assert "euro" not in names and "crlf" not in names and "junk" not in names
    patch_reaches_both(fleet, 42.0)
    assert invalid_records_metric(r2) >= before + 3
    # The log is written from its own queue: the line may land a moment after the count.
    wait_for(lambda: "skipping an invalid registry record" in r2.log(), "the record logged", 5)
    r3 = module_procs.router(fleet["config"], env=fleet["env"])
    assert sorted(b["name"] for b in admin(r3, "GET").json()) == ["a", "good"]
    assert invalid_records_metric(r3) == 3
    r3.stop()
    # The bad record can be removed over the API (nothing routes to it, so no drain wait).
    assert admin(r1, "DELETE", "/euro").status_code == 200
    assert store.hget(RECORDS, "euro") is None
    for name in ("crlf", "junk", "good"):
        store.hdel(RECORDS, name)
    assert all(p.alive() for p in fleet["replicas"])
