"""The scenarios sluicegate was first measured by, beside a direct connection (and nginx, when
installed): `overhead`, `streaming`, `storm`, `soak` and `multi` (`python -m bench.run --only
NAME`). Each runs on the run's Bench and adds its figures to it.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from bench.kit.cluster import CHAT, Bench, short
from bench.kit.loadgen import Result, run_load
from bench.kit.page import fmt, table
from bench.kit.procstat import cpu_seconds, open_fds, rss_mb, socket_states
from bench.kit.report import Row
from bench.kit.stats import pct
from tests.support.harness import Proc


def overhead(bench: Bench) -> None:
    up = bench.mock("fast", tokens=64)
    router = bench.router([up])
    ngx = bench.nginx([up])
    targets: dict[str, tuple[Proc | None, Proc]] = {
        "direct": (None, up),
        "router": (router, router),
    }
    if ngx:
        targets["nginx"] = (ngx, ngx)
    base = bench.router([up], src=bench.baseline_src) if bench.baseline_src else None
    if base is not None:
        targets["baseline"] = (base, base)
    routed = ("router", "baseline")
    body = {"stream": True, "max_tokens": 64}
    rounds = 2 if bench.quick else 4
    seconds = 3.0 if bench.quick else 6.0
    out: dict[str, Any] = {}
    for conc in (32, 256):
        agg: dict[str, dict[str, Any]] = {
            k: {"ok": 0, "elapsed": 0.0, "ttfb": [], "cpu": 0.0, "lg": [], "errors": 0}
            for k in targets
        }
        for k, (hop, tgt) in targets.items():  # warm-up: connections, pools, caches
            bench.measured(
                hop,
                tgt,
                {**body, "model": "m" if k in routed else "mock-model"},
                conc,
                duration=1.0,
            )
        for rnd in range(rounds):
            order = list(targets)
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            for k in order:
                hop, tgt = targets[k]
                b = {**body, "model": "m" if k in routed else "mock-model"}
                m = bench.measured(hop, tgt, b, conc, duration=seconds)
                a = agg[k]
                a["ok"] += m["ok"]
                a["errors"] += m["errors"]
                a["elapsed"] += m["elapsed"]
                a["ttfb"] += m["ttfb"]
                a["cpu"] += m["hop_cpu_s"]
                a["lg"].append(m["loadgen_cpu_share"])
        row: dict[str, Any] = {}
        for k, a in agg.items():
            row[k] = {
                "rps": a["ok"] / a["elapsed"],
                "errors": a["errors"],
                "ttfb_p50_ms": pct(a["ttfb"], 0.5) * 1000,
                "ttfb_p99_ms": pct(a["ttfb"], 0.99) * 1000,
                "cpu_ms_per_req": (a["cpu"] / a["ok"] * 1000)
                if a["ok"] and k != "direct"
                else None,
                "loadgen_cpu_share": max(a["lg"]),
            }
            bench.samples[f"overhead_c{conc}_{k}"] = a["ttfb"]
        d = row["direct"]
        row["router_vs_direct_rps"] = row["router"]["rps"] / d["rps"]
        row["router_added_ttfb_p50_ms"] = row["router"]["ttfb_p50_ms"] - d["ttfb_p50_ms"]
        row["router_added_ttfb_p99_ms"] = row["router"]["ttfb_p99_ms"] - d["ttfb_p99_ms"]
        if "baseline" in row:
            row["router_vs_baseline_cpu"] = (
                row["router"]["cpu_ms_per_req"] / row["baseline"]["cpu_ms_per_req"]
            )
        if "nginx" in row:
            row["router_vs_nginx_rps"] = row["router"]["rps"] / row["nginx"]["rps"]
            row["nginx_vs_direct_rps"] = row["nginx"]["rps"] / d["rps"]
        out[f"c{conc}"] = row
        print(f"overhead c={conc}: " + json.dumps(short(row)), flush=True)
    bench.results["overhead"] = out
    for p in (router, ngx, base, up):
        if p:
            p.stop()


def streaming(bench: Bench) -> None:
    up = bench.mock("stream", itl_ms=20, tokens=256)
    router = bench.router([up])
    streams = 500
    body = {"stream": True, "max_tokens": 256}
    res: dict[str, Any] = {}
    rss: list[float] = []
    for k, hop, tgt, model in (
        ("direct", None, up, "mock-model"),
        ("router", router, router, "m"),
    ):
        sampler = _Sampler(router.pid) if k == "router" else None
        cpu0 = cpu_seconds(router.pid)
        m = bench.measured(
            hop,
            tgt,
            {**body, "model": model},
            streams,
            requests=streams * (1 if bench.quick else 2),
            request_timeout=60,
            ramp=2.0,
        )
        cpu1 = cpu_seconds(router.pid)
        if sampler:
            rss = sampler.stop()
        res[k] = {
            "ok": m["ok"],
            "errors": m["errors"],
            "ttfb_p50_ms": pct(m["ttfb"], 0.5) * 1000,
            "ttfb_p99_ms": pct(m["ttfb"], 0.99) * 1000,
        }
        if k == "router":
            res[k]["cpu_s_per_1000_req"] = (cpu1 - cpu0) / max(1, m["ok"]) * 1000
            res[k]["peak_rss_mb"] = max(rss) if rss else rss_mb(router.pid)
        bench.samples[f"streaming_{k}"] = m["ttfb"]
    res["added_ttfb_p50_ms"] = res["router"]["ttfb_p50_ms"] - res["direct"]["ttfb_p50_ms"]
    res["added_ttfb_p99_ms"] = res["router"]["ttfb_p99_ms"] - res["direct"]["ttfb_p99_ms"]
    bench.samples["streaming_rss"] = rss
    bench.results["streaming"] = res
    print("streaming: " + json.dumps(short(res)), flush=True)
    router.stop()
    up.stop()


def storm(bench: Bench) -> None:
    tokens = 256
    up = bench.mock("storm", itl_ms=20, tokens=tokens)
    router = bench.router([up])
    users = 500
    duration = 20.0 if bench.quick else 120.0
    rss_before = rss_mb(router.pid)
    fds_before = open_fds(router.pid)
    sampler = _Sampler(router.pid)
    m = bench.measured(
        router,
        router,
        {"model": "m", "stream": True},
        users,
        duration=duration,
        abort_after_chunks=5,
        request_timeout=30,
    )
    rss_series = sampler.stop()
    time.sleep(2.0)  # let the last aborts settle
    st = httpx.get(up.url + "/stats").json()
    inflight = sum(b["in_flight"] for b in httpx.get(router.url + "/admin/backends").json())
    would_have = m["aborted"] * tokens
    # Clients saw at least 5 tokens each before closing, so this over-states the waste.
    wasted = max(0, st["tokens_generated"] - 5 * m["aborted"])
    half = len(rss_series) // 2
    res = {
        "aborted_streams": m["aborted"],
        "errors": m["errors"],
        "waste_percent": 100.0 * wasted / would_have if would_have else None,
        "tokens_after_upstream_saw_close": st["tokens_after_disconnect"],
        "rss_before_mb": rss_before,
        "rss_after_mb": rss_mb(router.pid),
        "rss_first_half_mean_mb": statistics.mean(rss_series[:half]) if half else None,
        "rss_second_half_mean_mb": statistics.mean(rss_series[half:]) if half else None,
        "fds_before": fds_before,
        "fds_after": open_fds(router.pid),
        # Client <-> router sockets (the load generator closes first, so its TIME_WAITs land
        # here too) and router <-> backend sockets, which are the router's own business.
        "sockets_after_client_side": socket_states([router.port]),
        "sockets_after_upstream_side": socket_states([up.port]),
        "inflight_after": inflight,
        "upstream_running_after": st["running"],
        "router_cpu_s": m["hop_cpu_s"],
    }
    bench.samples["storm_rss"] = rss_series
    bench.results["storm"] = res
    print("storm: " + json.dumps(short(res)), flush=True)
    router.stop()
    up.stop()


def soak(bench: Bench) -> None:
    duration = bench.soak_seconds or (30.0 if bench.quick else 240.0)
    up = bench.mock("soak", itl_ms=5, tokens=64)
    router = bench.router([up])
    fds0 = open_fds(router.pid)
    sampler = _Sampler(router.pid, every=1.0)

    async def mixed() -> tuple[Result, Result, Result]:
        host, port = "127.0.0.1", router.port
        return await asyncio.gather(
            run_load(host, port, CHAT, b'{"model":"m","stream":true}', 40, duration=duration),
            run_load(host, port, CHAT, b'{"model":"m"}', 20, duration=duration),
            run_load(
                host,
                port,
                CHAT,
                b'{"model":"m","stream":true}',
                40,
                duration=duration,
                abort_after_chunks=3,
            ),
        )

    rs = asyncio.run(mixed())
    series = sampler.stop()
    time.sleep(1.0)
    slope = _slope(series[len(series) // 4 :])  # after warm-up
    res = {
        "seconds": duration,
        "requests": sum(r.ok + r.aborted for r in rs),
        "errors": sum(r.errors for r in rs),
        "rss_start_mb": series[0] if series else None,
        "rss_end_mb": series[-1] if series else None,
        "rss_slope_mb_per_min": slope * 60,
        "fds_start": fds0,
        "fds_end": open_fds(router.pid),
    }
    bench.samples["soak_rss"] = series
    bench.results["soak"] = res
    print("soak: " + json.dumps(short(res)), flush=True)
    router.stop()
    up.stop()


def multi(bench: Bench) -> None:
    # No token delay: throughput is then bound by CPU, not by how long a stream lasts.
    ups = [bench.mock(f"mr{i}", tokens=64) for i in range(4)]
    redis = bench.cluster.redis()
    body = b'{"model":"m","stream":true}'
    seconds = 5.0 if bench.quick else 10.0

    def run(ports: list[int]) -> Result:
        async def many() -> list[Result]:
            return await asyncio.gather(
                *(run_load("127.0.0.1", p, CHAT, body, 64, duration=seconds) for p in ports)
            )

        rs = asyncio.run(many())
        return Result(
            ok=sum(r.ok for r in rs),
            errors=sum(r.errors for r in rs),
            elapsed=max(r.elapsed for r in rs),
        )

    env = {"SLUICEGATE_REDIS_URL": redis.url, "SLUICEGATE_LOG_LEVEL": "warning"}
    cfg = {
        "backends": [
            {"name": f"b{i}", "url": u.url, "models": {"m": "mock-model"}}
            for i, u in enumerate(ups)
        ]
    }
    one = bench.cluster.router(cfg, workers=2, env=env)
    r1 = run([one.port])
    two = bench.cluster.router(cfg, workers=2, env=env)
    r2 = run([one.port, two.port])
    counts = [httpx.get(u.url + "/stats").json()["requests"] for u in ups]
    shared = [
        all(b.get("inflight_shared", False) for b in httpx.get(p.url + "/admin/backends").json())
        for p in (one, two)
    ]
    res = {
        "one_router_rps": r1.ok / r1.elapsed,
        "two_routers_rps": r2.ok / r2.elapsed,
        "ratio": (r2.ok / r2.elapsed) / (r1.ok / r1.elapsed),
        "errors": r1.errors + r2.errors,
        "requests_per_backend": counts,
        "balance_spread": (max(counts) - min(counts)) / statistics.mean(counts),
        "counts_shared_at_end": shared,
        "note": "2 routers x 2 workers share 2 cores with the load generator and mocks",
    }
    bench.results["multi_replica"] = res
    print("multi: " + json.dumps(short(res)), flush=True)
    for p in (one, two, redis, *ups):
        p.stop()


class _Sampler:
    """RSS of a process tree every `every` seconds, on a thread, until stop()."""

    def __init__(self, pid: int, every: float = 0.25) -> None:
        import threading

        self.pid, self.every, self.values = pid, every, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.values.append(rss_mb(self.pid))

    def stop(self) -> list[float]:
        self._stop.set()
        self._t.join(5)
        return list(self.values)


def _slope(series: list[float]) -> float:
    """Least-squares slope per sample index (samples are one second apart in the soak)."""
    n = len(series)
    if n < 3:
        return 0.0
    xs = range(n)
    mx, my = (n - 1) / 2, statistics.mean(series)
    return sum((x - mx) * (y - my) for x, y in zip(xs, series, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def overhead_section(res: dict[str, Any]) -> list[str]:
    out = ["## Overhead (64-token streams, no token delay)", ""]
    rows: list[tuple[str, ...]] = [
        (
            "concurrency",
            "target",
            "req/s",
            "TTFC p50 ms",
            "TTFC p99 ms",
            "hop CPU ms/req",
            "loadgen CPU share",
        )
    ]
    for c, row in res.items():
        for k in ("direct", "nginx", "router"):
            if k in row:
                v = row[k]
                rows.append(
                    (
                        c[1:],
                        k,
                        fmt(v["rps"]),
                        fmt(v["ttfb_p50_ms"]),
                        fmt(v["ttfb_p99_ms"]),
                        fmt(v["cpu_ms_per_req"]),
                        fmt(v["loadgen_cpu_share"]),
                    )
                )
    out += [table(rows), ""]
    rows = [
        (
            "concurrency",
            "router/direct req/s",
            "router/nginx req/s",
            "added TTFC p50 ms",
            "added TTFC p99 ms",
        )
    ]
    for c, row in res.items():
        rows.append(
            (
                c[1:],
                fmt(row["router_vs_direct_rps"]),
                fmt(row.get("router_vs_nginx_rps")),
                fmt(row["router_added_ttfb_p50_ms"]),
                fmt(row["router_added_ttfb_p99_ms"]),
            )
        )
    out += [table(rows), ""]
    return out


def _dumped(title: str, res: dict[str, Any]) -> list[str]:
    return [f"## {title}", "", "```json", json.dumps(res, indent=2), "```", ""]


def streaming_section(res: dict[str, Any]) -> list[str]:
    return _dumped("Realistic streaming (500 streams, 20 ms/token, 256 tokens)", res)


def storm_section(res: dict[str, Any]) -> list[str]:
    return _dumped("Disconnect storm (500 users, close after the 5th chunk)", res)


def soak_section(res: dict[str, Any]) -> list[str]:
    return _dumped("Soak (mixed streams, disconnects, non-streaming)", res)


def multi_section(res: dict[str, Any]) -> list[str]:
    return _dumped("Multi-replica (Redis in-flight store)", res)


def overhead_targets(r: dict[str, Any]) -> list[Row]:
    o = r.get("overhead", {}).get("c32")
    if not o:
        return []
    vs_nginx = o.get("router_vs_nginx_rps")
    cpu = o["router"]["cpu_ms_per_req"]
    added = o["router_added_ttfb_p50_ms"]
    return [
        (
            "overhead c=32: req/s vs nginx",
            ">= 0.5",
            vs_nginx,
            None if vs_nginx is None else vs_nginx >= 0.5,
        ),
        ("overhead c=32: router CPU ms/request", "<= 1", cpu, cpu <= 1),
        ("overhead c=32: added TTFC p50 ms", "<= 2", added, added <= 2),
    ]


def streaming_targets(r: dict[str, Any]) -> list[Row]:
    st = r.get("streaming")
    if not st:
        return []
    rss = st["router"]["peak_rss_mb"]
    return [
        (
            "streaming: added TTFC p99 ms",
            "<= 10",
            st["added_ttfb_p99_ms"],
            st["added_ttfb_p99_ms"] <= 10,
        ),
        ("streaming: router peak RSS MB", "<= 150", rss, rss <= 150),
    ]


def storm_targets(r: dict[str, Any]) -> list[Row]:
    sm = r.get("storm")
    if not sm:
        return []
    w = sm["waste_percent"]
    grow = (sm["rss_second_half_mean_mb"] or 0) - (sm["rss_first_half_mean_mb"] or 0)
    return [
        ("storm: waste %", "<= 1", w, w is not None and w <= 1),
        ("storm: in flight afterwards", "0", sm["inflight_after"], sm["inflight_after"] == 0),
        ("storm: RSS growth, 2nd half vs 1st (MB)", "~0", grow, grow < 5),
        (
            "storm: open fds before -> after",
            "no growth",
            f"{sm['fds_before']} -> {sm['fds_after']}",
            sm["fds_after"] <= sm["fds_before"] + 2,
        ),
    ]


def multi_targets(r: dict[str, Any]) -> list[Row]:
    mr = r.get("multi_replica")
    if not mr:
        return []
    return [("multi-replica: 2 routers vs 1 (req/s)", ">= 1.7", mr["ratio"], mr["ratio"] >= 1.7)]
