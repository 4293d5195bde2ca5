"""Two workers: both serve, and SIGTERM drains streams in flight in each of them."""

from __future__ import annotations

import signal
import threading

import httpx

from tests.support.harness import Cluster, backend


def test_two_workers_drain_on_sigterm(procs: Cluster) -> None:
    up = procs.mock("up", itl_ms=50, tokens=30)
    router = procs.router({"backends": [backend("up", up)], "drain_grace": 20}, workers=2)
    results: list[str] = []
    started = threading.Barrier(5)

    def consume() -> None:
        with (
            httpx.Client(timeout=30) as c,
            c.stream(
                "POST", router.url + "/v1/chat/completions", json={"model": "m", "stream": True}
            ) as r,
        ):
            lines = r.iter_lines()
            first = next(lines)
            started.wait(10)
            results.append("\n".join([first, *lines]))

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(10)
    router.signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert len(results) == 4
    for text in results:
        assert text.count('"content":"tok') == 30 and text.rstrip().endswith("data: [DONE]")
    assert router.popen.wait(20) == 0
