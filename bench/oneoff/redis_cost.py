"""Router CPU per request with Redis shared state on: this checkout against another (an A/B).

    python -m bench.oneoff.redis_cost <baseline checkout>   # about three minutes
    python -m bench.oneoff.redis_cost <baseline checkout> --plain  # the same on the defaults:
                                                                   # no Redis
    python -m bench.oneoff.redis_cost <baseline checkout> --long   # the defaults, CPU per chunk:
                                                                   # long streams (128 tokens at
                                                                   # 10 ms/token, 100 users),
                                                                   # each token one read

Routers with `redis_url` set (in-flight counts shared, quotas shared for the client key every
request carries: rpm, tpm and max_parallel, so each request runs an admit and its release, an
acquire and its release), PER_SIDE from this checkout and PER_SIDE from the baseline's (run with
it on PYTHONPATH), all on one redis-server, in front of one mock (64-token streams). Loads
alternate between the routers in ROUNDS rounds at concurrency 32, so the machine's noise falls on
both sides; the figure is the ratio of their CPU per request (process trees, from /proc) within
one run. Prints one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from bench.kit.cluster import Bench

ROUNDS = 6
SECONDS = 3.0
PER_SIDE = 2
CONCURRENCY = 32
KEY = "sk-bench-redis-cost"


LONG, LONG_ITL_MS, LONG_USERS = 128, 10.0, 100


def main(baseline: str, plain: bool = False, long: bool = False) -> int:
    plain = plain or long
    bench = Bench(quick=True)
    try:
        tokens = LONG if long else 64
        up = bench.mock("fast", tokens=tokens, itl_ms=LONG_ITL_MS if long else 0.0)
        redis = None if plain else bench.cluster.redis()
        cfg: dict[str, Any] = {
            "backends": [{"name": "b0", "url": up.url, "models": {"m": "mock-model"}}],
            "api_keys": [
                {
                    "sha256": hashlib.sha256(KEY.encode()).hexdigest(),
                    "name": "bench",
                    "rpm": 10_000_000,
                    "tpm": 10_000_000_000,
                    "max_parallel": 1_000_000,
                }
            ],
        }
        env = {
            "SLUICEGATE_LOG_LEVEL": "warning",
            "PYTHONHASHSEED": "0",  # see Bench.router: one dict layout for every router
        }
        if redis is not None:
            env["SLUICEGATE_REDIS_URL"] = redis.url
            env["SLUICEGATE_REDIS_TIMEOUT"] = "0.5"  # a busy 2-core machine: no fallbacks
        else:
            del cfg["api_keys"]  # the defaults a user gets: no keys, no Redis
        sides = {"this": None, "baseline": baseline}
        targets = {
            (side, i): bench.cluster.router(cfg, workers=1, env=env, src=src)
            for i in range(PER_SIDE)
            for side, src in sides.items()
        }
        body = {"model": "m", "stream": True, "max_tokens": tokens}
        users = LONG_USERS if long else CONCURRENCY
        auth = "" if plain else f"authorization: Bearer {KEY}\r\n"
        cpu = dict.fromkeys(sides, 0.0)
        ok = dict.fromkeys(sides, 0)
        errors = dict.fromkeys(sides, 0)
        for router in targets.values():  # warm-up
            bench.measured(router, router, body, users, duration=1.0, extra_headers=auth)
        keys = list(targets)
        for rnd in range(ROUNDS):
            for side, i in keys[rnd % len(keys) :] + keys[: rnd % len(keys)]:
                router = targets[(side, i)]
                m = bench.measured(
                    router, router, body, users, duration=SECONDS, extra_headers=auth
                )
                cpu[side] += m["hop_cpu_s"]
                ok[side] += m["ok"]
                errors[side] += m["errors"]
        per = {k: cpu[k] / ok[k] * 1000 for k in sides}
        if long:  # per streamed event: the role event, each token, the finish event, [DONE]
            per = {k: v * 1000 / (tokens + 3) for k, v in per.items()}
        print(
            json.dumps(
                {
                    ("cpu_us_per_chunk" if long else "cpu_ms_per_req"): per,
                    "requests": ok,
                    "errors": errors,
                    "this_vs_baseline_cpu": per["this"] / per["baseline"],
                    "rounds": ROUNDS,
                    "redis": not plain,
                    "long": long,
                }
            )
        )
    finally:
        bench.close()
    return 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--plain", "--long")]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(args[0], plain="--plain" in sys.argv[1:], long="--long" in sys.argv[1:]))
