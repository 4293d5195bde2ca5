"""The endpoint picker behind Envoy beside the other hops (`python -m bench.run --only picker`):
Envoy + `sluicegate epp` (the shipped example bootstrap; and its profile with the response body
left out of the picker), Envoy alone (a least_request cluster over the same engine, no
ext_proc), `sluicegate serve` as the proxy, and nginx.

64-token streams from the fast mock (no token delay, so the hops' own CPU is what limits them),
32 keep-alive users, the same pre-built request against each target in alternating rounds; with
a 1 kB and a 100 kB request body; then a burst of 200 streams started at once. Figures per
target: req/s, time to first chunk p50/p99, and CPU per request of each process (Envoy, picker)
and in total (user + system from /proc). Envoy runs one worker thread (`--concurrency 1`), as
nginx and the routers run one worker each. Loopback only, bounded in time; every process started
here is stopped by its PID.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bench.kit.loadgen import run_load
from bench.kit.nginx import start_nginx
from bench.kit.page import fmt, table
from bench.kit.procstat import cpu_seconds
from bench.kit.stats import alternating_rounds, pct
from tests.support.harness import Cluster, Proc, free_port
from tests.support.picker import Picker, envoy_config, http_filters, start_envoy, start_picker

CHAT = "/v1/chat/completions"
CONCURRENCY = 32
TOKENS = 64
TARGETS = ("envoy+picker", "envoy+picker (no response body)", "envoy", "sluicegate", "nginx")
HEADERS_ONLY = TARGETS[1]
BURST = 200  # streams started at once, each target once per round
# label -> (request body bytes, users, requests: 0 for a timed round)
VARIANTS = {
    "1k": (1_000, CONCURRENCY, 0),
    "100k": (100_000, CONCURRENCY, 0),
    "burst": (1_000, BURST, BURST),
}


def _envoy_alone(cluster: Cluster, engine: Proc) -> Proc:
    """The example bootstrap without its ext_proc filter, its engines' cluster a least_request
    STATIC cluster over `engine`."""
    listen, admin = free_port(), free_port()
    config = envoy_config(free_port(), listen, admin)
    filters = http_filters(config)
    filters[:] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc"]
    socket = {"address": "127.0.0.1", "port_value": engine.port}
    engines = {
        "name": "engines",
        "type": "STATIC",
        "connect_timeout": "2s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": {
            "cluster_name": "engines",
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": {"socket_address": socket}}}]}
            ],
        },
    }
    config["static_resources"]["clusters"] = [engines]
    return start_envoy(cluster, config, listen, admin)


def _envoy_with_picker(cluster: Cluster, picker: Picker, body: bool = True) -> Proc:
    """The example bootstrap in front of `picker`; `body` False: the response body left out
    of the picker (the filter's `response_body_mode: NONE`, `picker.response_body: none`)."""
    listen, admin = free_port(), free_port()
    config = envoy_config(picker.grpc_port, listen, admin)
    if not body:
        mode = http_filters(config)[0]["typed_config"]["processing_mode"]
        mode["response_body_mode"], mode["response_trailer_mode"] = "NONE", "SKIP"
    return start_envoy(cluster, config, listen, admin)


def run(cluster: Cluster, quick: bool) -> dict[str, Any]:
    engine = cluster.mock("picker-bench", tokens=TOKENS)
    backends = [{"name": "e0", "url": engine.url, "models": {"m": "m"}}]
    quiet = {"SLUICEGATE_LOG_LEVEL": "warning"}
    router = cluster.router({"backends": backends}, workers=1, env=quiet)
    picker = start_picker(cluster, {"backends": backends, "log_level": "warning"})
    fronted = _envoy_with_picker(cluster, picker)
    light = start_picker(
        cluster,
        {"backends": backends, "log_level": "warning", "picker": {"response_body": "none"}},
    )
    headers_only = _envoy_with_picker(cluster, light, body=False)
    alone = _envoy_alone(cluster, engine)
    nginx = start_nginx(cluster, [engine])
    # target -> (the port the load goes to, the processes whose CPU it costs, by role)
    targets: dict[str, tuple[int, dict[str, Proc]]] = {
        "envoy+picker": (fronted.port, {"envoy": fronted, "picker": picker}),
        HEADERS_ONLY: (headers_only.port, {"envoy": headers_only, "picker": light}),
        "envoy": (alone.port, {"envoy": alone}),
        "sluicegate": (router.port, {"proxy": router}),
    }
    missing = {}
    if nginx is None:
        missing["nginx"] = "not installed"
    else:
        targets["nginx"] = (nginx.port, {"nginx": nginx})
    rounds = 2 if quick else 3
    seconds = 2.0 if quick else 4.0
    out: dict[str, Any] = {
        "concurrency": CONCURRENCY,
        "tokens": TOKENS,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "missing": missing,
    }
    try:
        for label, (size, users, requests) in VARIANTS.items():
            out[label] = _variant(targets, size, rounds, seconds, users, requests)
            print(f"picker {label}: " + json.dumps(out[label], default=str), flush=True)
    finally:
        for p in (fronted, headers_only, alone, picker, light, router, nginx, engine):
            if p is not None:
                p.stop()
    return out


def _variant(
    targets: dict[str, tuple[int, dict[str, Proc]]],
    size: int,
    rounds: int,
    seconds: float,
    users: int,
    requests: int,
) -> dict[str, Any]:
    filler = "x" * max(0, size - 120)
    body = json.dumps(
        {
            "model": "m",
            "stream": True,
            "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": filler}],
        }
    ).encode()

    def load(k: str, duration: float) -> tuple[int, int, float, list[float], dict[str, float]]:
        port, procs = targets[k]
        before = {role: cpu_seconds(p.pid) for role, p in procs.items()}
        r = asyncio.run(
            run_load(
                "127.0.0.1",
                port,
                CHAT,
                body,
                users,
                duration=60.0 if requests else duration,  # a burst: until its streams end
                requests=requests,
            )
        )
        spent = {role: cpu_seconds(p.pid) - before[role] for role, p in procs.items()}
        return r.ok, r.errors, r.elapsed, r.ttfb, spent

    row: dict[str, Any] = {}
    for k, a in alternating_rounds(list(targets), load, rounds, seconds).items():
        per = {role: cpu / a.ok * 1000 if a.ok else None for role, cpu in a.cpu.items()}
        total = sum(v for v in per.values() if v is not None) if a.ok else None
        row[k] = {
            "rps": round(a.ok / a.elapsed, 1) if a.elapsed else 0.0,
            "requests": a.ok,
            "errors": a.errors,
            "ttfc_p50_ms": pct(a.ttfb, 0.5) * 1000 if a.ttfb else None,
            "ttfc_p99_ms": pct(a.ttfb, 0.99) * 1000 if a.ttfb else None,
            "cpu_ms_per_req": per,
            "cpu_ms_per_req_total": total,
        }
    return row


def _cpu(v: dict[str, Any]) -> str:
    parts = [f"{role} {fmt(ms)}" for role, ms in v["cpu_ms_per_req"].items()]
    return ", ".join(parts)


def ratios(row: dict[str, Any]) -> dict[str, float | None]:
    """The comparisons the issue asks for: the picker's own CPU per request against the proxy's,
    and Envoy + picker (and nginx + the picker's share) against the proxy and nginx."""

    def cpu(k: str, role: str | None = None) -> float | None:
        v = row.get(k)
        if v is None:
            return None
        got = v["cpu_ms_per_req_total"] if role is None else v["cpu_ms_per_req"].get(role)
        return float(got) if got else None

    def over(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a is not None and b else None

    picker, proxy, nginx = cpu("envoy+picker", "picker"), cpu("sluicegate"), cpu("nginx")
    return {
        "picker_vs_proxy_cpu": over(picker, proxy),
        "headers_only_picker_vs_proxy_cpu": over(cpu(HEADERS_ONLY, "picker"), proxy),
        "envoy_picker_vs_proxy_cpu": over(cpu("envoy+picker"), proxy),
        "envoy_picker_vs_envoy_cpu": over(cpu("envoy+picker"), cpu("envoy")),
        "nginx_plus_picker_vs_proxy_cpu": over(
            (nginx or 0) + (picker or 0) if nginx and picker else None, proxy
        ),
        "proxy_vs_nginx_cpu": over(proxy, nginx),
    }


def section(res: dict[str, Any], date: str) -> list[str]:
    """The `picker` section of docs/benchmarks.md."""
    lines = [
        "## The endpoint picker behind Envoy",
        "",
        f"`python -m bench.run --only picker`, {date}: {res['tokens']}-token streams from the "
        f"fast mock, {res['concurrency']} keep-alive users, {res['rounds']} alternating rounds of "
        f"{res['seconds_per_round']:g} s per target, 1 kB and 100 kB request bodies; 'burst': "
        f"{BURST} streams started at once (1 kB), once per target and round. Envoy "
        "(one worker thread) loads examples/endpoint-picker/envoy.yaml in front of `sluicegate "
        "epp`; 'envoy' is the same bootstrap without ext_proc, a least_request cluster. CPU is "
        "each process's user + system time per request.",
        "",
    ]
    for name, why in res.get("missing", {}).items():
        lines += [f"{name}: {why}.", ""]
    rows: list[tuple[str, ...]] = [
        ("body", "target", "req/s", "TTFC p50 ms", "TTFC p99 ms", "CPU ms/req", "total", "errors")
    ]
    for label in VARIANTS:
        row = res.get(label, {})
        for k in TARGETS:
            if k in row:
                v = row[k]
                rows.append(
                    (
                        label,
                        k,
                        fmt(v["rps"]),
                        fmt(v["ttfc_p50_ms"]),
                        fmt(v["ttfc_p99_ms"]),
                        _cpu(v),
                        fmt(v["cpu_ms_per_req_total"]),
                        fmt(v["errors"]),
                    )
                )
    lines += [table(rows), ""]
    head = (
        "body",
        "picker / proxy CPU",
        "picker (no response body) / proxy",
        "Envoy+picker / proxy",
        "Envoy+picker / Envoy",
        "nginx+picker / proxy",
        "proxy / nginx",
    )
    out: list[tuple[str, ...]] = [head]
    for label in VARIANTS:
        r = ratios(res.get(label, {}))
        out.append(
            (
                label,
                fmt(r["picker_vs_proxy_cpu"]),
                fmt(r["headers_only_picker_vs_proxy_cpu"]),
                fmt(r["envoy_picker_vs_proxy_cpu"]),
                fmt(r["envoy_picker_vs_envoy_cpu"]),
                fmt(r["nginx_plus_picker_vs_proxy_cpu"]),
                fmt(r["proxy_vs_nginx_cpu"]),
            )
        )
    lines += [
        table(out),
        "",
        "CPU ratios below 1 favour the left side. The picker sees every chunk of a streamed "
        "answer as one gRPC message each way (the response passes through it for TTFT and "
        "usage): its CPU per request grows with the tokens, as the proxy's does. With "
        "`picker.response_body: none` and the filter's `response_body_mode: NONE` "
        "(docs/endpoint-picker.md) it sees the request and the response's headers only. All "
        "processes share the machine's cores with the load generator: compare ratios within "
        "this run, not absolute numbers.",
        "",
    ]
    return lines
