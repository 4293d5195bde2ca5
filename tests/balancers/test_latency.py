"""`balancer: latency` as a pure policy, and its model: a per-engine line converges on synthetic
engines, predictions stay bounded, the reservoir keeps its bound, the fallback order is engine
model -> pooled model -> least_load, SLOs pack, a sheddable request no engine meets is marked,
an echoed session's engine is kept within the break allowance."""

from __future__ import annotations

import random

import pytest

from balancers.base import Candidate
from balancers.context import Hints, LatencyInputs, PickContext
from balancers.latency import EXPLORE, UNATTAINABLE, Latency
from balancers.latency_model import (
    CEILING,
    NO_MODELS,
    PER_STRATUM,
    STRATA,
    Features,
    Learner,
    Models,
    Sample,
    fit,
)
from balancers.least_load import LeastLoad
from router.core.engine import EngineReading
from router.request.placement.latency_feed import RecentMin


def reading(running: float = 0, waiting: float = 0, kv: float = 0.0, **kw: object) -> EngineReading:
    return EngineReading(waiting, running, kv, None, None, 1.0, 1, **kw)  # type: ignore[arg-type]


def engine_ttft(x: Features, per_token: float, base: float) -> float:
    """A synthetic engine: queued plus own prefill at `per_token`, a step share per running."""
    return base + per_token * (x[0] + x[1]) + 0.002 * x[4]


def samples(
    gen: random.Random, n: int, per_token: float, base: float, noise: float = 0.0
) -> list[Sample]:
    out = []
    for _ in range(n):
        x: Features = (
            float(int(gen.paretovariate(1.2) * 200)),  # long-tailed prompts
            float(gen.randint(0, 4000)),
            float(gen.randint(0, 2000)),
            float(gen.randint(0, 3)),
            float(gen.randint(0, 16)),
            gen.random(),
        )
        y = engine_ttft(x, per_token, base) * (1 + gen.uniform(-noise, noise))
        out.append(Sample(x, y, 0.01 + 0.001 * x[4]))
    return out


def test_a_line_converges_on_each_synthetic_engine() -> None:
    gen = random.Random(5)
    for per_token, base in ((20e-6, 0.01), (80e-6, 0.05)):
        f = fit(samples(gen, 200, per_token, base, noise=0.05))
        assert f is not None
        probe: Features = (3000.0, 1000.0, 500.0, 1.0, 8.0, 0.5)
        assert f.ttft_s(probe) == pytest.approx(engine_ttft(probe, per_token, base), rel=0.1)
        assert f.ttft[1] == pytest.approx(per_token, rel=0.15)  # its per-token prefill time
        tpot = f.tpot_s(probe)
        assert tpot == pytest.approx(0.018, rel=0.05)


def test_slopes_stay_non_negative_and_predictions_bounded() -> None:
    gen = random.Random(2)
    got = samples(gen, 100, 20e-6, 0.01)
    # A feature that falls as TTFT rises (collinearity in a short window): no negative slope.
    skewed = [
        Sample((s.x[0], s.x[1], s.x[2], 100.0 - s.ttft * 100, s.x[4], s.x[5]), s.ttft, None)
        for s in got
    ]
    f = fit(skewed)
    assert f is not None
    assert all(w >= 0.0 for w in f.ttft[1:])
    assert f.tpot is None  # no sample carried one
    slowest = max(s.ttft for s in skewed)
    huge: Features = (1e9, 1e9, 1e9, 1e6, 1e6, 1.0)
    assert f.ttft_s(huge) == pytest.approx(CEILING * slowest)
    assert f.ttft_s((0.0, 0.0, 0.0, 0.0, 0.0, 0.0)) >= 0.0


def test_the_reservoir_is_bounded_per_stratum_and_keeps_rare_long_prompts() -> None:
    learner = Learner(min_samples=8)
    short: Features = (10.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    long: Features = (50_000.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    for i in range(10_000):
        learner.add("a", Sample(long if i % 1000 == 0 else short, 0.1, None))
    held = learner.samples("a")
    assert len(held) <= PER_STRATUM * (len(STRATA) + 1)
    assert sum(1 for s in held if s.x[0] == long[0]) == 10  # every one of the rare ones
    learner.forget(["b"])
    assert learner.samples("a") == []


def test_fallback_order_engine_then_pooled_then_least_load() -> None:
    gen = random.Random(3)
    learner = Learner(min_samples=24)
    bal = Latency(random.Random(1))
    a = Candidate("a", 1.0, 0, reading(running=1))
    b = Candidate("b", 1.0, 0, reading(running=9))

    def ctx(models: Models) -> PickContext:
        return PickContext(latency=LatencyInputs(models, prompt_tokens=500))

    # Nothing learnt: least_load's pick, said so.
    choice = bal.pick([a, b], ctx(learner.refit()))
    assert choice is not None and choice.reason == "latency_fallback"
    assert choice.candidate == a and choice.predicted is None
    assert bal.pick([a, b], PickContext()).reason == "latency_fallback"  # type: ignore[union-attr]
    # Too few samples for any model: still least_load.
    for s in samples(gen, 20, 20e-6, 0.01):
        learner.add("a", s)
    assert learner.refit().pooled is None
    # Enough for the pool's, none for an engine's own.
    for s in samples(gen, 10, 20e-6, 0.01):
        learner.add("b", s)
    models = learner.refit()
    assert models.pooled is not None and not models.engines
    choice = bal.pick([a, b], ctx(models))
    assert choice is not None and choice.reason == "latency_pooled"
    # Then `a` has its own.
    for s in samples(gen, 10, 20e-6, 0.01):
        learner.add("a", s)
    models = learner.refit()
    assert models.pooled is not None and set(models.engines) == {"a"}
    got = {bal.pick([a, b], ctx(models)).reason for _ in range(50)}  # type: ignore[union-attr]
    assert got <= {"latency_model", "latency_pooled"}
    # `b` alone: its own model is not there yet, the pool's is.
    choice = bal.pick([b], ctx(models))
    assert choice is not None and choice.reason == "latency_pooled"
    assert choice.predicted is not None and choice.features is not None


def models_for(speeds: dict[str, float]) -> Models:
    gen = random.Random(11)
    learner = Learner(min_samples=24)
    for name, per_token in speeds.items():
        for s in samples(gen, 120, per_token, 0.01):
            learner.add(name, s)
    return learner.refit()


def test_it_learns_which_engine_is_slow_and_sends_long_prompts_to_the_fast_one() -> None:
    models = models_for({"fast": 20e-6, "slow": 80e-6})
    bal = Latency(random.Random(1))
    fast = Candidate("fast", 1.0, 0, reading(running=4))
    slow = Candidate("slow", 1.0, 0, reading(running=0))  # idler, but 4x slower to prefill
    ctx = PickContext(latency=LatencyInputs(models, prompt_tokens=4000))
    picks = [bal.pick([fast, slow], ctx) for _ in range(200)]
    assert all(p is not None for p in picks)
    chosen = [p.candidate.name for p in picks if p is not None]
    assert chosen.count("fast") >= 200 * (1 - EXPLORE) - 10
    assert picks[0] is not None and picks[0].reason == "latency_model"
    # Prefix credit: the slow engine holding the whole prompt is now the quicker one.
    held = Hints(blocks=64, block_chars=256, held={"slow": 64})
    ctx = PickContext(hints=held, latency=LatencyInputs(models, prompt_tokens=4000))
    choice = bal.pick(
        [fast, slow],
        ctx,
    )
    assert choice is not None and choice.candidate == slow and choice.cached == 4000
    assert choice.held == 64


def test_an_slo_packs_onto_the_slowest_engine_that_meets_it() -> None:
    models = models_for({"fast": 20e-6, "slow": 80e-6})
    bal = Latency(random.Random(1))
    fast = Candidate("fast", 1.0, 0, reading())
    slow = Candidate("slow", 1.0, 0, reading())
    fast_s = models.engines["fast"].ttft_s((1000.0, 0, 0, 0, 0, 0))
    slow_s = models.engines["slow"].ttft_s((1000.0, 0, 0, 0, 0, 0))
    assert fast_s < slow_s
    # Recent requests carried a tighter SLO: the fast engine is kept for them.
    lat = LatencyInputs(models, prompt_tokens=1000, tightest_ms=fast_s * 1000)
    loose = PickContext(slo_ttft_ms=slow_s * 1000 * 1.5, latency=lat)
    assert bal.pick([fast, slow], loose).candidate == slow  # type: ignore[union-attr]
    # None tighter than its own: nothing to keep the fast engine for, the lowest prediction.
    same = LatencyInputs(models, prompt_tokens=1000, tightest_ms=slow_s * 1000 * 1.5)
    alone = PickContext(slo_ttft_ms=slow_s * 1000 * 1.5, latency=same)
    assert bal.pick([fast, slow], alone).candidate == fast  # type: ignore[union-attr]
    tight = PickContext(slo_ttft_ms=(fast_s + slow_s) / 2 * 1000, latency=lat)
    assert bal.pick([fast, slow], tight).candidate == fast  # type: ignore[union-attr]
    # None meets it: the most headroom (the fastest); shed only a sheddable one with admission.
    none = PickContext(slo_ttft_ms=fast_s * 1000 / 2, latency=lat, priority="sheddable")
    choice = bal.pick([fast, slow], none)
    assert choice is not None and choice.candidate == fast and choice.reason == "latency_model"
    shed = LatencyInputs(models, prompt_tokens=1000, shed=True)
    for priority, reason in (("sheddable", UNATTAINABLE), ("standard", "latency_model")):
        ctx = PickContext(slo_ttft_ms=fast_s * 1000 / 2, latency=shed, priority=priority)
        assert bal.pick([fast, slow], ctx).reason == reason  # type: ignore[union-attr]


def test_a_session_stays_on_its_engine_unless_it_is_worse_by_more_than_the_break() -> None:
    models = models_for({"fast": 20e-6, "slow": 80e-6})
    bal = Latency(random.Random(1))
    fast = Candidate("fast", 1.0, 0, reading())
    slow = Candidate("slow", 1.0, 0, reading())
    x: Features = (1000.0, 0, 0, 0, 0, 0)
    gap = models.engines["slow"].ttft_s(x) - models.engines["fast"].ttft_s(x)
    kept = LatencyInputs(models, prompt_tokens=1000, pinned="slow", break_s=gap * 2)
    choice = bal.pick([fast, slow], PickContext(latency=kept))
    assert choice is not None and choice.candidate == slow and choice.reason == "session"
    broken = LatencyInputs(models, prompt_tokens=1000, pinned="slow", break_s=gap / 2)
    assert bal.pick([fast, slow], PickContext(latency=broken)).candidate == fast  # type: ignore[union-attr]
    gone = LatencyInputs(models, prompt_tokens=1000, pinned="gone", break_s=10.0)
    assert bal.pick([fast, slow], PickContext(latency=gone)).candidate == fast  # type: ignore[union-attr]
    # Excluded (it failed this request): not kept.
    ctx = PickContext(exclude={"slow"}, latency=kept)
    assert bal.pick([fast, slow], ctx).candidate == fast  # type: ignore[union-attr]


def test_stale_engines_are_passed_over_and_no_model_means_least_load() -> None:
    models = models_for({"fast": 20e-6, "slow": 80e-6})
    bal = Latency(random.Random(1))
    fast = Candidate("fast", 1.0, 0, reading(stale=True))
    slow = Candidate("slow", 1.0, 0, reading())
    ctx = PickContext(latency=LatencyInputs(models, prompt_tokens=100))
    assert all(bal.pick([fast, slow], ctx).candidate == slow for _ in range(20))  # type: ignore[union-attr]
    assert bal.pick([], ctx) is None
    assert bal.pick([fast, slow], PickContext(latency=LatencyInputs(NO_MODELS))).reason == (  # type: ignore[union-attr]
        "latency_fallback"
    )


def test_a_fits_spread_is_its_p90_error_and_packing_keeps_within_it() -> None:
    gen = random.Random(7)
    exact = fit(samples(gen, 200, 20e-6, 0.01))
    noisy = fit(samples(gen, 200, 80e-6, 0.01, noise=0.5))
    assert exact is not None and noisy is not None
    assert 1.0 <= exact.spread < 1.05
    assert 1.2 < noisy.spread <= 1.5  # uniform +-50 % noise: its p90 is about 1.4
    learner = Learner(min_samples=24)
    for s in samples(gen, 120, 20e-6, 0.01):
        learner.add("fast", s)
    for s in samples(gen, 120, 80e-6, 0.01, noise=0.5):
        learner.add("slow", s)
    models = learner.refit()
    bal = Latency(random.Random(1))
    fast = Candidate("fast", 1.0, 0, reading())
    slow = Candidate("slow", 1.0, 0, reading())
    lat = LatencyInputs(models, prompt_tokens=1000, tightest_ms=1.0)  # packing
    x: Features = (1000.0, 0, 0, 0, 0, 0)
    slow_f = models.engines["slow"]
    slow_s = slow_f.ttft_s(x)
    # Within the slow engine's bare prediction, not within its spread: packing leaves it.
    edge = PickContext(slo_ttft_ms=slow_s * 1000 * 1.05, latency=lat)
    assert bal.pick([fast, slow], edge).candidate == fast  # type: ignore[union-attr]
    roomy = PickContext(slo_ttft_ms=slow_s * slow_f.spread * 1000 * 1.05, latency=lat)
    assert bal.pick([fast, slow], roomy).candidate == slow  # type: ignore[union-attr]


def test_the_queue_wait_counts_against_the_slo_and_only_sheddable_work_is_shed() -> None:
    models = models_for({"fast": 20e-6, "slow": 80e-6})
    bal = Latency(random.Random(1))
    fast = Candidate("fast", 1.0, 0, reading())
    slow = Candidate("slow", 1.0, 0, reading())
    fast_s = models.engines["fast"].ttft_s((1000.0, 0, 0, 0, 0, 0))
    slo_ms = fast_s * 1000 * 2
    for queued, priority, reason in (
        (0.0, "sheddable", "latency_model"),  # the engines alone meet it
        (fast_s * 1.5, "sheddable", UNATTAINABLE),  # the queue eats all but half its TTFT
        (fast_s * 1.5, "standard", "latency_model"),  # never shed: the most headroom
    ):
        lat = LatencyInputs(models, prompt_tokens=1000, shed=True, queued_s=queued)
        ctx = PickContext(slo_ttft_ms=slo_ms, latency=lat, priority=priority)
        choice = bal.pick([fast, slow], ctx)
        assert choice is not None and choice.reason == reason, (queued, priority)
        assert choice.candidate == fast
    # No model yet: only the queue's wait can be judged.
    for queued, priority, reason in (
        (0.2, "sheddable", UNATTAINABLE),
        (0.05, "sheddable", "latency_fallback"),
        (0.2, "standard", "latency_fallback"),
    ):
        lat = LatencyInputs(NO_MODELS, shed=True, queued_s=queued)
        ctx = PickContext(slo_ttft_ms=100.0, latency=lat, priority=priority)
        assert bal.pick([fast, slow], ctx).reason == reason  # type: ignore[union-attr]
    # Without admission nothing is shed, whatever the queue.
    lat = LatencyInputs(NO_MODELS, shed=False, queued_s=1.0)
    ctx = PickContext(slo_ttft_ms=100.0, latency=lat, priority="sheddable")
    assert bal.pick([fast, slow], ctx).reason == "latency_fallback"  # type: ignore[union-attr]


def test_queued_prefill_costs_at_least_the_own_prompts_slope_though_never_seen() -> None:
    # Samples of an engine the router never loaded: no prefill ever queued ahead.
    gen = random.Random(11)
    quiet = [
        Sample((s.x[0], 0.0, s.x[2], s.x[3], s.x[4], s.x[5]), 0.01 + 40e-6 * s.x[0], None)
        for s in samples(gen, 200, 40e-6, 0.01)
    ]
    f = fit(quiet)
    assert f is not None
    assert f.ttft[1] == pytest.approx(40e-6, rel=0.1)
    assert f.ttft[2] >= f.ttft[1]
    # 8000 tokens dispatched there and not yet first-tokened: predicted behind them.
    idle = f.ttft_s((500.0, 0, 0, 0, 0, 0))
    flooded = f.ttft_s((500.0, 8000.0, 0, 0, 0, 0))
    assert flooded - idle == pytest.approx(8000 * 40e-6, rel=0.1)


def test_the_tightest_recent_slo_is_the_minimum_of_the_last_window_or_two() -> None:
    recent = RecentMin(window=4)
    assert recent.saw(500.0) == 500.0
    assert recent.saw(50.0) == 50.0
    assert [recent.saw(500.0) for _ in range(2)] == [50.0, 50.0]  # the bucket rotates at 4
    assert [recent.saw(500.0) for _ in range(4)] == [50.0, 50.0, 50.0, 500.0]


def test_without_a_model_every_pick_is_least_loads_own_over_a_moving_load() -> None:
    """The fallback is least_load's pick, also as in-flight counts move between readings (its
    `since` bookkeeping): the same choices, one for one, as a least_load of the same seed."""
    gen = random.Random(3)
    lat, load = Latency(random.Random(7)), LeastLoad(random.Random(7))
    inflight = {"a": 0, "b": 0}
    seq = 0
    for i in range(400):
        seq += i % 5 == 0  # a new reading every fifth pick; in-flight counts move in between
        cands = [
            Candidate(
                n,
                1.0,
                inflight[n],
                EngineReading(gen.randint(0, 3), gen.randint(0, 4), 0.1, None, None, 1.0, seq),
            )
            for n in "ab"
        ]
        got = lat.pick(cands, PickContext(latency=LatencyInputs(NO_MODELS, prompt_tokens=1000)))
        want = load.pick(cands, PickContext())
        assert got is not None and want is not None
        assert (got.candidate.name, got.reason) == (want.candidate.name, "latency_fallback")
        inflight[want.candidate.name] += 1
        if gen.random() < 0.5:
            n = gen.choice("ab")
            inflight[n] = max(0, inflight[n] - 1)
