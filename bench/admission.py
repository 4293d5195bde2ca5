"""The admission queue's cost and behaviour (`python -m bench.run --only admission`).

1. overhead: router CPU per request with `admission` configured but nothing queued, against the
   same router without it, plus an A/A pair (two routers without it) for this machine's noise
   floor. 64-token streams, 32 concurrent, fast mocks with room to spare.
2. priority: one backend with 4 slots (`max_inflight: 4`), a `sheddable` flood of 64 concurrent
   clients, and one `critical` request at a time: the critical wait (time to first byte minus the
   same request's time on an idle fleet) against one slot's turnover (request time / slots).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from bench.procstat import cpu_seconds
from tests.harness import Cluster, Proc

CHAT = "/v1/chat/completions"


def _router(c: Cluster, mocks: dict[str, Proc], **extra: Any) -> Proc:
    per_backend = extra.pop("backend", {})
    cfg = {
        "backends": [
            {"name": n, "url": m.url, "models": {"m": "mock-model"}, **per_backend}
            for n, m in mocks.items()
        ],
        "health": {"interval": 60},
        **extra,
    }
    return c.router(cfg, env={"SLUICEGATE_LOG_LEVEL": "warning"})


def overhead(c: Cluster, seconds: float) -> dict[str, Any]:
    from bench.loadgen import run_load

    mocks = {f"a{i}": c.mock(f"a{i}", tokens=64) for i in range(2)}
    routers = {
        "off": _router(c, mocks),
        "on": _router(c, mocks, admission={"max_wait": 30}),
        "off_again": _router(c, mocks),
    }
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user"}]}).encode()
    cpu = {k: 0.0 for k in routers}
    reqs = {k: 0 for k in routers}
    errors = {k: 0 for k in routers}
    names = list(routers)
    for r in routers.values():  # warm-up: connections, pools, caches
        asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, 32, 0.5))
    for i in range(6):  # rotate the order each round: noise and drift hit all alike
        for k in names[i % 3 :] + names[: i % 3]:
            r = routers[k]
            c0 = cpu_seconds(r.pid)
            res = asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, 32, seconds / 6))
            cpu[k] += cpu_seconds(r.pid) - c0
            reqs[k] += res.ok
            errors[k] += res.errors
    for r in routers.values():
        r.stop()
    ms = {k: 1000 * cpu[k] / max(1, reqs[k]) for k in routers}
    return {
        "cpu_ms_per_request": {k: round(v, 4) for k, v in ms.items()},
        "cpu_s": {k: round(v, 2) for k, v in cpu.items()},
        "requests": reqs,
        "errors": errors,
        "ratio_on_off": round(ms["on"] / ms["off"], 3),
        "aa_ratio": round(ms["off_again"] / ms["off"], 3),
    }


async def _priority(url: str, seconds: float) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 20}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:

        async def timed(band: str) -> tuple[int, float]:
            t0 = time.perf_counter()
            r = await http.post(url + CHAT, json=body, headers={"x-sluicegate-priority": band})
            return r.status_code, time.perf_counter() - t0

        idle = [(await timed("critical"))[1] for _ in range(10)]
        solo = sorted(idle)[len(idle) // 2]
        stop = time.monotonic() + seconds
        flood_status: dict[int, int] = {}

        async def flood() -> None:
            while time.monotonic() < stop:
                status, _ = await timed("sheddable")
                flood_status[status] = flood_status.get(status, 0) + 1

        floods = [asyncio.create_task(flood()) for _ in range(64)]
        await asyncio.sleep(1.0)  # the queue fills
        crit: list[float] = []
        crit_status: dict[int, int] = {}
        while time.monotonic() < stop - 1:
            status, took = await timed("critical")
            crit_status[status] = crit_status.get(status, 0) + 1
            crit.append(took - solo)
            await asyncio.sleep(0.05)
        await asyncio.gather(*floods)
    crit.sort()
    return {
        "solo_s": round(solo, 4),
        "turnover_s": round(solo / 4, 4),
        "critical_extra_wait_p50_s": round(crit[len(crit) // 2], 4),
        "critical_extra_wait_p99_s": round(crit[min(len(crit) - 1, int(0.99 * len(crit)))], 4),
        "critical": crit_status,
        "sheddable": flood_status,
    }


def priority(c: Cluster, seconds: float) -> dict[str, Any]:
    mock = c.mock("p", itl_ms=10, tokens=20)
    router = _router(
        c, {"p": mock}, backend={"max_inflight": 4}, admission={"max_wait": 5, "max_queue": 256}
    )
    out = asyncio.run(_priority(router.url, seconds))
    router.stop()
    return out


def run(c: Cluster, quick: bool = False) -> dict[str, Any]:
    res = {"overhead": overhead(c, 6.0 if quick else 12.0)}
    print("admission overhead", res["overhead"], flush=True)
    res["priority"] = priority(c, 6.0 if quick else 12.0)
    print("admission priority", res["priority"], flush=True)
    return res


if __name__ == "__main__":
    cluster = Cluster()
    try:
        print(json.dumps(run(cluster, quick=True), indent=2))
    finally:
        cluster.close()
