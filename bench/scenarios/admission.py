"""The admission queue's cost and behaviour (`python -m bench.run --only admission`).

1. overhead: router CPU per request with `admission` configured but nothing queued, against the
   same router without it, plus an A/A pair (two routers without it) for this machine's noise
   floor; and a client key with quotas (rpm, tpm, max_parallel, never reached) against the same
   key without, per process and shared through Redis (`_redis`: both routers use Redis, so the
   ratio is the quota's own round trip). 64-token streams, 32 concurrent, fast mocks with room to
   spare.
2. priority: one backend with 4 slots (`max_inflight: 4`), a `sheddable` flood of 64 concurrent
   clients (closed loop, in a child process), and one `critical` stream at a time after a random
   pause: the critical wait (time to first token minus its time on the idle fleet) in slot
   turnovers (mean request time / slots), beside the router's own queue wait for the band
   (`sluicegate_queue_wait_seconds`). Twice: *lockstep*, every request the same length, so the
   4 slots free together once a request time and a critical request waits for that release,
   two turnovers on average (what an earlier version of this scenario measured, and blamed on
   nothing); *jittered*, output lengths drawn uniformly (10..50 tokens, as real traffic varies),
   so slots free one at a time. The queue wakes the critical request on the first release in
   both (the mock's start times show it first of its batch): the wait is the workload's.
3. shared_tpm: a `tpm` limit shared by 2 replicas x 2 workers through Redis under a flood (8
   clients, far over the limit) for 75 s (15 s quick): the most real tokens admitted in any
   60 s against the limit (full run; the sliding window must keep it <= 1.0x, and near 1.0x).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from typing import Any

import httpx

from bench.kit.procstat import cpu_seconds
from bench.kit.traffic import Client, bodies, collect, durations, flood
from tests.support.harness import Cluster, Proc

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
    from bench.kit.loadgen import run_load

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


def ideal_wait(took: list[float], slots: int) -> float:
    """The mean wait for the first of `slots` busy slots to free, had each slot run requests of
    these durations back to back, independently (the best any scheduler keeping every slot busy
    can do): E[min of `slots` residual lives], P(residual > t) = sum(max(d - t, 0)) / sum(d)."""
    total, step, t, wait = sum(took), 0.0005, 0.0, 0.0
    while True:
        left = sum(max(d - t, 0.0) for d in took) / total
        if left <= 0:
            return wait
        wait += left**slots * step
        t += step


async def _critical_probe(port: int, seconds: float, gap: float, lengths: range) -> list[float]:
    """Critical streams one at a time, each after a random pause (up to `gap` s, so they arrive
    at any phase of the slots' cycle): their times to first token."""
    import random

    rng = random.Random(11)
    pool = bodies(lengths)
    client = Client("127.0.0.1", port, "authorization: Bearer critical\r\n", 30)
    ttft: list[float] = []
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        await asyncio.sleep(rng.uniform(0, gap))
        o = await client.send(rng.choice(pool))
        ttft.append(o.first if o.status == 200 else math.inf)
    client.close()
    return ttft


def priority_realistic(c: Cluster, seconds: float, lengths: range) -> dict[str, Any]:
    """The priority scenario with output lengths drawn from `lengths` (a one-value range: every
    request the same, the slots free together) and critical requests at random phases: a
    critical request's extra time to first token under a sheddable flood (64 clients, closed
    loop, in a child process), in slot turnovers, against the router's own queue wait."""
    slots = 4
    mock = c.mock("p", itl_ms=10)
    keys = [
        {"sha256": hashlib.sha256(band.encode()).hexdigest(), "name": band, "priority": band}
        for band in ("critical", "sheddable")
    ]
    router = _router(
        c,
        {"p": mock},
        backend={"max_inflight": slots},
        admission={"max_wait": 10, "max_queue": 256},
        api_keys=keys,
    )
    try:
        took = durations(router.port, "authorization: Bearer critical\r\n", lengths)
        mean = sum(took) / len(took)
        turnover = mean / slots
        idle = asyncio.run(_critical_probe(router.port, 2.0, mean, lengths))
        solo = sorted(idle)[len(idle) // 2]
        spec = {"port": router.port, "users": 64, "seconds": seconds + 1.5}
        bounds = [lengths[0], lengths[-1] + 1]
        # The sheddable clients give up 2 s past the queue's max_wait (its answers are not judged).
        sheddable = flood({**spec, "secret": "sheddable", "lengths": bounds, "give_up": 12.0})
        time.sleep(1.0)  # the queue fills
        under = asyncio.run(_critical_probe(router.port, seconds, mean, lengths))
        flooded = collect(sheddable, seconds + 60)
        metrics = httpx.get(router.url + "/metrics", timeout=10).text
    finally:
        router.stop()
        mock.stop()
    extra = sorted(t - solo for t in under)
    wait = _queue_wait(metrics)
    crit = wait.get("critical", (0.0, 0.0))
    return {
        "lengths": [lengths[0], lengths[-1]],
        "slots": slots,
        "mean_request_s": round(mean, 4),
        "turnover_s": round(turnover, 4),
        "solo_ttft_ms": round(1000 * solo, 2),
        "critical_requests": len(extra),
        "critical_failed": sum(1 for t in under if t == math.inf),
        "critical_extra_wait_turnovers": {
            "mean": round(sum(extra) / len(extra) / turnover, 2) if extra else None,
            "p50": round(extra[len(extra) // 2] / turnover, 2) if extra else None,
            "p99": round(extra[min(len(extra) - 1, int(0.99 * len(extra)))] / turnover, 2)
            if extra
            else None,
        },
        "router_critical_queue_wait_turnovers": round(crit[1] / crit[0] / turnover, 2)
        if crit[0]
        else None,
        "router_critical_queued": int(crit[0]),
        "ideal_wait_turnovers": round(ideal_wait(took, slots) / turnover, 2),
        "sheddable": flooded,
    }


def _queue_wait(metrics: str) -> dict[str, tuple[float, float]]:
    """(count, sum) of `sluicegate_queue_wait_seconds` by priority."""
    seen: dict[str, list[float]] = {}
    for line in metrics.splitlines():
        for part, i in (("_count{", 0), ("_sum{", 1)):
            if line.startswith("sluicegate_queue_wait_seconds" + part):
                band = line.split('priority="', 1)[1].split('"', 1)[0]
                seen.setdefault(band, [0.0, 0.0])[i] += float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in seen.items()}


def priorities(c: Cluster, quick: bool = False) -> dict[str, Any]:
    """Lockstep (the cause) briefly; jittered (the target) long enough for ~60 critical
    requests, the mean's noise being the wait's own spread over the sample."""
    return {
        "lockstep": priority_realistic(c, 6.0 if quick else 10.0, range(30, 31)),
        "jittered": priority_realistic(c, 8.0 if quick else 30.0, range(10, 51)),
    }


def run(c: Cluster, quick: bool = False) -> dict[str, Any]:
    res = {"overhead": overhead(c, 6.0 if quick else 12.0)}
    print("admission overhead", res["overhead"], flush=True)
    res["priority"] = priorities(c, quick)
    print("admission priority", json.dumps(res["priority"]), flush=True)
    res["shared_tpm"] = shared_tpm(c, 15.0 if quick else 75.0)
    print("admission shared_tpm", res["shared_tpm"], flush=True)
    return res


if __name__ == "__main__":
    cluster = Cluster()
    try:
        print(json.dumps(run(cluster, quick=True), indent=2))
    finally:
        cluster.close()
