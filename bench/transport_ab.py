"""A/B of the upstream transports on the overhead scenario (64-token streams, fast mock, c=32).

    python -m bench.transport_ab --rounds 4 --seconds 4
"""

from __future__ import annotations

import argparse
import json

import uvloop

from bench.run import Bench


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    uvloop.install()
    bench = Bench(quick=True)
    try:
        up = bench.mock("fast", tokens=64)
        cfg = {"backends": [{"name": "b0", "url": up.url, "models": {"m": "mock-model"}}]}
        routers = {
            name: bench.cluster.router(
                cfg,
                env={"SLUICEGATE_LOG_LEVEL": "warning", "SLUICEGATE_AB_TRANSPORT": name},
            )
            for name in ("lean", "aiohttp")
        }
        body = {"stream": True, "max_tokens": 64, "model": "m"}
        agg = {k: {"ok": 0, "cpu": 0.0, "elapsed": 0.0, "errors": 0} for k in routers}
        for r in routers.values():
            bench.measured(r, r, body, args.concurrency, duration=1.0)
        for rnd in range(args.rounds):
            order = list(routers) if rnd % 2 == 0 else list(reversed(routers))
            for k in order:
                r = routers[k]
                m = bench.measured(r, r, body, args.concurrency, duration=args.seconds)
                a = agg[k]
                a["ok"] += m["ok"]
                a["errors"] += m["errors"]
                a["cpu"] += m["hop_cpu_s"]
                a["elapsed"] += m["elapsed"]
                print(k, rnd, round(m["hop_cpu_s"] / max(1, m["ok"]) * 1000, 3), flush=True)
        out = {
            k: {
                "cpu_ms_per_req": round(a["cpu"] / a["ok"] * 1000, 3),
                "rps": round(a["ok"] / a["elapsed"], 1),
                "errors": a["errors"],
            }
            for k, a in agg.items()
        }
        out["lean_vs_aiohttp_cpu"] = round(
            out["lean"]["cpu_ms_per_req"] / out["aiohttp"]["cpu_ms_per_req"], 3
        )
        print(json.dumps(out), flush=True)
    finally:
        bench.close()


if __name__ == "__main__":
    main()
