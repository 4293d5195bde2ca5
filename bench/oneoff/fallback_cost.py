"""What model fallbacks cost when none is taken: router CPU per streamed request, against the
plain router (a checkout without the feature).

    python -m bench.oneoff.fallback_cost <baseline checkout>   # about two minutes

Three settings, PER_SIDE routers each, in front of one mock (64-token streams, no delay) that
serves two models (`m`, and `m2` as the target): `plain`, the baseline checkout's code (run with
it on PYTHONPATH) on the defaults; `empty`, this checkout with no chains (a request's cost is one
dict miss and one member test of its body); `configured`, this checkout with all three chains
for `m` (`fallbacks`, `context_window_fallbacks`, `content_policy_fallbacks` -> `m2`), none taken:
the context check before the call runs on every request. Loads alternate between the routers in
ROUNDS rounds at concurrency 32 so the shared machine's noise falls on all; the figures are the
ratios of CPU per request (process trees, from /proc) within one run. Prints one JSON line.
"""

from __future__ import annotations

import sys
from typing import Any

from bench.kit.cluster import Bench

ROUNDS = 4
SECONDS = 3.0
PER_SIDE = 2
CONCURRENCY = 32


def main(baseline: str) -> int:
    bench = Bench(quick=True)
    try:
        up = bench.mock("fast", tokens=64)
        backends = [
            {"name": "b0", "url": up.url, "models": {"m": "mock-model"}},
            {"name": "b1", "url": up.url, "models": {"m2": "mock-model"}},
        ]
        chains = {"m": ["m2"]}
        sides: dict[str, tuple[str | None, dict[str, Any]]] = {
            "plain": (baseline, {}),
            "empty": (None, {}),
            "configured": (
                None,
                {
                    "fallbacks": chains,
                    "context_window_fallbacks": chains,
                    "content_policy_fallbacks": chains,
                },
            ),
        }
        targets = {
            (side, i): bench.router([up], src=src, backends=backends, **extra)
            for i in range(PER_SIDE)
            for side, (src, extra) in sides.items()
        }
        msgs = [{"role": "user", "content": "hi"}]
        body = {"model": "m", "stream": True, "max_tokens": 64, "messages": msgs}
        ratios = {
            "empty_vs_plain_cpu": ("empty", "plain"),
            "configured_vs_plain_cpu": ("configured", "plain"),
        }
        bench.compare_cpu(
            targets, body, ratios, concurrency=CONCURRENCY, rounds=ROUNDS, seconds=SECONDS
        )
    finally:
        bench.cluster.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
