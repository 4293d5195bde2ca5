"""Discovery's cost, on loopback with real processes.

1. Hot path: router CPU per streamed request and requests/s with two backends found by the
   Kubernetes source (fake API server, tests/support/fake_kube.py) as ratios to the same two
   backends in the file (one router each, taking turns). Discovery adds no per-request work, so the
   ratio should be ~1 within noise.
2. Churn: the time to apply one change (rebuild and swap the snapshot) for a fleet of N
   discovered endpoints, in process.
3. Large (issue 31): 50,000 endpoints through the reconciler into the Fleet, in process.
4. App (issue 31): the whole router (this process, uvicorn) following 5,000 and 50,000
   endpoints from the fake API server (a process of its own): apply times, the longest loop
   block and the slowest /readyz answer while a large list or one slice's change is applied.

    python -m bench.oneoff.discovery [--seconds 5] [--only hot|churn|large|app]
        [--sizes 1000,5000,50000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

from bench.kit.loadgen import run_load
from bench.kit.procstat import cpu_seconds
from router.core.settings import BackendConfig
from router.ops.collector import tune_collector
from router.registry.fleet import Discovered, Fleet, LocalRecords, Registry
from tests.support.fake_kube import FakeKube, endpoint
from tests.support.harness import Cluster, Proc, backend, free_port

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
    the Kubernetes source hands them (one watch event per slice), without the app around it:
    the time to apply all, one endpoint's change, one slice replaced, a re-list, and for each
    the longest the loop was blocked (a 1 ms ticker's worst lateness)."""

    from router.core.settings import KubernetesDiscovery
    from router.discovery.reconcile import Endpoint, Reconciler

    class _Quiet:
        def discovery_event(self, source: str, event: str, n: int = 1) -> None:
            return None

    async def counts(names: Any) -> dict[str, int]:
        return {}

    async def run() -> dict[str, Any]:
        tune_collector()  # the collector as the app's startup leaves it (router/ops/collector.py)
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

        out: dict[str, Any] = {"endpoints": n}

        async def phase(what: str, step: Any) -> None:
            nonlocal worst
            worst = 0.0
            t0, c0 = time.perf_counter(), time.process_time()
            await step()
            out[f"{what}_s"] = round(time.perf_counter() - t0, 3)
            out[f"{what}_cpu_s"] = round(time.process_time() - c0, 3)
            await asyncio.sleep(0.01)  # the ticker wakes and reports the step's last block
            out[f"{what}_max_loop_block_ms"] = round(1000 * worst, 1)

        slices = [eps[k : k + per_slice] for k in range(0, n, per_slice)]
        rec = Reconciler("k", cfg, fleet, counts, _Quiet(), 30)
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)

        async def fill() -> None:
            for i, sl in enumerate(slices):  # watch events, one slice each
                await rec.update_group(f"s{i}", sl)

        async def one_change() -> None:
            changed = list(slices[0])
            changed[0] = Endpoint(changed[0].host, 8000, False)  # drains
            await rec.update_group("s0", changed)

        async def replace_slice() -> None:
            fresh = [Endpoint(f"11.0.{i // 256}.{i % 256}", 8000, True) for i in range(per_slice)]
            await rec.update_group("s1", fresh)

        async def relist() -> None:  # a full re-list: two slices gone, the rest as they were
            await rec.replace({f"s{i}": sl for i, sl in enumerate(slices) if i > 1})

        await phase("apply_all", fill)
        await phase("one_change", one_change)
        await phase("one_slice_replaced", replace_slice)
        await phase("relist_two_slices_gone", relist)
        stop = True
        await tick
        assert len(fleet.registry.snapshot.backends) == n - 2 * per_slice
        return out

    return asyncio.run(run())


def apply_app(n: int, per_slice: int = 1000) -> dict[str, Any]:
    """Issue 31: a router (the real app, served by uvicorn in this process) discovering `n`
    endpoints in slices of `per_slice` from the fake API server (its own process). Measured:
    the time until the router shows the whole set; then the time for a change to show: one
    endpoint added to a slice, one slice's endpoints all replaced, one slice deleted; and for
    each, the longest the loop was held (a 1 ms ticker's worst lateness) and the slowest
    `/readyz` answer (asked every 20 ms)."""
    import subprocess
    import sys
    import tempfile

    import httpx
    import uvicorn
    import yaml

    from router.app import create_app
    from router.core.settings import load_settings

    kport = free_port()
    kube = subprocess.Popen(
        [sys.executable, "-m", "bench.oneoff.kube_proc", str(kport)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def send(**cmd: Any) -> None:
        assert kube.stdin is not None and kube.stdout is not None
        kube.stdin.write(json.dumps(cmd) + "\n")
        kube.stdin.flush()
        assert kube.stdout.readline().strip() == "ok"

    async def run(tmp: Path) -> dict[str, Any]:
        kubeconfig = tmp / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "f", "cluster": {"server": f"http://127.0.0.1:{kport}"}}],
                    "users": [{"name": "t", "user": {"token": "t"}}],
                    "contexts": [{"name": "f", "context": {"cluster": "f", "user": "t"}}],
                    "current-context": "f",
                }
            )
        )
        config = tmp / "config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "log_level": os.environ.get("BENCH_LOG", "warning"),
                    "discovery": [
                        {
                            "kind": "kubernetes",
                            "namespace": "models",
                            "service": "vllm",
                            "port": "http",
                            "models": ["m"],
                            "max_endpoints": 100_000,
                            "kubeconfig": str(kubeconfig),
                            # The apply alone: no probes or scrapes of 50,000 addresses
                            # (BENCH_PROBES=1: with them, as configured by default).
                            "backend": {}
                            if os.environ.get("BENCH_PROBES")
                            else {"health": {"enabled": False}, "metrics_path": None},
                        }
                    ],
                }
            )
        )
        port = free_port()
        app = create_app(load_settings(config))
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")
        )
        loop = asyncio.get_running_loop()
        worst_lag = 0.0
        worst_answer = 0.0
        answers = 0
        count = 0
        stop = False

        gc_start = 0.0
        worst_gc = 0.0
        worst_cpu = 0.0

        def gc_timer(phase: str, info: dict[str, Any]) -> None:
            # The collector's pauses, to tell them from the apply's own work in the loop block.
            nonlocal gc_start, worst_gc
            if phase == "start":
                gc_start = time.perf_counter()
            else:
                worst_gc = max(worst_gc, time.perf_counter() - gc_start)

        gc.callbacks.append(gc_timer)

        async def ticker() -> None:
            # Wall lateness, and the loop thread's CPU time over the same gap: on a shared
            # machine the first also counts time the process waited for a core, the second is
            # what the loop's own work (the apply, the collector) held it for.
            nonlocal worst_lag, worst_cpu
            while not stop:
                t, c = loop.time(), time.thread_time()
                await asyncio.sleep(0.001)
                worst_lag = max(worst_lag, loop.time() - t - 0.001)
                worst_cpu = max(worst_cpu, time.thread_time() - c)

        async def poll(http: httpx.AsyncClient) -> None:
            nonlocal worst_answer, answers, count
            while not stop:
                t = loop.time()
                r = await http.get(f"http://127.0.0.1:{port}/readyz")
                worst_answer = max(worst_answer, loop.time() - t)
                answers += 1
                count = sum(s["backends"] for s in r.json().get("discovery", []))
                if os.environ.get("BENCH_DEBUG"):
                    print(r.json(), flush=True)
                await asyncio.sleep(0.02)

        async def until(want: int, limit: float) -> float:
            nonlocal worst_lag, worst_answer
            t0 = loop.time()
            while count != want:
                if loop.time() - t0 > limit:
                    raise TimeoutError(f"{count} backends, not {want}, after {limit}s")
                await asyncio.sleep(0.005)
            return loop.time() - t0

        serving = asyncio.create_task(server.serve())
        for _ in range(1000):  # started is a flag, not an event
            if server.started:
                break
            await asyncio.sleep(0.01)
        out: dict[str, Any] = {"endpoints": n}
        async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
            tasks = [asyncio.create_task(ticker()), asyncio.create_task(poll(http))]
            try:
                slices = max(1, n // per_slice)
                await asyncio.sleep(0.3)
                # The startup's own pauses (its collection, the client's imports) are not the
                # apply's: the figures start with the fill.
                worst_lag = worst_answer = worst_gc = worst_cpu = 0.0
                cpu0 = time.process_time()
                await asyncio.to_thread(send, op="fill", slices=slices, per_slice=min(n, per_slice))
                out["initial_apply_s"] = round(await until(n, 600), 3)
                # CPU time says what the apply costs when the machine is shared: wall time
                # also counts the time this process waited for a core.
                out["initial_apply_cpu_s"] = round(time.process_time() - cpu0, 3)
                out["initial_max_loop_block_ms"] = round(1000 * worst_lag, 1)
                out["initial_max_loop_block_cpu_ms"] = round(1000 * worst_cpu, 1)
                out["initial_slowest_answer_ms"] = round(1000 * worst_answer, 1)
                out["initial_longest_gc_pause_ms"] = round(1000 * worst_gc, 1)
                await asyncio.sleep(0.5)
                n0 = min(n, per_slice)
                for what, cmd, want in (
                    # one endpoint joins slice 0
                    ("one_endpoint_added", {"ranges": [[0, n0], [n, 1]]}, n + 1),
                    # slice 0's endpoints all replaced by new ones (a rollout of that slice)
                    ("one_slice_replaced", {"ranges": [[n + 1, n0 + 2]]}, n + 2),
                    ("one_slice_deleted", {"op": "delete", "slice": 1}, n + 2 - n0)
                    if slices > 1
                    else ("one_slice_deleted", {"op": "delete", "slice": 0}, 0),
                ):
                    cmd = {"op": "put", "slice": 0, **cmd}
                    worst_lag = worst_answer = worst_gc = worst_cpu = 0.0
                    await asyncio.to_thread(send, **cmd)
                    out[f"{what}_s"] = round(await until(want, 600), 3)
                    await asyncio.sleep(0.3)
                    out[f"{what}_max_loop_block_ms"] = round(1000 * worst_lag, 1)
                    out[f"{what}_max_loop_block_cpu_ms"] = round(1000 * worst_cpu, 1)
                    out[f"{what}_slowest_answer_ms"] = round(1000 * worst_answer, 1)
                    out[f"{what}_longest_gc_pause_ms"] = round(1000 * worst_gc, 1)
                out["readyz_answers"] = answers
            finally:
                stop = True
                await asyncio.gather(*tasks, return_exceptions=True)
                server.should_exit = True
                await serving
                gc.callbacks.remove(gc_timer)
        return out

    try:
        with tempfile.TemporaryDirectory() as tmp:
            return asyncio.run(run(Path(tmp)))
    finally:
        if kube.stdin is not None:
            kube.stdin.close()
        kube.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--only", choices=("hot", "churn", "large", "app"))
    ap.add_argument("--sizes", default="1000,5000,50000", help="endpoints for --only app")
    args = ap.parse_args()
    results: dict[str, Any] = {}
    if args.only in (None, "churn"):
        results["churn"] = churn()
    if args.only in (None, "large"):
        results["large"] = apply_large()
    if args.only in (None, "app"):
        results["app"] = [apply_app(int(n)) for n in args.sizes.split(",")]
    if args.only in (None, "hot"):
        c = Cluster()
        try:
            results["hot_path"] = hot_path(c, args.seconds)
        finally:
            c.close()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
