"""What the console costs (`python -m bench.run --only console`, or
`python -m bench.scenarios.console`).

Page cost: a router (two mock engines, admission, three client keys with limits, the admin token)
is read as `PAGES` open consoles read it: each its own connection, `<path>/api/live` every
`console.refresh` (1 s) and `/admin/usage` every 30 s. Rounds alternate between polled and not
polled (`ROUNDS` of each, `SECONDS` long; the machine's noise falls on both); the router's CPU
share of one core is (CPU polled - CPU idle) / wall time. Idle still probes and scrapes the two
engines; the difference is the pages alone. Goal: at most 1 % of one core for 5 pages.

Hot-path cost: the live ring's three calls per request (`routed`, `answered`; `queued` runs
only while the admission queue moves) timed in this process, against the router's own CPU per
streamed request under load in the same run (the overhead scenario's 64-token streams,
concurrency 32): their ratio is what the ring adds to a request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import time
from typing import Any

import httpx

from bench.kit.loadgen import run_load
from bench.kit.procstat import cpu_seconds
from bench.kit.report import Row
from router.ops.live import Live
from tests.support.harness import Cluster, Proc

PAGES = 5
ROUNDS = 3
SECONDS = 10.0
TOKEN = "bench-console-token"
CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "stream": True, "max_tokens": 64}).encode()


def _router(c: Cluster, engines: list[Proc]) -> Proc:
    keys = [
        {
            "sha256": hashlib.sha256(f"key-{i}".encode()).hexdigest(),
            "name": f"team-{i}",
            "rpm": 6000,
            "tpm": 10_000_000,
        }
        for i in range(3)
    ]
    config: dict[str, Any] = {
        "backends": [
            {"name": f"e{i}", "url": e.url, "models": {"m": "mock-model"}}
            for i, e in enumerate(engines)
        ],
        "console": {"enabled": True, "refresh": 1.0},
        "admission": {"max_wait": 5},
        "api_keys": keys,
    }
    env = {"SLUICEGATE_ADMIN_TOKEN": TOKEN, "SLUICEGATE_LOG_LEVEL": "warning"}
    return c.router(config, env=env)


async def _page(url: str, path: str, until: float, refresh: float) -> tuple[int, int]:
    """One open console: its reads until `until`; (reads, bytes)."""
    reads = size = 0
    headers = {"authorization": f"Bearer {TOKEN}"}
    last_usage = 0.0
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as client:
        while time.monotonic() < until:
            started = time.monotonic()
            r = await client.get(path + "/api/live")
            r.raise_for_status()
            reads += 1
            size += len(r.content)
            if started - last_usage >= 30:
                last_usage = started
                r = await client.get("/admin/usage", params={"since": int(time.time()) - 6 * 3600})
                r.raise_for_status()
                reads += 1
                size += len(r.content)
            await asyncio.sleep(max(0.0, refresh - (time.monotonic() - started)))
    return reads, size


async def _pages(url: str, seconds: float) -> tuple[int, int]:
    until = time.monotonic() + seconds
    done = await asyncio.gather(*(_page(url, "/console", until, 1.0) for _ in range(PAGES)))
    return sum(d[0] for d in done), sum(d[1] for d in done)


def _cpu_over(router: Proc, seconds: float, polled: bool) -> tuple[float, int, int]:
    before, t0 = cpu_seconds(router.pid), time.monotonic()
    reads = size = 0
    if polled:
        reads, size = asyncio.run(_pages(router.url, seconds))
    else:
        time.sleep(seconds)
    wall = time.monotonic() - t0
    return (cpu_seconds(router.pid) - before) / wall, reads, size


def ring_ns(calls: int = 50_000, repeats: int = 9) -> float:
    """Nanoseconds the ring adds to one request: one routing decision and one answer (the
    loop's own time taken off; the best of `repeats`, as the machine is shared)."""
    names = [f"backend-{i}" for i in range(8)]
    best = float("inf")
    for _ in range(repeats):
        live = Live()
        t0 = time.perf_counter()
        for i in range(calls):
            name = names[i & 7]
        empty = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(calls):
            name = names[i & 7]
            live.routed(name, "load")
            live.answered(name, 0.05)
        best = min(best, time.perf_counter() - t0 - empty)
    return best / calls * 1e9


def run(c: Cluster, quick: bool = False) -> dict[str, Any]:
    rounds, seconds = (2, 6.0) if quick else (ROUNDS, SECONDS)
    engines = [c.mock(f"e{i}", tokens=64) for i in range(2)]
    router = _router(c, engines)
    # Warm: every key and model once through the router, a few reads of the page.
    for i in range(3):
        httpx.post(
            router.url + CHAT,
            headers={"authorization": f"Bearer key-{i}"},
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        ).raise_for_status()
    asyncio.run(_pages(router.url, 2.0))
    idle: list[float] = []
    polled: list[float] = []
    reads = size = 0
    for _ in range(rounds):
        idle.append(_cpu_over(router, seconds, False)[0])
        share, n, b = _cpu_over(router, seconds, True)
        polled.append(share)
        reads, size = reads + n, size + b
    added = statistics.median(polled) - statistics.median(idle)
    # The ring on the request path, against the router's CPU per request in this run.
    before = cpu_seconds(router.pid)
    res = asyncio.run(
        run_load(
            "127.0.0.1",
            router.port,
            CHAT,
            BODY,
            32,
            duration=seconds / 2,
            extra_headers="authorization: Bearer key-0\r\n",
        )
    )
    router_ms = (cpu_seconds(router.pid) - before) / max(1, res.ok) * 1000
    ns = ring_ns()
    return {
        "pages": PAGES,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "idle_cpu_share_percent": round(statistics.median(idle) * 100, 3),
        "polled_cpu_share_percent": round(statistics.median(polled) * 100, 3),
        "pages_cpu_share_percent": round(added * 100, 3),
        "reads_per_second": round(reads / (rounds * seconds), 2),
        "bytes_per_read": round(size / max(1, reads)),
        "goal_percent": 1.0,
        "ring_ns_per_request": round(ns, 1),
        "router_cpu_ms_per_request": round(router_ms, 3),
        "ring_share_of_request_cpu": round(ns / 1e6 / router_ms, 5) if router_ms else None,
        "load_requests": res.ok,
    }


def section(r: dict[str, Any]) -> list[str]:
    share = r["ring_share_of_request_cpu"]
    return [
        "## Console: what open pages cost",
        "",
        f"{r['pages']} consoles reading the live view every second (and `/admin/usage` every "
        f"30 s), {r['reads_per_second']} reads/s of {r['bytes_per_read']} bytes, against the same "
        f"router unread, {r['rounds']} alternating rounds of {r['seconds_per_round']:.0f} s "
        "(bench/scenarios/console.py).",
        "",
        "| router CPU, share of one core | % |",
        "|---|---|",
        f"| unread (probes, engine scrapes) | {r['idle_cpu_share_percent']:.2f} |",
        f"| {r['pages']} pages open | {r['polled_cpu_share_percent']:.2f} |",
        f"| the pages' cost (goal <= {r['goal_percent']:.0f}) | "
        f"{r['pages_cpu_share_percent']:.2f} |",
        "",
        f"On the request path the live ring adds {r['ring_ns_per_request']:.0f} ns per request "
        f"(one routing decision and one answer), {(share or 0) * 100:.3f} % "
        f"of the router's {r['router_cpu_ms_per_request']:.3f} ms of CPU per streamed request "
        "in the same run.",
        "",
    ]


def targets(r: dict[str, Any]) -> list[Row]:
    """This scenario's row of the page's Targets table (`r`: a run's results)."""
    co = r.get("console")
    if not co:
        return []
    share = co["pages_cpu_share_percent"]
    return [("console: 5 open pages, router CPU % of a core", "<= 1", share, share <= 1)]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    c = Cluster()
    try:
        print(json.dumps(run(c, args.quick), indent=2))
    finally:
        c.close()


if __name__ == "__main__":
    main()
