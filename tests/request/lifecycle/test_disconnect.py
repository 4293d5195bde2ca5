"""A client that leaves stops the upstream: while tokens flow, during a silent prefill, and for a
non-streaming request. Nothing stays counted afterwards."""

from __future__ import annotations

import signal
import socket
import time
from typing import Any

import httpx
import pytest

from tests.support.harness import Cluster, Proc, backend, control, in_flight, sha, stats
from tests.support.wait import wait_for


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    up = module_procs.mock("slow", itl_ms=20, tokens=500)
    router = module_procs.router({"backends": [backend("slow", up)]})
    return {"up": up, "router": router}


def _record(up: Proc, request_id: str, key: str) -> dict[str, Any] | None:
    """The upstream's record of `request_id`, once it has `key`."""
    for rec in stats(up)["recent"]:
        if rec["request_id"] == request_id and rec[key]:
            return dict(rec)
    return None


def _wait_record(up: Proc, request_id: str, key: str) -> dict[str, Any]:
    wait_for(lambda: _record(up, request_id, key), f"upstream's {key} for {request_id}", 3.0)
    rec = _record(up, request_id, key)
    assert rec is not None
    return rec


def test_close_after_five_chunks_stops_generation(fleet: dict[str, Proc]) -> None:
    # 100 ms a token: the router's notice of the close and its cancel fit inside one token even
    # on a starved machine (at 20 ms one took two tokens more).
    control(fleet["up"], reset_stats=True, ttft_ms=0, itl_ms=100, tokens=500)
    rid = "disc-5-chunks"
    received = 0
    with (
        httpx.Client(timeout=10) as c,
        c.stream(
            "POST",
            fleet["router"].url + "/v1/chat/completions",
            json={"model": "m", "stream": True},
            headers={"x-request-id": rid},
        ) as r,
    ):
        for event in r.iter_lines():
            if event.startswith("data: "):
                received += 1
                if received == 5:
                    break
    rec = _wait_record(fleet["up"], rid, "aborted")
    assert rec["aborted"] is True
    # At most one token produced after the client closed.
    assert rec["tokens"] <= received + 1, rec
    assert stats(fleet["up"])["tokens_after_disconnect"] == 0
    wait_for(lambda: in_flight(fleet["router"]) == 0, "nothing in flight", 2)


def _raw_request(port: int, body: bytes, rid: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"x-request-id: {rid}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_leaving_during_silent_prefill_closes_upstream_fast(
    fleet: dict[str, Proc], stream: bool
) -> None:
    control(fleet["up"], reset_stats=True, ttft_ms=5000, itl_ms=20, tokens=50)
    rid = f"disc-prefill-{stream}"
    body = b'{"model": "m", "stream": %s}' % (b"true" if stream else b"false")
    sock = _raw_request(fleet["router"].port, body, rid)
    _wait_record(fleet["up"], rid, "started_at")  # the engine is in its silent prefill
    closed_at = time.time()
    sock.close()
    rec = _wait_record(fleet["up"], rid, "disconnected_at")
    assert rec["disconnected_at"] - closed_at < 0.2, rec["disconnected_at"] - closed_at
    assert rec["tokens"] == 0
    wait_for(lambda: in_flight(fleet["router"]) == 0, "nothing in flight", 2)


def test_many_disconnects_leave_nothing_counted(fleet: dict[str, Proc]) -> None:
    control(fleet["up"], reset_stats=True, ttft_ms=0, itl_ms=10, tokens=300)
    socks = [
        _raw_request(fleet["router"].port, b'{"model": "m", "stream": true}', f"many-{i}")
        for i in range(30)
    ]
    wait_for(lambda: stats(fleet["up"])["running"] >= 30, "30 streams running", 10, 0.05)
    assert stats(fleet["up"])["running"] == 30
    for s in socks:
        s.close()
    wait_for(
        lambda: stats(fleet["up"])["running"] == 0 and in_flight(fleet["router"]) == 0,
        "every stream stopped, nothing in flight",
        5,
        0.05,
    )
    st = stats(fleet["up"])
    assert st["running"] == 0 and st["aborted"] == 30
    assert in_flight(fleet["router"]) == 0


def test_leaving_before_the_lifecycle_starts_sends_nothing_upstream(procs: Cluster) -> None:
    """The client leaves while its quota is still being checked (a stopped Redis answers nothing
    for `redis_timeout`): the lifecycle that starts after it must end at once, not send the
    request upstream and stream the whole answer to nobody."""
    rds = procs.redis()
    itl_ms, tokens = 20, 100
    answer_s = itl_ms * tokens / 1000  # 2 s of answer
    up = procs.mock("up", itl_ms=itl_ms, tokens=tokens)
    timeout = 1.0
    key = "sk-leaves-early-0123456789"
    router = procs.router(
        {
            "backends": [backend("up", up)],
            "redis_url": rds.url,
            "redis_timeout": timeout,
            "api_keys": [{"sha256": sha(key), "name": "k", "rpm": 1000}],
        }
    )
    auth = {"authorization": f"Bearer {key}"}
    warm = httpx.post(
        router.url + "/v1/chat/completions", json={"model": "m", "max_tokens": 1}, headers=auth
    )
    assert warm.status_code == 200
    rid = "leaves-before-lifecycle"
    body = b'{"model": "m", "stream": true}'
    rds.signal(signal.SIGSTOP)
    try:
        sock = socket.create_connection(("127.0.0.1", router.port))
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {key}\r\nx-request-id: {rid}\r\n".encode()
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(timeout / 4)  # within the quota's wait on Redis
        sock.close()
        # Unwatched, the lifecycle would start once the quota gave up (one timeout), take its
        # lease (another) and stream to nobody: watch longer than that and the answer.
        time.sleep(3 * timeout + answer_s + 0.5)
        sent = [r for r in stats(up)["recent"] if r["request_id"] == rid]
        assert all(r["tokens"] <= 1 for r in sent), sent
    finally:
        rds.signal(signal.SIGCONT)
    wait_for(lambda: in_flight(router) == 0, "nothing in flight", 5, 0.05)
