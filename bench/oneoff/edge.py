"""What the edge hardening costs, as ratios from one run (about a minute):

    python -m bench.oneoff.edge

1. A log call on the request path: the bounded queue (`router.ops.logs`, formatting and the write
   in a writer thread) against formatting and writing inline, as before. Both write JSON lines to
   a file; reported per record: time on the calling thread, and the process's CPU (both threads).
2. The header-timeout timer the client protocol arms and cancels once per request head.
3. End to end: whole-router CPU per streamed request (64 tokens, c=32) with the per-request log
   line on (log level info) against off (warning), in alternating rounds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any

import uvloop

from bench.kit.loadgen import run_load
from bench.kit.procstat import cpu_seconds
from router.ops import logs
from tests.support.harness import Cluster

N_RECORDS = 8_000  # under the queue size: none dropped


def _log_calls(handler: logging.Handler) -> tuple[float, float]:
    log = logging.getLogger("sluicegate.bench")
    root = logging.getLogger()
    root.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    fields = {"request_id": "x" * 32, "model": "m", "backend": "b0", "status": 200, "bytes": 9000}
    cpu0, t0 = time.process_time(), time.perf_counter()
    for _ in range(N_RECORDS):
        log.info("request", extra={"fields": fields})
    caller = (time.perf_counter() - t0) / N_RECORDS
    logs.stop()  # the queue's records are written before CPU is read
    cpu = (time.process_time() - cpu0) / N_RECORDS
    return caller * 1e6, cpu * 1e6


def log_cost() -> dict[str, float]:
    with tempfile.TemporaryFile("w") as sink:
        saved = sys.stderr
        sys.stderr = sink
        try:
            inline = logging.StreamHandler(sink)
            inline.setFormatter(logs.JsonFormatter(["a-secret-value-123"]))
            inline_caller, inline_cpu = _log_calls(inline)
            logs.configure("info", ["a-secret-value-123"])
            queued = logging.getLogger().handlers[0]
            queued_caller, queued_cpu = _log_calls(queued)
        finally:
            sys.stderr = saved
            logging.getLogger().handlers[:] = []
    return {
        "inline_caller_us": inline_caller,
        "inline_cpu_us": inline_cpu,
        "queued_caller_us": queued_caller,
        "queued_cpu_us": queued_cpu,
        "queued_vs_inline_caller": queued_caller / inline_caller,
        "queued_vs_inline_cpu": queued_cpu / inline_cpu,
    }


def timer_cost() -> float:
    async def run() -> float:
        loop = asyncio.get_running_loop()
        n = 200_000
        t0 = time.perf_counter()
        for _ in range(n):
            loop.call_later(10.0, int).cancel()
        return (time.perf_counter() - t0) / n * 1e6

    return uvloop.run(run())


def end_to_end(rounds: int = 3, seconds: float = 4.0) -> dict[str, Any]:
    cluster = Cluster()
    try:
        up = cluster.mock("fast", tokens=64)
        cfg = {"backends": [{"name": "b0", "url": up.url, "models": {"m": "mock-model"}}]}
        routers = {
            level: cluster.router(cfg, env={"SLUICEGATE_LOG_LEVEL": level})
            for level in ("info", "warning")
        }
        body = json.dumps({"model": "m", "stream": True, "max_tokens": 64}).encode()
        totals = {k: [0.0, 0] for k in routers}
        for rnd in range(rounds + 1):  # the first round warms up
            order = list(routers) if rnd % 2 == 0 else list(reversed(routers))
            for level in order:
                r = routers[level]
                c0 = cpu_seconds(r.pid)
                res = asyncio.run(
                    run_load(
                        "127.0.0.1",
                        r.port,
                        "/v1/chat/completions",
                        body,
                        32,
                        duration=seconds if rnd else 1.0,
                    )
                )
                if rnd:
                    totals[level][0] += cpu_seconds(r.pid) - c0
                    totals[level][1] += res.ok
        per = {k: v[0] / v[1] * 1000 for k, v in totals.items() if v[1]}
        return {
            "cpu_ms_per_req_log_on": per["info"],
            "cpu_ms_per_req_log_off": per["warning"],
            "log_on_vs_off": per["info"] / per["warning"],
        }
    finally:
        cluster.close()


def main() -> int:
    out = {
        "log_call": log_cost(),
        "header_timer_us": timer_cost(),
        "end_to_end": end_to_end(),
        "pid": os.getpid(),
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
