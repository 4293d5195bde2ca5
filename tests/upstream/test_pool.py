"""The per-backend pool: a cap on connections, waiting for a free one, reuse, and a clear error
when none frees up in time."""

from __future__ import annotations

import asyncio

import httpx

from tests.support.harness import Cluster, backend, in_flight, stats
from tests.support.wait import wait_for


def test_capped_pool_queues_then_reuses_one_connection(procs: Cluster) -> None:
    up = procs.mock("up", itl_ms=30, tokens=10)  # ~0.3 s per stream
    router = procs.router(
        {
            "backends": [backend("up", up)],
            "limits": {"max_connections": 1, "max_keepalive": 1},
            "timeouts": {"connect": 2, "read": 5, "write": 2, "pool": 5},
        }
    )

    async def main() -> list[str]:
        async with httpx.AsyncClient(timeout=20) as c:

            async def one() -> str:
                r = await c.post(
                    router.url + "/v1/chat/completions", json={"model": "m", "stream": True}
                )
                assert r.status_code == 200
                return r.text

            return await asyncio.gather(*(one() for _ in range(4)))

    texts = asyncio.run(main())
    assert all(t.count('"content":"tok') == 10 for t in texts)
    assert stats(up)["connections_opened"] == 1


def test_no_free_connection_in_time_is_a_clear_502(procs: Cluster) -> None:
    up = procs.mock("up", itl_ms=200, tokens=10)  # ~2 s per stream
    router = procs.router(
        {
            "backends": [backend("up", up)],
            "limits": {"max_connections": 1},
            "timeouts": {"connect": 2, "read": 5, "write": 2, "pool": 0.3},
            "retries": {"attempts": 1},
        }
    )

    async def main() -> tuple[int, dict[str, object]]:
        async with httpx.AsyncClient(timeout=20) as c:
            async with c.stream(
                "POST", router.url + "/v1/chat/completions", json={"model": "m", "stream": True}
            ) as held:
                lines = held.aiter_lines()  # kept referenced: the stream stays open
                await lines.__anext__()
                r = await c.post(router.url + "/v1/chat/completions", json={"model": "m"})
                return r.status_code, r.json()

    status, body = asyncio.run(main())
    assert status == 502
    assert body["error"]["code"] == "upstream_connect_error"
    wait_for(lambda: in_flight(router) == 0, "nothing in flight", 3)
