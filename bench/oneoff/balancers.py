"""Balancer and in-flight store figures, on loopback with real processes.

1. One backend three times slower (inter-token latency) among four, each with a fixed number of
   batch slots (requests beyond it queue, as on a real server): the share of requests each
   backend gets and the p50/p99 time to first token, round robin vs least in flight.
2. Requests/s and router CPU per request with the Redis in-flight store, as ratios to the local
   store (one router each, taking turns).
3. The same for each way to reach Redis: one server, a 3-master Cluster, Sentinel (`ha`).

    python -m bench.oneoff.balancers [--seconds 15] [--only slow|stores|ha]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from bench.kit.loadgen import run_load
from bench.kit.procstat import cpu_seconds
from bench.kit.stats import pct
from tests.support.harness import Cluster, Proc, backend, control, stats

CHAT = "/v1/chat/completions"


def load(router: Proc, body: dict[str, Any], concurrency: int, seconds: float) -> Any:
    return asyncio.run(
        run_load("127.0.0.1", router.port, CHAT, json.dumps(body).encode(), concurrency, seconds)
    )


def slow_backend(c: Cluster, seconds: float) -> dict[str, Any]:
    mocks = {n: c.mock(n, ttft_ms=20, itl_ms=10, tokens=40) for n in ("a", "b", "c", "slow")}
    for m in mocks.values():
        control(m, max_running=8)
    control(mocks["slow"], itl_ms=30)
    body = {"model": "m", "stream": True, "max_tokens": 40, "messages": [{"role": "user"}]}
    out: dict[str, Any] = {}
    for name in ("round_robin", "least_inflight"):
        router = c.router(
            {"backends": [backend(n, m) for n, m in mocks.items()], "balancer": name},
            env={"SLUICEGATE_LOG_LEVEL": "warning"},
        )
        load(router, body, 28, 2)  # warm the pools
        for m in mocks.values():
            control(m, reset_stats=True)
        res = load(router, body, 28, seconds)
        counts = {n: int(stats(m)["requests"]) for n, m in mocks.items()}
        total = sum(counts.values()) or 1
        out[name] = {
            "share": {n: round(v / total, 3) for n, v in counts.items()},
            "ttft_p50_ms": round(pct(res.ttfb, 0.5) * 1000, 1),
            "ttft_p99_ms": round(pct(res.ttfb, 0.99) * 1000, 1),
            "req_s": round(res.ok / res.elapsed, 1),
            "errors": res.errors,
        }
        router.stop()
    for m in mocks.values():
        m.stop()
    return out


def ha_stores(c: Cluster) -> dict[str, dict[str, str]]:
    """Router env per way to reach Redis: one server, a 3-master Cluster, Sentinel."""
    nodes = c.redis_cluster(3)
    _, _, sentinels = c.redis_sentinel("mymaster")
    return {
        "redis": {"SLUICEGATE_REDIS_URL": c.redis().url},
        "redis_cluster": {"SLUICEGATE_REDIS_URL": nodes[0].url, "SLUICEGATE_REDIS_CLUSTER": "1"},
        "redis_sentinel": {
            "SLUICEGATE_REDIS_SENTINELS": json.dumps([f"127.0.0.1:{s.port}" for s in sentinels]),
            "SLUICEGATE_REDIS_SENTINEL_MASTER": "mymaster",
        },
    }


def store_throughput(
    c: Cluster, seconds: float, rounds: int = 3, stores: dict[str, dict[str, str]] | None = None
) -> dict[str, Any]:
    """The routers run side by side and take turns, so drift in what else this machine runs
    hits all alike; router CPU per request is the steadier figure on a shared host."""
    mocks = {n: c.mock(n, tokens=16) for n in ("a", "b")}
    stores = stores or {"redis": {"SLUICEGATE_REDIS_URL": c.redis().url}}
    body = {"model": "m", "stream": True, "max_tokens": 16, "messages": [{"role": "user"}]}
    routers = {
        store: c.router(
            {"backends": [backend(n, m) for n, m in mocks.items()]},
            env={"SLUICEGATE_LOG_LEVEL": "warning", **env},
        )
        for store, env in {"local": {}, **stores}.items()
    }
    runs: dict[str, list[tuple[float, float]]] = {store: [] for store in routers}
    for router in routers.values():
        load(router, body, 32, 2)  # warm up
    for _ in range(rounds):
        for store, router in routers.items():
            cpu0 = cpu_seconds(router.pid)
            res = load(router, body, 32, seconds)
            cpu_ms = (cpu_seconds(router.pid) - cpu0) * 1000 / max(1, res.ok)
            runs[store].append((res.ok / res.elapsed, cpu_ms))
    out: dict[str, Any] = {}
    for store, router in routers.items():
        out[store] = {
            "req_s": [round(r, 1) for r, _ in runs[store]],
            "router_cpu_ms_per_req": [round(c, 3) for _, c in runs[store]],
            "fell_back": router.log().count("counting locally"),
        }
        router.stop()
    for store in stores:
        pairs = list(zip(runs[store], runs["local"], strict=True))
        rs = sorted(r / lo for (r, _), (lo, _) in pairs)
        cs = sorted(c / lc for (_, c), (_, lc) in pairs)
        out[f"{store}_over_local_req_s_median"] = round(rs[len(rs) // 2], 3)
        out[f"{store}_over_local_cpu_per_req_median"] = round(cs[len(cs) // 2], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--only", choices=("slow", "stores", "ha"))
    args = parser.parse_args()
    c = Cluster()
    try:
        result: dict[str, Any] = {}
        if args.only in (None, "slow"):
            result["slow_backend"] = slow_backend(c, args.seconds)
        if args.only in (None, "stores"):
            result["store_throughput"] = store_throughput(c, args.seconds)
        if args.only in (None, "ha"):
            result["ha_store_throughput"] = store_throughput(c, args.seconds, stores=ha_stores(c))
    finally:
        c.close()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
