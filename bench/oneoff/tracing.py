"""What tracing and the TTFT/TPOT counting cost: router CPU per streamed request, one run.

    python -m bench.oneoff.tracing                      # tracing off vs on (to a local OTLP
                                                        # receiver)
    python -m bench.oneoff.tracing --baseline-src DIR   # also a router run from another checkout
                                                        # (e.g. the commit before TTFT/TPOT
                                                        # counting)

The overhead scenario's load (64-token streams, no delay, concurrency 32) against each router in
alternating rounds, so machine noise spreads evenly; ratios are within this one run. The receiver
is the tests' OTLP/HTTP receiver (decodes every export), in this process on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from bench.kit.loadgen import run_load
from bench.kit.procstat import cpu_seconds
from tests.support.harness import Cluster, Proc
from tests.support.otlp_receiver import Receiver

CHAT = "/v1/chat/completions"
BODY = json.dumps({"model": "m", "stream": True, "max_tokens": 64}).encode()


def _router(c: Cluster, up: Proc, extra: dict[str, Any], src: str | None = None) -> Proc:
    backends = [{"name": "b", "url": up.url, "models": {"m": "mock-model"}}]
    # A baseline (`src`: another checkout's code) gets no tracing settings it may not know.
    return c.router(
        {"backends": backends, **({} if src else extra)},
        env={"SLUICEGATE_LOG_LEVEL": "warning", "OTEL_BSP_SCHEDULE_DELAY": "200"},
        src=src,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-src", action="append", default=[])
    ap.add_argument("--no-tracing", action="store_true", help="only tracing off vs baselines")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    opts = ap.parse_args()
    c = Cluster()
    receiver = Receiver().start()
    try:
        up = c.mock("fast", tokens=64)
        routers = {
            "tracing_off": _router(c, up, {}),
            "tracing_on": _router(c, up, {"tracing": {"otlp_endpoint": receiver.url}}),
            "tracing_on_10pct": _router(
                c, up, {"tracing": {"otlp_endpoint": receiver.url, "sample_ratio": 0.1}}
            ),
        }
        if opts.no_tracing:
            del routers["tracing_on"], routers["tracing_on_10pct"]
        for i, src in enumerate(opts.baseline_src):
            routers["baseline" if i == 0 else f"baseline{i + 1}"] = _router(c, up, {}, src)
        totals = {k: [0.0, 0] for k in routers}
        for r in routers.values():  # warm-up
            asyncio.run(run_load("127.0.0.1", r.port, CHAT, BODY, 32, duration=1.0))
        for rnd in range(opts.rounds):
            order = list(routers)
            order = order[rnd % len(order) :] + order[: rnd % len(order)]
            for name in order:
                r = routers[name]
                cpu0 = cpu_seconds(r.pid)
                res = asyncio.run(
                    run_load("127.0.0.1", r.port, CHAT, BODY, 32, duration=opts.seconds)
                )
                totals[name][0] += cpu_seconds(r.pid) - cpu0
                totals[name][1] += res.ok
        out = {k: round(cpu / n * 1000, 4) for k, (cpu, n) in totals.items() if n}
        off = out["tracing_off"]
        report: dict[str, Any] = {"cpu_ms_per_request": out, "spans_received": len(receiver.spans)}
        if "tracing_on" in out:
            report["tracing_on_vs_off"] = round(out["tracing_on"] / off, 3)
            report["tracing_10pct_vs_off"] = round(out["tracing_on_10pct"] / off, 3)
        for name in out:
            if name.startswith("baseline"):
                report[f"tracing_off_vs_{name}"] = round(off / out[name], 3)
        print(json.dumps(report, indent=2))
    finally:
        receiver.close()
        c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
