"""The admission queue's cost and behaviour (`python -m bench.run --only admission`).

1. overhead: router CPU per request with `admission` configured but nothing queued, against the
   same router without it, plus an A/A pair (two routers without it) for this machine's noise
   floor; and a client key with quotas (rpm, tpm, max_parallel, never reached) against the same
   key without, per process and shared through Redis (`_redis`: both routers use Redis, so the
   ratio is the quota's own round trip). 64-token streams, 32 concurrent, fast mocks with room to
   spare.
3. shared_tpm: a `tpm` limit shared by 2 replicas x 2 workers through Redis under a flood (8
   clients, far over the limit) for 75 s (15 s quick): the most real tokens admitted in any
   60 s against the limit (full run; the sliding window must keep it <= 1.0x, and near 1.0x).
2. priority: one backend with 4 slots (`max_inflight: 4`), a `sheddable` flood of 64 concurrent
   clients, and one `critical` request at a time: the critical wait (time to first byte minus the
   same request's time on an idle fleet) against one slot's turnover (request time / slots), and
   the router's own queue wait per band (`sluicegate_queue_wait_seconds`). The mock's requests
   all take the same time, so the 4 slots free together, every request time, not one every
   turnover: a critical request waits for the next release, up to one request time.
"""

from __future__ import annotations

import asyncio
import hashlib
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
    key = "sk-bench-0123456789"
    digest = hashlib.sha256(key.encode()).hexdigest()
    limits = {"rpm": 10_000_000, "tpm": 10_000_000_000, "max_parallel": 100_000}
    redis_url = c.redis().url
    plain, quota = [{"sha256": digest, "name": "k"}], [{"sha256": digest, "name": "k", **limits}]
    routers = {
        "off": _router(c, mocks),
        "on": _router(c, mocks, admission={"max_wait": 30}),
        "off_again": _router(c, mocks),
        "key": _router(c, mocks, api_keys=plain),
        "key_quota": _router(c, mocks, api_keys=quota),
        "key_redis": _router(c, mocks, api_keys=plain, redis_url=redis_url),
        "key_quota_redis": _router(c, mocks, api_keys=quota, redis_url=redis_url),
    }
    auth = f"authorization: Bearer {key}\r\n"
    headers = {k: auth if k.startswith("key") else "" for k in routers}
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user"}]}).encode()
    cpu = {k: 0.0 for k in routers}
    reqs = {k: 0 for k in routers}
    errors = {k: 0 for k in routers}
    names = list(routers)
    n = len(names)
    for k, r in routers.items():  # warm-up: connections, pools, caches
        asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, 32, 0.5, extra_headers=headers[k]))
    for i in range(n):  # rotate the order each round: noise and drift hit all alike
        for k in names[i % n :] + names[: i % n]:
            r = routers[k]
            c0 = cpu_seconds(r.pid)
            res = asyncio.run(
                run_load("127.0.0.1", r.port, CHAT, body, 32, seconds / n, extra_headers=headers[k])
            )
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
        "ratio_quota_key": round(ms["key_quota"] / ms["key"], 3),
        "ratio_quota_key_redis": round(ms["key_quota_redis"] / ms["key_redis"], 3),
    }


async def _flood(urls: list[str], key: str, seconds: float) -> list[tuple[float, int]]:
    """8 clients over the replicas until `seconds` pass: (time, real tokens) of each admitted."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    admitted: list[tuple[float, int]] = []
    stop = time.monotonic() + seconds
    async with httpx.AsyncClient(timeout=30) as http:

        async def user(i: int) -> None:
            n = i
            while time.monotonic() < stop:
                n += 1
                r = await http.post(
                    urls[n % len(urls)] + CHAT,
                    json=body,
                    headers={"authorization": f"Bearer {key}"},
                )
                if r.status_code == 200:
                    admitted.append((time.monotonic(), int(r.json()["usage"]["total_tokens"])))
                else:
                    await asyncio.sleep(0.02)  # a refused client backs off a little

        await asyncio.gather(*(user(i) for i in range(8)))
    return admitted


def shared_tpm(c: Cluster, seconds: float) -> dict[str, Any]:
    mock = c.mock("t", tokens=50)
    key = "sk-bench-shared-0123456789"
    tpm = 20_000
    cfg = {
        "backends": [{"name": "t", "url": mock.url, "models": {"m": "mock-model"}}],
        "health": {"interval": 60},
        "redis_url": c.redis().url,
        "api_keys": [{"sha256": hashlib.sha256(key.encode()).hexdigest(), "tpm": tpm}],
    }
    routers = [c.router(cfg, env={"SLUICEGATE_LOG_LEVEL": "warning"}, workers=2) for _ in range(2)]
    admitted = asyncio.run(_flood([r.url for r in routers], key, seconds))
    for r in routers:
        r.stop()
    admitted.sort()
    # The most tokens whose answers arrived within any 60 s: a two-pointer sweep.
    best, total, j = 0, 0, 0
    for t, tokens in admitted:
        total += tokens
        while admitted[j][0] <= t - 60:
            total -= admitted[j][1]
            j += 1
        best = max(best, total)
    return {
        "tpm": tpm,
        "seconds": seconds,
        "admitted_requests": len(admitted),
        "max_tokens_in_60s": best,
        "ratio_to_limit": round(best / tpm, 3),
    }


async def _priority(url: str, port: int, seconds: float) -> dict[str, Any]:
    from bench.loadgen import run_load

    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 20}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:

        async def timed(band: str) -> tuple[int, float]:
            t0 = time.perf_counter()
            r = await http.post(url + CHAT, json=body, headers={"authorization": f"Bearer {band}"})
            return r.status_code, time.perf_counter() - t0

        idle = [(await timed("critical"))[1] for _ in range(10)]
        solo = sorted(idle)[len(idle) // 2]
        stop = time.monotonic() + seconds
        # The flood through the raw load generator: httpx in this loop could not keep 64
        # clients busy and would blur the critical requests' timings.
        flood = asyncio.create_task(
            run_load(
                "127.0.0.1",
                port,
                CHAT,
                json.dumps(body).encode(),
                64,
                seconds,
                extra_headers="authorization: Bearer sheddable\r\n",
            )
        )
        await asyncio.sleep(1.0)  # the queue fills
        crit: list[float] = []
        crit_status: dict[int, int] = {}
        while time.monotonic() < stop - 1:
            status, took = await timed("critical")
            crit_status[status] = crit_status.get(status, 0) + 1
            crit.append(took - solo)
            await asyncio.sleep(0.05)
        flooded = await flood
        metrics = (await http.get(url + "/metrics")).text
    crit.sort()
    # The router's own account of the queue wait: free of this client's event-loop lag.
    queued: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("sluicegate_queue_wait_seconds") and 'priority="critical"' in line:
            name, value = line.rsplit(" ", 1)
            if name.startswith("sluicegate_queue_wait_seconds_bucket"):
                le = name.split('le="', 1)[1].split('"', 1)[0]
                if le in ("0.05", "0.1"):
                    queued[f"le_{le}"] = float(value)
            else:
                queued[name.split("{", 1)[0].rsplit("_", 1)[1]] = float(value)
    count = queued.get("count", 0.0)
    shed_sum = shed_count = 0.0
    for line in metrics.splitlines():
        if 'priority="sheddable"' in line and line.startswith("sluicegate_queue_wait_seconds_"):
            if line.startswith("sluicegate_queue_wait_seconds_sum"):
                shed_sum = float(line.rsplit(" ", 1)[1])
            elif line.startswith("sluicegate_queue_wait_seconds_count"):
                shed_count = float(line.rsplit(" ", 1)[1])
    return {
        "solo_s": round(solo, 4),
        "turnover_s": round(solo / 4, 4),
        "critical_extra_wait_p50_s": round(crit[len(crit) // 2], 4),
        "critical_extra_wait_p99_s": round(crit[min(len(crit) - 1, int(0.99 * len(crit)))], 4),
        "critical_queued": int(count),
        "critical_queue_wait_mean_s": round(queued.get("sum", 0.0) / count, 4) if count else None,
        "critical_queue_wait_share_le_turnover": round(queued.get("le_0.05", 0) / count, 3)
        if count
        else None,
        "sheddable_queue_wait_mean_s": round(shed_sum / shed_count, 4) if shed_count else None,
        "critical": crit_status,
        "sheddable": {"ok": flooded.ok, "errors": flooded.errors},
    }


def priority(c: Cluster, seconds: float) -> dict[str, Any]:
    mock = c.mock("p", itl_ms=10, tokens=20)
    # Two keys (the key is its band's name here): a critical one and a sheddable one.
    keys = [
        {"sha256": hashlib.sha256(band.encode()).hexdigest(), "name": band, "priority": band}
        for band in ("critical", "sheddable")
    ]
    router = _router(
        c,
        {"p": mock},
        backend={"max_inflight": 4},
        admission={"max_wait": 5, "max_queue": 256},
        api_keys=keys,
    )
    out = asyncio.run(_priority(router.url, router.port, seconds))
    router.stop()
    return out


def run(c: Cluster, quick: bool = False) -> dict[str, Any]:
    res = {"overhead": overhead(c, 6.0 if quick else 12.0)}
    print("admission overhead", res["overhead"], flush=True)
    res["priority"] = priority(c, 6.0 if quick else 12.0)
    print("admission priority", res["priority"], flush=True)
    res["shared_tpm"] = shared_tpm(c, 15.0 if quick else 75.0)
    print("admission shared_tpm", res["shared_tpm"], flush=True)
    return res


if __name__ == "__main__":
    cluster = Cluster()
    try:
        print(json.dumps(run(cluster, quick=True), indent=2))
    finally:
        cluster.close()
