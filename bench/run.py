"""The benchmark: sluicegate beside a direct connection (and nginx, when installed), one run.

    python -m bench.run --quick          # under 2 minutes
    python -m bench.run                  # the full run, about 19 minutes (soak, prefix, noisy)
    python -m bench.run --only overhead  # one scenario (its section of the docs is replaced,
                                         # the others are kept)
    python -m bench.run --only compare   # beside a textbook FastAPI proxy and LiteLLM
    python -m bench.run --quick --only overhead --baseline-src DIR   # A/B against a checkout
    python -m bench.run --only hop --check   # beside nginx and the floor; exit 1 when CPU per
                                             # request vs nginx grew > 5 % over the baseline

Targets are started and stopped here (mock upstreams, the router, nginx, redis-server), all on
127.0.0.1; loads alternate between targets in rounds so noise on this shared machine spreads
evenly. Results: bench/results/latest.json, a markdown table, and PNG plots (matplotlib, when
installed) under docs/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvloop

from bench.loadgen import Result, run_load
from bench.procstat import cpu_seconds, open_fds, rss_mb, socket_states
from tests.harness import Cluster, Proc, free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def nginx_conf(port: int, upstreams: list[int], tmp: Path) -> Path:
    servers = "\n".join(f"    server 127.0.0.1:{p};" for p in upstreams)
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
master_process off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/f; uwsgi_temp_path {tmp}/u; scgi_temp_path {tmp}/s;
  upstream mock {{
{servers}
    keepalive 512;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://mock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
      proxy_read_timeout 300s;
    }}
  }}
}}
""")
    return conf


def start_nginx(cluster: Cluster, ups: list[Proc]) -> Proc | None:
    """nginx in front of `ups` (None when it is not installed)."""
    binary = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if binary is None:
        return None
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="sluicegate-nginx-", dir=cluster.tmp))
    conf = nginx_conf(port, [u.port for u in ups], tmp)
    proc = cluster._spawn([binary, "-c", str(conf), "-p", str(tmp)], port, "nginx", None)
    wait_http(f"http://127.0.0.1:{port}/health", proc=proc.popen)
    return proc


class Bench:
    def __init__(
        self, quick: bool, soak_seconds: float | None = None, baseline_src: str | None = None
    ) -> None:
        self.quick = quick
        self.baseline_src = baseline_src  # overhead: also a router from this checkout (A/B)
        self.soak_seconds = soak_seconds
        self.cluster = Cluster()
        self.results: dict[str, Any] = {}
        self.samples: dict[str, list[float]] = {}
        self.check = False  # hop: the CPU/request gate against bench/hop_baseline.json

    # ---------- processes
    def mock(self, name: str, **kw: Any) -> Proc:
        return self.cluster.mock(name, **kw)

    def router(
        self, ups: list[Proc], workers: int = 1, src: str | None = None, **extra: Any
    ) -> Proc:
        cfg = {
            "backends": [
                {"name": f"b{i}", "url": u.url, "models": {"m": "mock-model"}}
                for i, u in enumerate(ups)
            ],
            **extra,
        }
        # One JSON line per request is part of the product; the benchmark keeps it on but sends
        # it to the log file, as a deployment would.
        # One hash seed for every router: the layout of its dicts and sets moves one process's
        # CPU per request by 1-4 % against another's of the same code (four identical routers
        # spread 0.6 % with one seed), which would drown the A/B comparisons below.
        env = {"SLUICEGATE_LOG_LEVEL": "warning", "PYTHONHASHSEED": "0"}
        return self.cluster.router(cfg, workers=workers, env=env, src=src)

    def nginx(self, ups: list[Proc]) -> Proc | None:
        return start_nginx(self.cluster, ups)

    # ---------- load
    def load(self, target: Proc, body: dict[str, Any], concurrency: int, **kw: Any) -> Result:
        payload = json.dumps(body).encode()
        return asyncio.run(run_load("127.0.0.1", target.port, CHAT, payload, concurrency, **kw))

    def measured(
        self, hop: Proc | None, target: Proc, body: dict[str, Any], concurrency: int, **kw: Any
    ) -> dict[str, Any]:
        cpu0 = cpu_seconds(hop.pid) if hop else 0.0
        r = self.load(target, body, concurrency, **kw)
        cpu1 = cpu_seconds(hop.pid) if hop else 0.0
        return {
            "ok": r.ok,
            "errors": r.errors,
            "aborted": r.aborted,
            "elapsed": r.elapsed,
            "ttfb": r.ttfb,
            "hop_cpu_s": cpu1 - cpu0,
            "loadgen_cpu_share": r.cpu_s / r.elapsed if r.elapsed else 0.0,
        }

    # ---------- scenarios
    def overhead(self) -> None:
        up = self.mock("fast", tokens=64)
        router = self.router([up])
        ngx = self.nginx([up])
        targets: dict[str, tuple[Proc | None, Proc]] = {
            "direct": (None, up),
            "router": (router, router),
        }
        if ngx:
            targets["nginx"] = (ngx, ngx)
        base = self.router([up], src=self.baseline_src) if self.baseline_src else None
        if base is not None:
            targets["baseline"] = (base, base)
        routed = ("router", "baseline")
        body = {"stream": True, "max_tokens": 64}
        rounds = 2 if self.quick else 4
        seconds = 3.0 if self.quick else 6.0
        out: dict[str, Any] = {}
        for conc in (32, 256):
            agg: dict[str, dict[str, Any]] = {
                k: {"ok": 0, "elapsed": 0.0, "ttfb": [], "cpu": 0.0, "lg": [], "errors": 0}
                for k in targets
            }
            for k, (hop, tgt) in targets.items():  # warm-up: connections, pools, caches
                self.measured(
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
                    m = self.measured(hop, tgt, b, conc, duration=seconds)
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
                self.samples[f"overhead_c{conc}_{k}"] = a["ttfb"]
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
            print(f"overhead c={conc}: " + json.dumps(_short(row)), flush=True)
        self.results["overhead"] = out
        for p in (router, ngx, base, up):
            if p:
                p.stop()

    def streaming(self) -> None:
        up = self.mock("stream", itl_ms=20, tokens=256)
        router = self.router([up])
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
            m = self.measured(
                hop,
                tgt,
                {**body, "model": model},
                streams,
                requests=streams * (1 if self.quick else 2),
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
            self.samples[f"streaming_{k}"] = m["ttfb"]
        res["added_ttfb_p50_ms"] = res["router"]["ttfb_p50_ms"] - res["direct"]["ttfb_p50_ms"]
        res["added_ttfb_p99_ms"] = res["router"]["ttfb_p99_ms"] - res["direct"]["ttfb_p99_ms"]
        self.samples["streaming_rss"] = rss
        self.results["streaming"] = res
        print("streaming: " + json.dumps(_short(res)), flush=True)
        router.stop()
        up.stop()

    def storm(self) -> None:
        tokens = 256
        up = self.mock("storm", itl_ms=20, tokens=tokens)
        router = self.router([up])
        users = 500
        duration = 20.0 if self.quick else 120.0
        rss_before = rss_mb(router.pid)
        fds_before = open_fds(router.pid)
        sampler = _Sampler(router.pid)
        m = self.measured(
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
        self.samples["storm_rss"] = rss_series
        self.results["storm"] = res
        print("storm: " + json.dumps(_short(res)), flush=True)
        router.stop()
        up.stop()

    def soak(self) -> None:
        duration = self.soak_seconds or (30.0 if self.quick else 240.0)
        up = self.mock("soak", itl_ms=5, tokens=64)
        router = self.router([up])
        fds0 = open_fds(router.pid)
        sampler = _Sampler(router.pid, every=1.0)

        async def mixed() -> list[Result]:
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
        self.samples["soak_rss"] = series
        self.results["soak"] = res
        print("soak: " + json.dumps(_short(res)), flush=True)
        router.stop()
        up.stop()

    def multi(self) -> None:
        # No token delay: throughput is then bound by CPU, not by how long a stream lasts.
        ups = [self.mock(f"mr{i}", tokens=64) for i in range(4)]
        redis = self.cluster.redis()
        body = b'{"model":"m","stream":true}'
        seconds = 5.0 if self.quick else 10.0

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
        one = self.cluster.router(cfg, workers=2, env=env)
        r1 = run([one.port])
        two = self.cluster.router(cfg, workers=2, env=env)
        r2 = run([one.port, two.port])
        counts = [httpx.get(u.url + "/stats").json()["requests"] for u in ups]
        shared = [
            all(
                b.get("inflight_shared", False) for b in httpx.get(p.url + "/admin/backends").json()
            )
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
        self.results["multi_replica"] = res
        print("multi: " + json.dumps(_short(res)), flush=True)
        for p in (one, two, redis, *ups):
            p.stop()

    def close(self) -> None:
        self.cluster.close()


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


def _short(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 3)
    if isinstance(obj, dict):
        return {k: _short(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_short(v) for v in obj][:8]
    return obj


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "nginx": subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
        if shutil.which("nginx")
        else "not installed",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def engine(bench: Bench) -> None:
    from bench.engine import PNG, plot, split_samples
    from bench.engine import run as engine_run

    res = engine_run(bench.cluster, bench.quick)
    made = plot(split_samples(res), ROOT / "docs" / PNG)
    bench.results["engine"] = {**res, "plot": PNG if made else None}


def admission(bench: Bench) -> None:
    from bench.admission import run as admission_run

    bench.results["admission"] = admission_run(bench.cluster, bench.quick)


def noisy(bench: Bench) -> None:
    from bench.noisy import run as noisy_run

    bench.results.update(noisy_run(bench.cluster, bench.quick))


def compare(bench: Bench) -> None:
    from bench.compare import run as compare_run

    bench.results["compare"] = compare_run(bench.cluster, bench.quick)


def prefix(bench: Bench) -> None:
    from bench.prefix_workload import PNG, plot, split_samples
    from bench.prefix_workload import run as prefix_run

    res = prefix_run(bench.cluster, bench.quick)
    made = plot(res, split_samples(res), ROOT / "docs" / PNG)
    bench.results["prefix"] = {**res, "plot": PNG if made else None}


def lora(bench: Bench) -> None:
    from bench.lora import run as lora_run

    bench.results["lora"] = lora_run(bench.cluster, bench.quick)


def console(bench: Bench) -> None:
    from bench.console import run as console_run

    bench.results["console"] = console_run(bench.cluster, bench.quick)


def real(bench: Bench) -> None:
    from bench.real_engine import run as real_run

    bench.results["real"] = real_run(bench.cluster, bench.quick)


def kv(bench: Bench) -> None:
    from bench.kv_workload import run as kv_run

    bench.results["kv"] = kv_run(bench.cluster, bench.quick)


def hop(bench: Bench) -> None:
    from bench.hop import check
    from bench.hop import run as hop_run

    res = hop_run(bench.cluster, bench.quick, bench.baseline_src)
    if bench.check:
        res["check"] = dict(zip(("ok", "message"), check(res), strict=True))
        print(res["check"]["message"], flush=True)
    bench.results["hop"] = res


def pd(bench: Bench) -> None:
    from bench.pd import run as pd_run

    bench.results["pd"] = pd_run(bench.cluster, bench.quick, bench.baseline_src)


def kv_real(bench: Bench) -> None:
    from bench.kv_real import run as kv_real_run

    bench.results["kv_real"] = kv_real_run(bench.cluster, bench.quick)


SCENARIOS: dict[str, Callable[[Bench], None]] = {
    "overhead": Bench.overhead,
    "compare": compare,
    "streaming": Bench.streaming,
    "storm": Bench.storm,
    "soak": Bench.soak,
    "multi": Bench.multi,
    "engine": engine,
    "admission": admission,
    "noisy": noisy,
    "prefix": prefix,
    "lora": lora,
    "kv": kv,
    "console": console,
    "hop": hop,
    "pd": pd,
    # Not in a full run: they need the real-engine venv (make engine-venv); `--only real`.
    "real": real,
    "kv_real": kv_real,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--soak-seconds", type=float, help="soak length (default 240; 30 with --quick)")
    ap.add_argument(
        "--baseline-src", help="overhead: also a router from this checkout (A/B in one run)"
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="hop: exit 1 when CPU/request vs nginx grew > 5 %% over bench/hop_baseline.json",
    )
    args = ap.parse_args()
    uvloop.install()
    bench = Bench(args.quick, args.soak_seconds, args.baseline_src)
    bench.check = args.check
    started = time.monotonic()
    try:
        for name in args.only or [n for n in SCENARIOS if n not in ("real", "kv_real")]:
            SCENARIOS[name](bench)
    finally:
        bench.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine(),
        "quick": args.quick,
        "seconds": time.monotonic() - started,
        "results": bench.results,
    }
    saved = report
    if args.only and (out / "latest.json").exists():
        # A partial run keeps the last full run's figures (and header) beside its own.
        try:
            last = json.loads((out / "latest.json").read_text())
            updated = {**last.get("updated", {}), **dict.fromkeys(args.only, machine()["date"])}
            results = {**last.get("results", {}), **bench.results}
            saved = {**last, "results": results, "updated": updated}
        except (OSError, ValueError):
            pass
    (out / "latest.json").write_text(json.dumps(_short(saved), indent=2))
    from bench.report import write_report

    write_report(report, bench.samples, ROOT / "docs", only=args.only, merged=saved["results"])
    print(f"done in {report['seconds']:.0f}s; results in {out / 'latest.json'}", flush=True)
    gate = bench.results.get("hop", {}).get("check")
    return 1 if gate is not None and not gate["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
