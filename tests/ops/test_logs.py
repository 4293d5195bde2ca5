"""Log capture: every line is JSON, one per request with its fields, and no backend key, admin
token or client key appears in any line, whatever the traffic did."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import openai
import pytest

from router.core.settings import load_settings
from router.ops.logs import REDACTED, JsonFormatter, configure, register_secret, secrets_of
from tests.support.harness import Cluster, backend, control, free_port, stats
from tests.support.wait import wait_for

BACKEND_KEY = "sk-backend-literal-4f9a2c1e"
ENV_KEY = "env-held-backend-key-77d3"
HEADER_SECRET = "x-extra-secret-value-0b1c"
ADMIN_TOKEN = "admin-token-9e8d7c6b5a"
CLIENT_KEY = "client-key-31415926535"
SECRETS = (BACKEND_KEY, ENV_KEY, HEADER_SECRET, ADMIN_TOKEN, CLIENT_KEY)


def lines_of(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.strip():
            out.append(json.loads(line))  # every line, ours and uvicorn's, is one JSON object
    return out


def test_traffic_of_every_kind_logs_no_secret(procs: Cluster) -> None:
    keyed = procs.mock("keyed", tokens=8)
    envkeyed = procs.mock("envkeyed", tokens=8)
    router = procs.router(
        {
            "backends": [
                backend("keyed", keyed, ["m"], api_key=BACKEND_KEY),
                backend(
                    "envkeyed",
                    envkeyed,
                    ["m", "e"],
                    api_key_env="TEST_BACKEND_KEY",
                    headers={"x-extra": HEADER_SECRET},
                ),
                {
                    "name": "dead",
                    "url": f"http://127.0.0.1:{free_port()}",
                    "models": ["dead-only"],
                    "api_key": BACKEND_KEY,
                },
            ],
            "balancer": "round_robin",
        },
        env={
            "SLUICEGATE_LOG_LEVEL": "debug",
            "SLUICEGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "TEST_BACKEND_KEY": ENV_KEY,
        },
        workers=2,
    )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    auth = {"authorization": f"Bearer {CLIENT_KEY}"}
    n_ok = 0
    for _ in range(4):
        stream = client.chat.completions.create(model="m", messages=[], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        n_ok += 1
    client.completions.create(model="e", prompt="x", max_tokens=2)
    with pytest.raises(openai.APIStatusError):  # connect failure
        client.chat.completions.create(model="dead-only", messages=[])
    with pytest.raises(openai.NotFoundError):  # the client's key as a model name
        client.chat.completions.create(model=CLIENT_KEY, messages=[])
    bad = httpx.post(
        router.url + "/v1/chat/completions", content=b"{" + CLIENT_KEY.encode(), headers=auth
    )
    assert bad.status_code == 400
    for m in (keyed, envkeyed):
        control(m, fail_status=503)
    assert httpx.post(router.url + "/v1/completions", json={"model": "m"}, headers=auth).status_code
    for m in (keyed, envkeyed):
        control(m, fail_status=0, die_after=2, tokens=6)
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        headers=auth,
        json={"model": "m", "stream": True},
    ) as r:
        assert "upstream_mid_stream" in r.read().decode()
    for m in (keyed, envkeyed):
        control(m, die_after=-1, itl_ms=30, tokens=200)
    with httpx.stream(
        "POST",
        router.url + "/v1/chat/completions",
        headers=auth,
        json={"model": "m", "stream": True},
    ) as r:
        lines = r.iter_lines()
        next(lines)  # then leave mid-stream
    admin = httpx.get(
        router.url + "/admin/backends", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    scraped = httpx.get(router.url + "/metrics")
    for secret in SECRETS:  # nor in what the router shows operators
        assert secret not in admin.text and secret not in scraped.text

    # The secrets were really in play: the backends received their keys.
    sent = [rec["authorization"] for m in (keyed, envkeyed) for rec in stats(m)["recent"]]
    assert f"Bearer {BACKEND_KEY}" in sent and f"Bearer {ENV_KEY}" in sent

    def requests_logged() -> list[dict[str, Any]]:
        return [x for x in lines_of(router.log()) if x["msg"] == "request"]

    wait_for(lambda: len(requests_logged()) >= n_ok + 5, "every request logged", 10, 0.05)
    router.stop()
    text = router.log()
    for secret in SECRETS:
        assert secret not in text, secret
    records = lines_of(text)
    assert any(x["logger"].startswith("uvicorn") for x in records)
    reqs = [x for x in records if x["msg"] == "request"]
    assert len(reqs) >= n_ok + 5
    fields = {
        "request_id",
        "model",
        "backend",
        "status",
        "attempts",
        "ttfb_ms",
        "duration_ms",
        "bytes",
        "disconnected",
    }
    assert all(fields <= set(x) for x in reqs)
    assert any(x["disconnected"] for x in reqs)
    assert any(x["status"] == 502 for x in reqs)


def test_log_level_is_configurable(procs: Cluster) -> None:
    up = procs.mock("up", tokens=2)
    router = procs.router(
        {"backends": [backend("up", up)]}, env={"SLUICEGATE_LOG_LEVEL": "warning"}
    )
    assert httpx.post(router.url + "/v1/completions", json={"model": "m"}).status_code == 200
    router.stop()
    assert not [x for x in lines_of(router.log()) if x["level"] == "info"]


def _format(
    formatter: JsonFormatter,
    msg: str,
    fields: dict[str, Any] | None = None,
    exc: BaseException | None = None,
) -> str:
    record = logging.LogRecord(
        "sluicegate.test",
        logging.ERROR,
        __file__,
        1,
        msg,
        None,
        (type(exc), exc, None) if exc else None,
    )
    if fields is not None:
        record.fields = fields
    line = formatter.format(record)
    json.loads(line)
    return line


def test_formatter_redacts_known_values_fields_and_patterns(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        json.dumps(
            {
                "backends": [
                    {"name": "a", "url": "http://a:1", "models": ["m"], "api_key": BACKEND_KEY},
                    {
                        "name": "b",
                        "url": "http://b:1",
                        "models": ["m"],
                        "api_key_env": "K",
                        "headers": {"x-extra": HEADER_SECRET},
                    },
                ]
            }
        )
    )
    monkeypatch.setenv("K", ENV_KEY)
    monkeypatch.setenv("SLUICEGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("SLUICEGATE_REDIS_URL", "redis://user:redis-pass-123@redis:6379/0")
    settings = load_settings(cfg)
    found = set(secrets_of(settings))
    assert {BACKEND_KEY, ENV_KEY, HEADER_SECRET, ADMIN_TOKEN, "redis-pass-123"} <= found

    fmt = JsonFormatter([*found, CLIENT_KEY])
    for secret in (*SECRETS, "redis-pass-123"):
        line = _format(
            fmt, f'oops {secret} and "{secret}"', {"detail": f"x{secret}y"}, RuntimeError(secret)
        )
        assert secret not in line and REDACTED in line
    # Values nobody registered, recognised by shape or by the field they sit in.
    line = _format(
        fmt,
        "sent Authorization: Bearer abc.def-ghi and sk-unknownkey12345 to https://u:hunter22@h/x",
        {"api_key": "zzz-unregistered", "max_tokens": 7, "admin_token": "tok-unregistered"},
    )
    for leaked in (
        "abc.def-ghi",
        "sk-unknownkey12345",
        "hunter22",
        "zzz-unregistered",
        "tok-unregistered",
    ):
        assert leaked not in line
    assert json.loads(line)["max_tokens"] == 7  # ordinary fields are left alone


def test_secret_learned_at_run_time_is_redacted() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure("info", [BACKEND_KEY])
        late = "late-admin-added-key-5150"
        formatter = root.handlers[0].formatter
        assert isinstance(formatter, JsonFormatter)
        assert late in _format(formatter, f"key {late}")
        register_secret(late)
        line = _format(formatter, f"key {late} and {BACKEND_KEY}")
        assert late not in line and BACKEND_KEY not in line
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
