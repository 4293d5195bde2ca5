"""A client that leaves stops the upstream: while tokens flow, during a silent prefill, and for a
non-streaming request. Nothing stays counted afterwards."""

from __future__ import annotations

import socket
import time
from typing import Any

import httpx
import pytest

from tests.harness import Cluster, Proc, backend, control, in_flight, stats


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    up = module_procs.mock("slow", itl_ms=20, tokens=500)
    router = module_procs.router({"backends": [backend("slow", up)]})
    return {"up": up, "router": router}


def _wait_record(up: Proc, request_id: str, key: str, deadline: float = 3.0) -> dict[str, Any]:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        for rec in stats(up)["recent"]:
            if rec["request_id"] == request_id and rec[key]:
                return dict(rec)
        time.sleep(0.02)
    raise AssertionError(f"upstream never recorded {key} for {request_id}")


def test_close_after_five_chunks_stops_generation(fleet: dict[str, Proc]) -> None:
    control(fleet["up"], reset_stats=True, ttft_ms=0, itl_ms=20, tokens=500)
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
    deadline = time.monotonic() + 2
    while in_flight(fleet["router"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert in_flight(fleet["router"]) == 0


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
    _wait_record(fleet["up"], rid, "started_at")
    time.sleep(0.3)
    closed_at = time.time()
    sock.close()
    rec = _wait_record(fleet["up"], rid, "disconnected_at")
    assert rec["disconnected_at"] - closed_at < 0.2, rec["disconnected_at"] - closed_at
    assert rec["tokens"] == 0
    deadline = time.monotonic() + 2
    while in_flight(fleet["router"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert in_flight(fleet["router"]) == 0


def test_many_disconnects_leave_nothing_counted(fleet: dict[str, Proc]) -> None:
    control(fleet["up"], reset_stats=True, ttft_ms=0, itl_ms=10, tokens=300)
    socks = [
        _raw_request(fleet["router"].port, b'{"model": "m", "stream": true}', f"many-{i}")
        for i in range(30)
    ]
    deadline = time.monotonic() + 10
    while stats(fleet["up"])["running"] < 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats(fleet["up"])["running"] == 30
    for s in socks:
        s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        st = stats(fleet["up"])
        if st["running"] == 0 and in_flight(fleet["router"]) == 0:
            break
        time.sleep(0.05)
    st = stats(fleet["up"])
    assert st["running"] == 0 and st["aborted"] == 30
    assert in_flight(fleet["router"]) == 0
