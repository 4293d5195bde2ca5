"""Router memory against backends that send response heads without end.

    python -m bench.oneoff.hostile            # ~10 s: RSS before, peak during, after; 502s and time

Each request goes to the raw-socket hostile backend of the tests in `head-flood` mode (a status
line, then headers until the peer drops the connection, up to ~8 MB each). The transport caps a
head at 64 KiB, so the router's memory must stay flat however many such responses are in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

import httpx

from bench.kit.procstat import rss_mb
from tests.support.harness import Cluster
from tests.support.hostile_backend import HostileBackend


async def _flood(url: str, concurrency: int, rounds: int) -> tuple[int, int, float]:
    bad = other = 0
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(rounds):
            rs = await asyncio.gather(
                *(
                    c.post(url + "/v1/chat/completions", json={"model": "head-flood"})
                    for _ in range(concurrency)
                )
            )
            for r in rs:
                if r.status_code == 502:
                    bad += 1
                else:
                    other += 1
    return bad, other, time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    hostile = HostileBackend().start()
    cluster = Cluster()
    try:
        router = cluster.router(
            {
                "backends": [{"name": "h", "url": hostile.url, "models": ["head-flood", "ok"]}],
                "retries": {"attempts": 1},
                "outlier": {"consecutive_failures": 100000},
                "health": {"interval": 60},
            },
            env={"SLUICEGATE_LOG_LEVEL": "warning"},
        )
        httpx.post(router.url + "/v1/chat/completions", json={"model": "ok"}, timeout=10)
        before = rss_mb(router.pid)
        peak = before
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, rss_mb(router.pid))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        bad, other, elapsed = asyncio.run(_flood(router.url, args.concurrency, args.rounds))
        done.set()
        sampler.join(5)
        print(
            json.dumps(
                {
                    "requests": bad + other,
                    "answered_502": bad,
                    "other": other,
                    "seconds": round(elapsed, 2),
                    "router_rss_mb_before": round(before, 1),
                    "router_rss_mb_peak": round(peak, 1),
                    "router_rss_mb_after": round(rss_mb(router.pid), 1),
                    "floods_cut_by_router": hostile.dropped_floods,
                }
            ),
            flush=True,
        )
    finally:
        cluster.close()
        hostile.stop()


if __name__ == "__main__":
    main()
