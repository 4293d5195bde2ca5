"""SIGTERM drains: /readyz fails, new requests get 503, streams in flight finish, clean exit."""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx

from tests.support.harness import Cluster, backend
from tests.support.wait import wait_for


def test_sigterm_lets_a_stream_in_flight_finish(procs: Cluster) -> None:
    up = procs.mock("up", itl_ms=50, tokens=40)  # a 2-second stream
    router = procs.router({"backends": [backend("up", up)], "drain_grace": 20})
    chunks: list[str] = []
    first = threading.Event()

    def consume() -> None:
        with httpx.stream(
            "POST",
            router.url + "/v1/chat/completions",
            json={"model": "m", "stream": True},
            timeout=30,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line)
                    first.set()

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(10)
    router.signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(router.url + "/readyz").status_code == 503, "draining", 5)
    assert router.alive()
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "shutting_down"
    t.join(20)
    assert not t.is_alive()
    assert chunks[-1] == "data: [DONE]"
    assert sum(1 for c in chunks if re.search(r"tok\d+ ", c)) == 40  # not "prompt_tokens"
    assert router.popen.wait(10) == 0


def test_drain_grace_bounds_the_wait(procs: Cluster) -> None:
    up = procs.mock("up", itl_ms=100, tokens=600)  # a 60-second stream
    router = procs.router({"backends": [backend("up", up)], "drain_grace": 1})
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json={"model": "m", "stream": True}, timeout=30
    ) as r:
        next(r.iter_lines())
        started = time.monotonic()
        router.signal(signal.SIGTERM)
        router.popen.wait(15)
        assert time.monotonic() - started < 8
