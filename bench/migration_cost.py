"""What migration costs when nothing fails: router CPU per streamed request, on against off.

    python -m bench.migration_cost      # about a minute

Two routers from this checkout in front of one mock (64-token streams, no delay): the default
(migration on for the mock's `kind: vllm`) and one with `migration: {enabled: false}`. Loads
alternate between them in ROUNDS rounds at concurrency 32 so the shared machine's noise falls on
both; the figure is the ratio of their CPU per request (their process trees, from /proc), one
run. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

from bench.run import Bench

ROUNDS = 6
SECONDS = 4.0
CONCURRENCY = 32


def main() -> int:
    bench = Bench(quick=True)
    try:
        up = bench.mock("fast", tokens=64)
        targets = {
            "on": bench.router([up]),
            "off": bench.router([up], migration={"enabled": False}),
        }
        body = {"model": "m", "stream": True, "max_tokens": 64}
        cpu = dict.fromkeys(targets, 0.0)
        ok = dict.fromkeys(targets, 0)
        for router in targets.values():  # warm-up
            bench.measured(router, router, body, CONCURRENCY, duration=1.0)
        for rnd in range(ROUNDS):
            order = list(targets) if rnd % 2 == 0 else list(reversed(targets))
            for name in order:
                m = bench.measured(
                    targets[name], targets[name], body, CONCURRENCY, duration=SECONDS
                )
                cpu[name] += m["hop_cpu_s"]
                ok[name] += m["ok"]
        per = {k: cpu[k] / ok[k] * 1000 for k in targets}
        print(
            json.dumps(
                {
                    "cpu_ms_per_req": per,
                    "requests": ok,
                    "on_vs_off_cpu": per["on"] / per["off"],
                    "rounds": ROUNDS,
                    "seconds": SECONDS,
                    "concurrency": CONCURRENCY,
                }
            ),
            flush=True,
        )
    finally:
        bench.cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
