"""Router CPU and latency against hostile engine input and a hostile usage event, one run.

    python -m bench.oneoff.hostile_engine                      # ~30 s
    python -m bench.oneoff.hostile_engine --baseline-src DIR   # also a router from another
                                                               # checkout

`metrics_page`: one backend's `/metrics` answers a 4 MB page of valid series of a wanted family
(issue 22, defect 9); the router scrapes it every 0.25 s (`least_load`). Measured: the router's
CPU share while idle except for unrelated requests sent one at a time, and their p50/p99.
`endless_usage`: a stream's usage-only event that never ends, 16 MB in 4 KB pieces, through the
usage strip (defect 8), timed in this process (the strip is pure).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import httpx

from bench.kit.procstat import cpu_seconds
from router.request.usage.strip import UsageStrip
from tests.support.harness import Cluster, Proc, control

PAGE_BYTES = 4 * 1024 * 1024 - 4096  # just under the scraper's 4 MiB cap on a page


def hostile_page() -> str:
    lines = []
    size = i = 0
    while size < PAGE_BYTES:
        line = f'vllm:num_requests_running{{model_name="m",engine="{i}"}} 1\n'
        lines.append(line)
        size += len(line)
        i += 1
    return "".join(lines)


def _router(c: Cluster, quiet: Proc, hostile: Proc, src: str | None) -> Proc:
    return c.router(
        {
            "backends": [
                {"name": "quiet", "url": quiet.url, "models": {"m": "mock-model"}},
                # Serves another model: its page is scraped, it never takes `m`'s requests.
                {"name": "hostile", "url": hostile.url, "models": {"h": "mock-model"}},
            ],
            "balancer": "least_load",
            "engine_metrics": {"interval": 0.25, "timeout": 1.0},
            "health": {"interval": 60},
        },
        env={"SLUICEGATE_LOG_LEVEL": "warning"},
        src=src,
    )


def _measure(router: Proc, seconds: float) -> dict[str, Any]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    latencies: list[float] = []
    cpu0 = cpu_seconds(router.pid)
    start = time.monotonic()
    with httpx.Client(timeout=30) as client:
        while time.monotonic() - start < seconds:
            t = time.perf_counter()
            r = client.post(router.url + "/v1/chat/completions", json=body)
            latencies.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
            time.sleep(0.01)
    elapsed = time.monotonic() - start
    cpu = cpu_seconds(router.pid) - cpu0
    latencies.sort()
    return {
        "router_cpu_share": round(cpu / elapsed, 3),
        "requests": len(latencies),
        "p50_ms": round(latencies[len(latencies) // 2] * 1000, 2),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2),
    }


def endless_usage(total: int = 16 * 1024 * 1024, piece: int = 4096) -> dict[str, Any]:
    event = b'data: {"choices":[],"usage":{"x":"' + b"y" * total
    strip = UsageStrip(strip_nulls=False)
    most_held = 0
    t = time.process_time()
    for i in range(0, len(event), piece):
        strip.feed(event[i : i + piece])
        most_held = max(most_held, strip.held)
    return {
        "cpu_s": round(time.process_time() - t, 3),
        "mb": total // (1024 * 1024),
        "most_held_bytes": most_held,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--baseline-src", default=None, help="another checkout's directory")
    opts = ap.parse_args()
    c = Cluster()
    report: dict[str, Any] = {}
    try:
        quiet = c.mock("quiet", tokens=4)
        hostile = c.mock("hostile")
        control(hostile, metrics_body=hostile_page())
        sources: dict[str, str | None] = {"router": None}
        if opts.baseline_src:
            sources["baseline"] = opts.baseline_src
        page: dict[str, Any] = {}
        for name, src in sources.items():  # one at a time: each alone on the machine
            r = _router(c, quiet, hostile, src)
            time.sleep(1.0)  # a few scrapes in
            page[name] = _measure(r, opts.seconds)
            r.stop()
        report["metrics_page"] = page
        report["endless_usage"] = endless_usage()
    finally:
        c.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
