"""What usage accounting costs: router CPU per streamed request, `active` vs `passive`, one run.

    python -m bench.oneoff.usage [--rounds 3] [--seconds 4]
    python -m bench.oneoff.usage --baseline-src DIR      # also a router from another checkout (e.g.
                                                  # the commit before usage accounting)

`active` (the default) adds `stream_options.include_usage` to each streamed request whose client
did not ask for usage and takes the usage event out of the relayed bytes; `passive` forwards the
body untouched and counts content events. `client_asks` is a client that sets include_usage
itself (no injection, no strip: the usage is read from the stream's tail as it passes). The
overhead scenario's load (64-token streams from the fast mock, no delay, concurrency 32) runs
against each router in alternating rounds; ratios are within this one run. Also: the strip's own
cost per chunk, timed in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from bench.kit.loadgen import run_load
from bench.kit.procstat import cpu_seconds
from router.request.usage.strip import USAGE_OBJECT, UsageStrip
from tests.support.harness import Cluster, Proc

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "stream": True, "max_tokens": 64}).encode()
ASKS = json.dumps(
    {"model": "m", "stream": True, "max_tokens": 64, "stream_options": {"include_usage": True}}
).encode()


def _router(c: Cluster, up: Proc, mode: str | None, src: str | None = None) -> Proc:
    """`mode` None: no `usage_accounting` key (a baseline from `src` may predate it)."""
    config: dict[str, Any] = {
        "backends": [{"name": "b", "url": up.url, "models": {"m": "mock-model"}}]
    }
    if mode is not None:
        config["usage_accounting"] = mode
    return c.router(config, env={"SLUICEGATE_LOG_LEVEL": "warning"}, src=src)


def strip_cost(chunks: int = 200_000) -> dict[str, float]:
    """Nanoseconds the strip adds per chunk of a vLLM-sized content event (an empty loop's time
    taken off)."""
    chunk = (
        b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,'
        b'"model":"mock-model","choices":[{"index":0,"delta":{"content":"tok1 "}}]}\n\n'
    )
    t0 = time.perf_counter()
    for _ in range(chunks):
        pass
    empty = time.perf_counter() - t0
    out = {}
    for name, nulls in (("vllm_shape", False), ("openai_shape", True)):
        strip = UsageStrip(nulls)
        tail = chunk[-2:]  # the relay takes it anyway
        t0 = time.perf_counter()
        for _ in range(chunks):  # as the relay does it: feed only what its inline test sends
            if strip.slow or tail != b"\n\n" or chunk.rfind(USAGE_OBJECT) >= 0:
                strip.feed(chunk)
        spent = time.perf_counter() - t0 - empty
        out[f"{name}_ns_per_chunk"] = round(spent / chunks * 1e9, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--baseline-src", default=None, help="another checkout's directory")
    opts = ap.parse_args()
    c = Cluster()
    try:
        up = c.mock("fast", tokens=64)
        routers = {
            "passive": (_router(c, up, "passive"), BODY),
            "active": (_router(c, up, "active"), BODY),
            "client_asks": (_router(c, up, "active"), ASKS),
        }
        if opts.baseline_src:
            routers["baseline"] = (_router(c, up, None, opts.baseline_src), BODY)
        totals = {k: [0.0, 0] for k in routers}
        for r, body in routers.values():  # warm-up
            asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, 32, duration=1.0))
        for rnd in range(opts.rounds):
            order = list(routers)
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            for name in order:
                r, body = routers[name]
                cpu0 = cpu_seconds(r.pid)
                res = asyncio.run(
                    run_load("127.0.0.1", r.port, CHAT, body, 32, duration=opts.seconds)
                )
                totals[name][0] += cpu_seconds(r.pid) - cpu0
                totals[name][1] += res.ok
        out = {k: round(cpu / n * 1000, 4) for k, (cpu, n) in totals.items() if n}
        report: dict[str, Any] = {
            "cpu_ms_per_request": out,
            "requests": {k: n for k, (_, n) in totals.items()},
            "active_vs_passive": round(out["active"] / out["passive"], 3),
            "client_asks_vs_passive": round(out["client_asks"] / out["passive"], 3),
            **strip_cost(),
        }
        if "baseline" in out:
            report["passive_vs_baseline"] = round(out["passive"] / out["baseline"], 3)
            report["active_vs_baseline"] = round(out["active"] / out["baseline"], 3)
        print(json.dumps(report, indent=2))
    finally:
        c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
