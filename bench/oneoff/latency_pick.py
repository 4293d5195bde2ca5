"""Cost of `balancer: latency` (`python -m bench.oneoff.latency_pick`, a few seconds).

Router CPU per pick for 16 candidates with live readings, every engine with its own model, the
request with approximate prefix hints (the issue's budget: at most 20 us), against `least_load`
and `cache_aware` on the same candidates; with an SLO; and the refit of 16 engines' full
reservoirs (off the request path, a runner chore every `latency.refit_interval`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from balancers.base import Candidate
from balancers.cache_aware import CacheAware
from balancers.context import Hints, LatencyInputs, PickContext
from balancers.latency import Latency
from balancers.latency_model import Features, Learner, Sample
from balancers.least_load import LeastLoad
from router.core.engine import EngineReading

N = 16
ROUNDS = 20_000


def _per_call_us(fn: Callable[[], object], rounds: int = ROUNDS) -> float:
    best = float("inf")
    for _ in range(5):
        t = time.process_time()
        for _ in range(rounds):
            fn()
        best = min(best, (time.process_time() - t) / rounds * 1e6)
    return best


def _learner(gen: random.Random) -> Learner:
    learner = Learner()
    for i in range(N):
        per_token = 20e-6 * (1 + i % 4)
        for _ in range(400):
            x: Features = (
                float(int(gen.paretovariate(1.2) * 200)),
                float(gen.randint(0, 4000)),
                float(gen.randint(0, 2000)),
                float(gen.randint(0, 3)),
                float(gen.randint(0, 16)),
                gen.random(),
            )
            y = 0.01 + per_token * (x[0] + x[1]) + 0.002 * x[4]
            learner.add(f"e{i}", Sample(x, y, 0.01 + 0.001 * x[4]))
    return learner


def main() -> None:
    gen = random.Random(1)
    learner = _learner(gen)
    t = time.process_time()
    models = learner.refit()
    refit_ms = (time.process_time() - t) * 1000
    cands = [
        Candidate(
            f"e{i}",
            1.0,
            gen.randint(0, 8),
            EngineReading(gen.randint(0, 3), gen.randint(0, 16), gen.random(), None, None, 1, 1),
        )
        for i in range(N)
    ]
    prefill = {f"e{i}": gen.randint(0, 4000) for i in range(N)}
    decode = {f"e{i}": gen.randint(0, 4000) for i in range(N)}
    hints = Hints(16, 256, {"e3": 8, "e7": 16})
    lat = LatencyInputs(models, prefill, decode, 2000)
    ctx = PickContext(hints=hints, latency=lat)
    slo = PickContext(hints=hints, latency=lat, slo_ttft_ms=200.0)
    latency, load, cache = Latency(random.Random(1)), LeastLoad(), CacheAware()
    rows = {
        "latency": _per_call_us(lambda: latency.pick(cands, ctx)),
        "latency, TTFT SLO": _per_call_us(lambda: latency.pick(cands, slo)),
        "least_load": _per_call_us(lambda: load.pick(cands, PickContext())),
        "cache_aware (approximate hints)": _per_call_us(lambda: cache.pick(cands, ctx)),
    }
    print(f"pick among {N} candidates, router CPU per pick (best of 5 x {ROUNDS}):")
    for name, us in rows.items():
        print(f"  {name:34s} {us:6.1f} us")
    print(f"refit of {N} engines x {len(learner.samples('e0'))} samples: {refit_ms:.1f} ms")


if __name__ == "__main__":
    main()
