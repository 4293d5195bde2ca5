"""A backend killed and restarted gets traffic again within seconds, with the default probe
settings (interval 5 s): while it is out of rotation it is probed every `unhealthy_interval`
(1 s) and readmitted after `healthy_threshold` (2) good probes, not after its 30 s ejection."""

from __future__ import annotations

import time

import httpx

from tests.support.harness import Cluster, backend, stats
from tests.support.wait import wait_for


def test_a_restarted_backend_is_back_within_three_seconds(procs: Cluster) -> None:
    a, b = procs.mock("a", tokens=2), procs.mock("b", tokens=2)
    router = procs.router(
        {
            "backends": [backend("a", a), backend("b", b)],
            "balancer": "round_robin",
            "timeouts": {"connect": 1},
        }
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with httpx.Client(base_url=router.url, timeout=10) as client:

        def row() -> dict[str, object]:
            return dict(client.get("/admin/backends/a").json())

        a.kill9()
        # Traffic finds it dead: connect failures fail over to b and eject a (passively).
        end = time.monotonic() + 10
        while row()["healthy"]:
            assert time.monotonic() < end, "a was not ejected"
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert "ejected" in str(row()["reason"])
        a2 = procs.mock("a", port=a.port, tokens=2)
        restarted = time.monotonic()
        while stats(a2)["requests"] == 0:
            assert time.monotonic() - restarted < 3.0, f"a not back: {row()}"
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            time.sleep(0.05)
        print(f"\nback {time.monotonic() - restarted:.2f}s after its restart")
    wait_for(lambda: '"why": "probe"' in router.log(), "the probe logged", 5)  # the log queue
