"""Client connection limits, driven with raw sockets against a real router: a head not complete
in `server.header_timeout` is closed (idle and slowloris sockets alike), a body not complete
`server.body_timeout` after its head gets 408 and is closed, idle kept-alive
connections close after `server.keepalive_timeout`, a connection past `server.max_connections`
gets a fast 503, and the fd limit is raised at startup with a warning when it is short."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.harness import STARVED_S, Cluster, Proc, backend
from tests.support.wait import wait_for

HEADER_TIMEOUT = 2.0  # long enough for the cap test to hold its idle sockets
BODY_TIMEOUT = 1.0
KEEPALIVE = 0.5
MAX_CONNECTIONS = 5


@pytest.fixture(scope="module")
def router(module_procs: Cluster) -> Proc:
    mock = module_procs.mock("a", tokens=2)
    return module_procs.router(
        {
            "backends": [backend("a", mock)],
            "server": {
                "header_timeout": HEADER_TIMEOUT,
                "body_timeout": BODY_TIMEOUT,
                "keepalive_timeout": KEEPALIVE,
                "max_connections": MAX_CONNECTIONS,
            },
            # Pools that could open more descriptors than any limit: startup must warn.
            "limits": {"max_connections": 10**9},
        }
    )


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    try:
        yield held
    finally:
        for s in held:
            s.close()


def connect(router: Proc, held: list[socket.socket]) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", router.port), timeout=5)
    held.append(s)
    return s


def closed_after(s: socket.socket, deadline: float = 5.0) -> float:
    """Seconds until the router closed `s` (EOF or reset), reading whatever it sent."""
    start = time.monotonic()
    s.settimeout(deadline)
    try:
        while s.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_idle_and_slowloris_heads_are_closed_after_header_timeout(
    router: Proc, sockets: list[socket.socket]
) -> None:
    idle = connect(router, sockets)
    slow = connect(router, sockets)
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    start = time.monotonic()
    # A header byte every tenth of the timeout: activity, but the head never completes.
    while time.monotonic() - start < HEADER_TIMEOUT + 1.0:
        try:
            slow.sendall(b"x")
        except OSError:
            break
        time.sleep(HEADER_TIMEOUT / 10)
    assert closed_after(slow, 3.0) < 3.0
    took = time.monotonic() - start
    assert HEADER_TIMEOUT * 0.8 <= took <= HEADER_TIMEOUT + 2.0
    assert closed_after(idle, 3.0) < 3.0
    assert httpx.get(router.url + "/healthz", timeout=STARVED_S).status_code == 200


def test_a_kept_alive_connections_next_head_has_the_same_limit(
    router: Proc, sockets: list[socket.socket]
) -> None:
    s = connect(router, sockets)
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    # The next request's head begins (the keep-alive timer stops) and never completes.
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    start = time.monotonic()
    assert closed_after(s, HEADER_TIMEOUT + 3.0) < HEADER_TIMEOUT + 3.0
    assert time.monotonic() - start >= HEADER_TIMEOUT * 0.8


def test_a_body_that_stops_short_or_trickles_gets_408_after_body_timeout(
    router: Proc, sockets: list[socket.socket]
) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4096\r\n\r\n"
    short = connect(router, sockets)
    trickle = connect(router, sockets)
    start = time.monotonic()
    short.sendall(head + b"{" + b" " * 3000)  # 1 KB short, then silence
    trickle.sendall(head)
    replies = {}
    while time.monotonic() - start < BODY_TIMEOUT + 3 and len(replies) < 2:
        try:
            trickle.sendall(b" ")  # a byte every 0.1 s: activity, never the whole body
        except OSError:
            pass
        for name, s in (("short", short), ("trickle", trickle)):
            if name in replies:
                continue
            s.settimeout(0.1)
            try:
                data = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                data = b""
            replies[name] = (data, time.monotonic() - start)
    assert set(replies) == {"short", "trickle"}
    for data, took in replies.values():
        head_line, _, body = data.partition(b"\r\n\r\n")
        assert head_line.startswith(b"HTTP/1.1 408")
        assert json.loads(body)["error"]["code"] == "request_timeout"
        assert BODY_TIMEOUT * 0.8 <= took <= BODY_TIMEOUT + 2.0
    for s in (short, trickle):
        assert closed_after(s, 3.0) < 3.0
    assert httpx.get(router.url + "/healthz", timeout=STARVED_S).status_code == 200


def test_idle_keepalive_connection_is_closed(router: Proc, sockets: list[socket.socket]) -> None:
    s = connect(router, sockets)
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
    s.settimeout(5)
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    start = time.monotonic()
    assert closed_after(s) < 5
    assert KEEPALIVE * 0.8 <= time.monotonic() - start < HEADER_TIMEOUT + 1.0


def test_connections_past_the_cap_get_a_fast_503(
    router: Proc, sockets: list[socket.socket]
) -> None:
    held = [connect(router, sockets) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.1)  # let the router accept them
    extra = connect(router, sockets)
    extra.settimeout(2)
    start = time.monotonic()
    data = b""
    try:
        while chunk := extra.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    assert time.monotonic() - start < 1.0
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503")
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    # The ones it holds still work; once they go, new connections are taken again.
    held[0].sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    held[0].settimeout(5)
    assert held[0].recv(65536).startswith(b"HTTP/1.1 200")
    for s in held:
        s.close()

    def healthy() -> bool:
        try:
            return httpx.get(router.url + "/healthz", timeout=STARVED_S).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, "the router answering again", 5, 0.05)


def test_fd_limit_raised_to_hard_and_warned_when_short(router: Proc) -> None:
    limits = Path(f"/proc/{router.pid}/limits").read_text()
    row = next(line for line in limits.splitlines() if line.startswith("Max open files"))
    soft, hard = row.split()[3:5]
    assert soft == hard
    warned: list[dict[str, Any]] = [
        json.loads(line)
        for line in router.log().splitlines()
        if "file descriptor limit is below" in line
    ]
    assert warned and warned[0]["needed"] > 10**9
