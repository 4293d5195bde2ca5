"""Discovery's cost, on loopback with real processes.

1. Hot path: router CPU per streamed request and requests/s with two backends found by the
   Kubernetes source (fake API server, tests/fake_kube.py) as ratios to the same two backends in
   the file (one router each, taking turns). Discovery adds no per-request work, so the ratio
   should be ~1 within noise.
2. Churn: the time to apply one change (rebuild and swap the snapshot) for a fleet of N
   discovered endpoints, in process.

    python -m bench.discovery [--seconds 5] [--only hot|churn]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from bench.loadgen import run_load
from bench.procstat import cpu_seconds
from router.core.settings import BackendConfig
from router.registry.fleet import Discovered, Fleet, LocalRecords, Registry
from tests.fake_kube import FakeKube, endpoint
from tests.harness import Cluster, Proc, backend, free_port

CHAT = "/v1/chat/completions"


def hot_path(c: Cluster, seconds: float, rounds: int = 4) -> dict[str, Any]:
    mocks = [c.mock(n, tokens=64) for n in ("a", "b")]
    kube = FakeKube(free_port())
    try:
        for i, m in enumerate(mocks):
            kube.put_slice(f"s{i}", [endpoint("127.0.0.1")], [{"name": "http", "port": m.port}])
        quiet = {"SLUICEGATE_LOG_LEVEL": "warning"}
        routers = {
            "file": c.router(
                {"backends": [backend(f"f{i}", m) for i, m in enumerate(mocks)]}, env=quiet
            ),
            "kubernetes": c.router(
                {
                    "discovery": [
                        {
                            "kind": "kubernetes",
                            "namespace": "models",
                            "service": "vllm",
                            "port": "http",
                            "models": {"m": "mock-model"},
                            "kubeconfig": str(kube.kubeconfig(c.tmp / "kubeconfig")),
                        }
                    ]
                },
                env=quiet,
            ),
        }
        _wait_backends(routers["kubernetes"], 2)
        body = json.dumps(
            {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        ).encode()
        totals = {k: {"cpu": 0.0, "ok": 0, "elapsed": 0.0, "errors": 0} for k in routers}
        for r in routers.values():
            asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, 16, 1.0))  # warm up
        time.sleep(1.0)  # let the warm-up's connections wind down before the idle reading
        idle = {k: cpu_seconds(r.pid) for k, r in routers.items()}
        time.sleep(seconds)  # background cost: the watch, bookmarks, ticks, health probes
        idle = {k: (cpu_seconds(r.pid) - v) / seconds for k, v in idle.items()}
        for i in range(rounds):
            order = list(routers.items())
            for name, r in order if i % 2 == 0 else reversed(order):  # no side always first
                before = cpu_seconds(r.pid)
                res = asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, 16, seconds))
                t = totals[name]
                t["cpu"] += cpu_seconds(r.pid) - before
                t["ok"] += res.ok
                t["elapsed"] += res.elapsed
                t["errors"] += res.errors
        out: dict[str, Any] = {}
        for name, t in totals.items():
            out[name] = {
                "cpu_ms_per_request": round(1000 * t["cpu"] / max(1, t["ok"]), 3),
                "req_s": round(t["ok"] / t["elapsed"], 1),
                "errors": t["errors"],
                "idle_cpu_ms_per_s": round(1000 * idle[name], 2),
            }
        f, k = out["file"], out["kubernetes"]
        out["ratio_cpu_per_request"] = round(k["cpu_ms_per_request"] / f["cpu_ms_per_request"], 3)
        out["ratio_req_s"] = round(k["req_s"] / f["req_s"], 3)
        return out
    finally:
        kube.close()


def _wait_backends(router: Proc, n: int) -> None:
    import httpx

    end = time.monotonic() + 15
    while time.monotonic() < end:
        if len(httpx.get(router.url + "/admin/backends").json()) == n:
            return
        time.sleep(0.05)
    raise TimeoutError("discovery found no backends")


def churn(sizes: tuple[int, ...] = (10, 100, 500), repeats: int = 20) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in sizes:
        fleet = Fleet(Registry([], "least_inflight"), [], LocalRecords())
        entries = {
            f"p-{i}": Discovered(
                BackendConfig(
                    name=f"p-{i}", url=f"http://10.0.{i // 250}.{i % 250}:8000", models={"m": "m"}
                ),
                "kubernetes",
            )
            for i in range(n)
        }
        fleet.set_discovered("k", entries)
        times = []
        for r in range(repeats):
            changed = dict(entries)
            changed["p-0"] = Discovered(
                entries["p-0"].config, "kubernetes", draining=bool(r % 2 == 0)
            )
            t0 = time.perf_counter()
            fleet.set_discovered("k", changed)
            times.append(time.perf_counter() - t0)
        out[str(n)] = {"ms_per_change": round(1000 * sorted(times)[len(times) // 2], 3)}
    return out


def apply_large(n: int = 50_000, per_slice: int = 1000) -> dict[str, Any]:
    """Issue 31: `n` endpoints (slices of `per_slice`) through the reconciler into the Fleet, as
    the Kubernetes source hands them: the time to apply, and the longest the loop was blocked
    (a 1 ms ticker's worst lateness)."""
    import httpx

    from router.core.settings import KubernetesDiscovery
    from router.discovery.reconcile import Endpoint, Reconciler

    class _Quiet:
        def discovery_event(self, source: str, event: str) -> None:
            return None

    async def counts(names: Any) -> dict[str, int]:
        return {}

    async def run() -> dict[str, Any]:
        cfg = KubernetesDiscovery.model_validate(
            {
                "kind": "kubernetes",
                "namespace": "m",
                "service": "vllm",
                "port": 8000,
                "models": ["m"],
                "max_endpoints": 100_000,
            }
        )
        fleet = Fleet(Registry([], "least_inflight"), [], LocalRecords())
        eps = [
            Endpoint(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 8000, True) for i in range(n)
        ]
        worst = 0.0
        stop = False

        async def ticker() -> None:
            nonlocal worst
            loop = asyncio.get_running_loop()
            while not stop:
                t = loop.time()
                await asyncio.sleep(0.001)
                worst = max(worst, loop.time() - t - 0.001)

        async with httpx.AsyncClient() as http:
            rec = Reconciler("k", cfg, fleet, counts, _Quiet(), 30, http)
            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            for k in range(per_slice, n + 1, per_slice):  # slices arriving one by one
                await rec.update(eps[:k])
            total = time.perf_counter() - t0
            t1 = time.perf_counter()
            changed = list(eps)
            changed[0] = Endpoint(eps[0].host, 8000, False)
            await rec.update(changed)  # one change on the full fleet
            one = time.perf_counter() - t1
            stop = True
            await tick
        assert len(fleet.registry.snapshot.backends) == n
        return {
            "endpoints": n,
            "apply_all_s": round(total, 3),
            "one_change_s": round(one, 3),
            "max_loop_block_ms": round(1000 * worst, 1),
        }

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--only", choices=("hot", "churn", "large"))
    args = ap.parse_args()
    results: dict[str, Any] = {}
    if args.only in (None, "churn"):
        results["churn"] = churn()
    if args.only in (None, "large"):
        results["large"] = apply_large()
    if args.only in (None, "hot"):
        c = Cluster()
        try:
            results["hot_path"] = hot_path(c, args.seconds)
        finally:
            c.close()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
