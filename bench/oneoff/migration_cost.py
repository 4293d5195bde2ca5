"""What migration costs when nothing fails: router CPU per streamed request, on against off.

    python -m bench.oneoff.migration_cost      # about two minutes

Routers from this checkout in front of one mock (64-token streams, no delay), PER_SETTING of
each setting: the default (migration on for the mock's `kind: vllm`) and `migration: {enabled:
false}`. Loads alternate between them in ROUNDS rounds at concurrency 32 so the shared machine's
noise falls on all; the figure is the ratio of the settings' CPU per request (their process trees,
from /proc), one run. Several processes per setting, since one process's CPU per request differs
from another's of the same code by about 1 %. Prints one JSON line.
"""

from __future__ import annotations

import sys
from typing import Any

from bench.kit.cluster import Bench

ROUNDS = 6
SECONDS = 3.0
PER_SETTING = 3
CONCURRENCY = 32


def main() -> int:
    bench = Bench(quick=True)
    try:
        up = bench.mock("fast", tokens=64)
        settings: dict[str, dict[str, Any]] = {
            "on": {},
            "off": {"migration": {"enabled": False}},
        }
        targets = {
            (name, i): bench.router([up], **extra)
            for i in range(PER_SETTING)
            for name, extra in settings.items()
        }
        msgs = [{"role": "user", "content": "hi"}]  # a call that may migrate has messages
        body = {"model": "m", "stream": True, "max_tokens": 64, "messages": msgs}
        bench.compare_cpu(
            targets,
            body,
            {"on_vs_off_cpu": ("on", "off")},
            concurrency=CONCURRENCY,
            rounds=ROUNDS,
            seconds=SECONDS,
        )
    finally:
        bench.cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
