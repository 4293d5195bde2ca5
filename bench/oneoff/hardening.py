"""What issue 22's quota and body hardening costs: router CPU per streamed request, one run.

    python -m bench.oneoff.hardening --baseline-src DIR   # this checkout beside another (e.g. main)

The overhead scenario's load (64-token streams, no delay, concurrency 32) against each router in
alternating rounds, so machine noise spreads evenly; ratios are within this one run. Two setups
each: `plain` (the defaults: the estimate's checks and the body timer are on every request) and
`quota` (a client key with rpm and tpm shared through Redis, and admission: the local mirror of
shared admissions, the integer estimate, the queue's byte count).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from typing import Any

from bench.kit.loadgen import run_load
from bench.kit.procstat import cpu_seconds
from tests.support.harness import Cluster, Proc

CHAT = "/v1/chat/completions"
BODY = json.dumps(
    {
        "model": "m",
        "stream": True,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
).encode()
KEY = "sk-bench-hardening-0123456789"


def _router(c: Cluster, up: Proc, setup: str, redis_url: str, src: str | None) -> Proc:
    cfg: dict[str, Any] = {
        "backends": [{"name": "b", "url": up.url, "models": {"m": "mock-model"}}]
    }
    if setup == "quota":
        digest = hashlib.sha256(KEY.encode()).hexdigest()
        limits = {"rpm": 10_000_000, "tpm": 10_000_000_000}
        cfg |= {
            "api_keys": [{"sha256": digest, "name": "bench", **limits}],
            "redis_url": redis_url,
            "redis_prefix": "bench" + str(abs(hash((setup, src))) % 10**6),
            "admission": {"max_wait": 30},
        }
    return c.router(cfg, env={"SLUICEGATE_LOG_LEVEL": "warning"}, src=src)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-src", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    opts = ap.parse_args()
    c = Cluster()
    try:
        up = c.mock("fast", tokens=64)
        rds = c.redis()
        routers = {
            f"{who}_{setup}": _router(c, up, setup, rds.url, src)
            for who, src in (("this", None), ("baseline", opts.baseline_src))
            for setup in ("plain", "quota")
        }
        headers = {k: (f"authorization: Bearer {KEY}\r\n" if "quota" in k else "") for k in routers}
        totals = {k: [0.0, 0] for k in routers}
        for k, r in routers.items():  # warm-up
            asyncio.run(
                run_load(
                    "127.0.0.1", r.port, CHAT, BODY, 32, duration=1.0, extra_headers=headers[k]
                )
            )
        for rnd in range(opts.rounds):
            order = list(routers)
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            for name in order:
                r = routers[name]
                cpu0 = cpu_seconds(r.pid)
                res = asyncio.run(
                    run_load(
                        "127.0.0.1",
                        r.port,
                        CHAT,
                        BODY,
                        32,
                        duration=opts.seconds,
                        extra_headers=headers[name],
                    )
                )
                totals[name][0] += cpu_seconds(r.pid) - cpu0
                totals[name][1] += res.ok
        out = {k: round(cpu / n * 1000, 4) for k, (cpu, n) in totals.items() if n}
        report: dict[str, Any] = {
            "cpu_ms_per_request": out,
            "requests": {k: n for k, (_, n) in totals.items()},
        }
        for setup in ("plain", "quota"):
            report[f"{setup}_this_vs_baseline"] = round(
                out[f"this_{setup}"] / out[f"baseline_{setup}"], 3
            )
        print(json.dumps(report, indent=2))
    finally:
        c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
