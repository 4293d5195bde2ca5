"""Scale from zero under a flood: another model's time to first byte while a declared model with
no backend is flooded past `max_held`, one run.

    python -m bench.oneoff.scale_from_zero [--seconds 5] [--flood 400] [--max-held 200]

One router: model `m` served by a fast mock, model `cold` declared (`scale_from_zero`) and never
served. First `m` alone (8 streams at a time), then `m` again while `--flood` users send requests
for `cold` without pause: `max_held` of them are held (each until the load generator's request
timeout cuts it: a client leaving), the rest refused at once with 503 and come straight back. The
TTFB of `m` in the two phases, and what the flood got, are printed as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from bench.kit.loadgen import Result, run_load
from tests.support.harness import Cluster

CHAT = "/v1/chat/completions"


def _body(model: str) -> bytes:
    return json.dumps({"model": model, "stream": True, "max_tokens": 16}).encode()


def _ms(res: Result) -> dict[str, Any]:
    t = sorted(res.ttfb)
    if not t:
        return {"ok": res.ok, "errors": res.errors}
    p99 = t[min(len(t) - 1, int(len(t) * 0.99))]
    return {
        "ok": res.ok,
        "ttfb_p50_ms": round(statistics.median(t) * 1000, 2),
        "ttfb_p99_ms": round(p99 * 1000, 2),
    }


async def _flooded(port: int, seconds: float, flood: int) -> tuple[Result, Result]:
    flooding = run_load(
        "127.0.0.1", port, CHAT, _body("cold"), flood, duration=seconds, request_timeout=2.0
    )
    probe = run_load("127.0.0.1", port, CHAT, _body("m"), 8, duration=seconds)
    cold, warm = await asyncio.gather(flooding, probe)
    return cold, warm


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--flood", type=int, default=400)
    ap.add_argument("--max-held", type=int, default=200)
    opts = ap.parse_args()
    c = Cluster()
    try:
        up = c.mock("fast", tokens=16)
        router = c.router(
            {
                "backends": [{"name": "b", "url": up.url, "models": {"m": "mock-model"}}],
                "scale_from_zero": {"models": ["cold"], "max_held": opts.max_held},
            },
            env={"SLUICEGATE_LOG_LEVEL": "warning"},
        )
        asyncio.run(run_load("127.0.0.1", router.port, CHAT, _body("m"), 8, duration=1.0))
        alone = asyncio.run(
            run_load("127.0.0.1", router.port, CHAT, _body("m"), 8, duration=opts.seconds)
        )
        cold, warm = asyncio.run(_flooded(router.port, opts.seconds, opts.flood))
        report = {
            "m_alone": _ms(alone),
            "m_during_flood": _ms(warm),
            "flood": {"answered": cold.ok, "errors": cold.errors, "aborted": cold.aborted},
        }
        print(json.dumps(report, indent=2))
    finally:
        c.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
