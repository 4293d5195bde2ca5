"""Backends that misbehave on the wire: what the client sees, how often the backend saw each
request, what the log and metrics count, and that the router is left as it was.

One router (module-scoped) in front of the raw-socket `HostileBackend` (its mode is the model
name) and, for the failover case, the project's mock engine.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from bench.kit.procstat import open_fds
from tests.support.harness import Cluster, Proc, in_flight
from tests.support.hostile_backend import HostileBackend
from tests.support.wait import wait_for

CHAT = "/v1/chat/completions"
INVALID = ("head-flood", "many-headers", "big-head", "status-600", "status-101")
MODES = (
    "ok",
    "hundred",
    "early-hints",
    "close",
    "ok-then-close",
    "ok-then-junk",
    "short-stream",
    "slow-stream",
    *INVALID,
)


@pytest.fixture(scope="module")
def router(module_procs: Cluster, hostile: HostileBackend) -> Proc:
    mock = module_procs.mock("good")
    return module_procs.router(
        {
            "backends": [
                {
                    "name": "hostile",
                    "url": hostile.url,
                    # "close-alone": the same misbehaviour where no other backend serves it.
                    "models": {**{m: m for m in MODES}, "close-alone": "close"},
                },
                {"name": "good", "url": mock.url, "models": {"close": "mock-model"}},
            ],
            "model_balancers": {"close": "round_robin"},
            "timeouts": {"connect": 2, "read": 5, "write": 2, "pool": 2},
            "retries": {"attempts": 3, "deadline": 10},
            # Failures here are the point: keep the hostile backend in rotation.
            "outlier": {"consecutive_failures": 1000},
            "health": {"interval": 60},
        }
    )


def _log_row(router: Proc, rid: str) -> dict[str, Any] | None:
    for line in router.log().splitlines():
        if rid in line and '"attempts"' in line:
            row = json.loads(line)
            if row.get("request_id") == rid:
                return dict(row)
    return None


def _logged(router: Proc, rid: str) -> dict[str, Any]:
    wait_for(lambda: _log_row(router, rid), f"the request log line of {rid}", 5.0)
    row = _log_row(router, rid)
    assert row is not None
    return row


def _retries(router: Proc) -> float:
    text = httpx.get(router.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sluicegate_retries_total{")
    )


def _post(router: Proc, model: str, rid: str, **kw: Any) -> httpx.Response:
    return httpx.post(
        router.url + CHAT,
        json={"model": model, "messages": [], **kw},
        headers={"x-request-id": rid},
        timeout=20,
    )


@pytest.fixture(scope="module")
def baseline(router: Proc, hostile: HostileBackend) -> int:
    """The router's descriptors once its pools hold a connection to each backend."""
    assert _post(router, "ok", "warm-1").status_code == 200
    assert _post(router, "close", "warm-2").status_code == 200
    assert _post(router, "close", "warm-3").status_code == 200
    return open_fds(router.pid)


def test_a_written_request_is_never_replayed_and_counts_as_an_attempt(
    router: Proc, hostile: HostileBackend, baseline: int
) -> None:
    sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    retries_before = _retries(router)
    rids = [f"replay-{i}" for i in range(6)]
    for rid in rids:
        # A pooled connection to the hostile backend first: the request below is written on a
        # reused connection, where the backend reads it and closes without answering.
        assert _post(router, "ok", f"pool-{rid}").status_code == 200
        reply = sdk.chat.completions.create(
            model="close", messages=[], extra_headers={"x-request-id": rid}
        )
        assert reply.choices[0].message.content
    hit = [rid for rid in rids if hostile.seen[rid]]
    assert len(hit) >= 2  # round robin: about every other request went to it first
    for rid in rids:
        assert hostile.seen[rid] <= 1
        assert _logged(router, rid)["attempts"] == 1 + hostile.seen[rid]
    assert _retries(router) - retries_before == len(hit)

    # Where no other backend serves the model: one attempt, one delivery, a clear 502.
    with pytest.raises(openai.APIStatusError) as info:
        sdk.chat.completions.create(
            model="close-alone", messages=[], extra_headers={"x-request-id": "replay-alone"}
        )
    assert info.value.status_code == 502
    assert hostile.seen["replay-alone"] == 1
    assert _logged(router, "replay-alone")["attempts"] == 1
    # ... and it is the backend's failure, as health sees it.
    rows = httpx.get(router.url + "/admin/backends").json()
    assert next(b for b in rows if b["name"] == "hostile")["consecutive_failures"] >= 1


def test_pooled_connection_closed_or_dirtied_while_idle_is_not_used(
    router: Proc, hostile: HostileBackend, baseline: int
) -> None:
    for mode in ("ok-then-close", "ok-then-junk"):
        acts = hostile.idle_acts
        first = _post(router, mode, f"{mode}-1")
        assert first.status_code == 200
        # The backend closes, or writes a stray response, on the idle connection.
        wait_for(lambda n=acts: hostile.idle_acts > n, f"{mode} on the idle connection", 5.0)
        r = _post(router, "ok", f"{mode}-2")
        assert r.status_code == 200
        assert "stale" not in r.text and r.text.count("tok") == 3
        assert hostile.seen[f"{mode}-2"] == 1
        assert _logged(router, f"{mode}-2")["attempts"] == 1


@pytest.mark.parametrize("mode", INVALID)
def test_invalid_response_heads_are_a_502_and_the_connection_is_dropped(
    router: Proc, hostile: HostileBackend, baseline: int, mode: str
) -> None:
    floods = hostile.dropped_floods
    rid = f"invalid-{mode}"
    r = _post(router, mode, rid)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "upstream_connect_error"
    assert "invalid response" in err["message"]
    assert "x-flood" not in r.text and "x-big" not in str(r.headers)
    assert hostile.seen[rid] == 1
    assert _logged(router, rid)["attempts"] == 1
    # The router dropped the connection (the backend waits for that, or its flood is cut).
    if mode == "head-flood":
        wait_for(lambda: hostile.dropped_floods == floods + 1, "the flood cut", 5.0)
    wait_for(lambda: hostile.open <= 2, "the connection dropped", 5.0)


def test_heads_within_the_limits_pass(router: Proc, baseline: int) -> None:
    r = _post(router, "hundred", "within-1")
    assert r.status_code == 200 and r.text == "hi"
    assert sum(1 for k in r.headers if k.startswith("x-h")) == 98
    r = _post(router, "early-hints", "within-2")  # a 1xx before the answer is skipped
    assert r.status_code == 200 and r.text.count("tok") == 3


def test_a_stream_cut_short_ends_with_an_error_event(router: Proc, baseline: int) -> None:
    with httpx.stream(
        "POST",
        router.url + CHAT,
        json={"model": "short-stream", "stream": True},
        headers={"x-request-id": "short-1"},
        timeout=10,
    ) as r:
        assert r.status_code == 200
        assert "content-length" not in r.headers  # chunked: the error event can follow
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[0].startswith("data: ") and "tok" in events[0]
    assert '"upstream_mid_stream"' in events[-2] and events[-1] == "data: [DONE]"
    assert _logged(router, "short-1")["bytes"] == len(text)


def test_bytes_logged_for_an_abandoned_stream_are_what_was_sent(
    router: Proc, baseline: int
) -> None:
    received = 0
    with httpx.stream(
        "POST",
        router.url + CHAT,
        json={"model": "slow-stream", "stream": True},
        headers={"x-request-id": "abandon-1"},
        timeout=10,
    ) as r:
        for chunk in r.iter_raw():
            received += len(chunk)
            if received > 200:
                break
    row = _logged(router, "abandon-1")
    assert row["disconnected"] is True
    assert received <= row["bytes"] < 100 * 48  # what was sent: not 0, not the whole stream


def test_router_is_left_as_it_was(router: Proc, hostile: HostileBackend, baseline: int) -> None:
    assert httpx.get(router.url + "/healthz").status_code == 200
    assert _post(router, "ok", "after-1").status_code == 200
    wait_for(lambda: in_flight(router) == 0, "nothing in flight", 5.0)
    # Pools may keep an idle connection or two per backend; nothing grows with the failures.
    wait_for(
        lambda: open_fds(router.pid) <= baseline + 2, f"open files within 2 of {baseline}", 5.0
    )
