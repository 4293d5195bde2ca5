"""The health state machine and the failover policy, driven by an injected clock (no sleeps)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest

from health.state import HealthBook, ProbeResult
from router.core.backend import Backend
from router.core.errors import FailureKind
from router.core.settings import BackendConfig, HealthConfig, OutlierConfig, RetryConfig
from router.request.lifecycle.failover import Failover, RetryBudget


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(name: str, models: Any = None, **extra: Any) -> Backend:
    cfg = BackendConfig(
        name=name, url=f"http://127.0.0.1:9/{name}", models=models or ["m"], **extra
    )
    return Backend.from_config(cfg)


def book(
    backends: list[Backend],
    clock: Clock,
    health: HealthConfig | None = None,
    outlier: OutlierConfig | None = None,
) -> HealthBook:
    b = HealthBook(health, outlier, clock=clock, wall=lambda: 5000.0 + clock.now)
    b.sync(backends)
    return b


def names(backends: list[Backend]) -> list[str]:
    return [b.name for b in backends]


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sluicegate.health" and r.getMessage() == event]


FAIL = ProbeResult(False, None, "connect")
OK = ProbeResult(True, 1.5)


def test_probe_thresholds_flip_state_and_log_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sluicegate.health")
    clock = Clock()
    a, b = make("a"), make("b")
    hb = book([a, b], clock)
    hb.on_probe("a", FAIL)
    hb.on_probe("a", FAIL)
    assert names(hb.eligible([a, b], "m")) == ["a", "b"]  # 2 < unhealthy_threshold 3
    for _ in range(4):
        hb.on_probe("a", FAIL)
    assert names(hb.eligible([a, b], "m")) == ["b"]
    assert len(events(caplog, "unhealthy")) == 1
    row = hb.describe("a")
    assert row["healthy"] is False and row["reason"] == "probe failed (connect)"
    hb.on_probe("a", OK)
    assert names(hb.eligible([a, b], "m")) == ["b"]  # 1 < healthy_threshold 2
    hb.on_probe("a", FAIL)  # a failure resets the success streak
    hb.on_probe("a", OK)
    assert names(hb.eligible([a, b], "m")) == ["b"]
    hb.on_probe("a", OK)
    hb.on_probe("a", OK)
    assert names(hb.eligible([a, b], "m")) == ["a", "b"]
    assert len(events(caplog, "healthy")) == 1
    assert hb.describe("a")["last_probe_latency_ms"] == 1.5


def test_consecutive_failures_eject_with_backoff_and_cap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "sluicegate.health")
    clock = Clock()
    a, b, c = make("a"), make("b"), make("c")
    hb = book([a, b, c], clock)
    durations = []
    for _ in range(12):
        for _ in range(4):
            hb.on_failure("a", "connect")
        assert "a" in names(hb.eligible([a, b, c], "m"))
        hb.on_failure("a", FailureKind.STATUS, 503)
        assert "a" not in names(hb.eligible([a, b, c], "m"))
        row = hb.describe("a")
        durations.append(round(row["ejected_until"] - (5000.0 + clock.now), 3))
        assert row["reason"] == "ejected: 5 consecutive failures (status_503)"
        # Failures of requests already in flight neither extend nor repeat the ejection.
        hb.on_failure("a", "connect")
        clock.advance(durations[-1] - 0.001)
        assert "a" not in names(hb.eligible([a, b, c], "m"))
        clock.advance(0.001)
        assert "a" in names(hb.eligible([a, b, c], "m"))
        hb.advance()
        assert hb.describe("a")["consecutive_failures"] == 0
    assert durations == [30, 60, 90, 120, 150, 180, 210, 240, 270, 300, 300, 300]
    assert len(events(caplog, "ejected")) == 12
    assert len(events(caplog, "ejection over")) == 12


def test_success_resets_the_failure_streak_and_4xx_429_do_not_count() -> None:
    clock = Clock()
    a, b = make("a"), make("b")
    hb = book([a, b], clock)
    for _ in range(4):
        hb.on_failure("a", "timeout")
    hb.on_success("a")
    for _ in range(4):
        hb.on_failure("a", "mid_stream")
    for status in (429, 404, 400):
        hb.on_failure("a", FailureKind.STATUS, status)
    assert names(hb.eligible([a, b], "m")) == ["a", "b"]
    assert hb.describe("a")["consecutive_failures"] == 4


def test_ejection_count_decays_after_a_quiet_max_ejection() -> None:
    clock = Clock()
    a, b, c = make("a"), make("b"), make("c")
    hb = book([a, b, c], clock)

    def eject() -> float:
        for _ in range(5):
            hb.on_failure("a", "connect")
        until = hb.describe("a")["ejected_until"]
        assert until is not None
        return float(until) - (5000.0 + clock.now)

    assert eject() == 30
    clock.advance(30)
    hb.eligible([a, b, c], "m")
    clock.advance(10)
    assert eject() == 60  # soon after: backs off
    clock.advance(60)
    hb.eligible([a, b, c], "m")
    clock.advance(300)
    assert eject() == 30  # behaved for max_ejection: starts over


def test_never_eject_more_than_the_share_of_a_models_backends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "sluicegate.health")
    clock = Clock()
    fleet = [make(n) for n in "abcd"]
    hb = book(fleet, clock)  # max_ejection_percent 50: 2 of 4
    for name in "abc":
        for _ in range(7):
            hb.on_failure(name, "connect")
    assert names(hb.eligible(fleet, "m")) == ["c", "d"]
    refused = events(caplog, "ejection refused")
    assert len(refused) == 1 and refused[0].fields["backend"] == "c"  # type: ignore[attr-defined]
    clock.advance(30)  # a and b come back; c's next failure may now eject it
    assert names(hb.eligible(fleet, "m")) == ["a", "b", "c", "d"]
    hb.on_failure("c", "connect")
    assert names(hb.eligible(fleet, "m")) == ["a", "b", "d"]


def test_share_counts_every_model_a_backend_serves() -> None:
    clock = Clock()
    a = make("a", ["m", "solo"])
    b = make("b", ["m"])
    hb = book([a, b], clock)
    for _ in range(5):
        hb.on_failure("a", "connect")
    # Ejecting `a` would take all of `solo`'s backends: refused.
    assert hb.describe("a")["ejected_until"] is None


def test_panic_mode_routes_to_all_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sluicegate.health")
    clock = Clock()
    a, b = make("a"), make("b")
    draining = dataclasses.replace(make("d"), draining=True)
    hb = book([a, b, draining], clock)
    for name in "ab":
        for _ in range(3):
            hb.on_probe(name, FAIL)
    for _ in range(3):
        assert names(hb.eligible([a, b, draining], "m")) == ["a", "b"]
        hb.advance()
    assert len(events(caplog, "panic mode")) == 1
    assert hb.panicking() == {"m"}
    hb.on_probe("a", OK)
    hb.on_probe("a", OK)
    assert names(hb.eligible([a, b, draining], "m")) == ["a"]
    hb.advance()
    assert len(events(caplog, "panic mode over")) == 1


def test_panic_mode_still_leaves_cooling_backends_alone() -> None:
    clock = Clock()
    a, b = make("a"), make("b")
    hb = book([a, b], clock)
    for _ in range(3):
        hb.on_probe("a", FAIL)
    hb.cool_down("b", 5)
    assert names(hb.eligible([a, b], "m")) == ["a"]
    hb.cool_down("a", 3)
    assert hb.eligible([a, b], "m") == []
    assert hb.retry_after([a, b]) == 3
    clock.advance(3)
    assert names(hb.eligible([a, b], "m")) == ["a"]
    assert hb.retry_after([a, b]) == 2


def test_cooldown_until_retry_after_expires(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sluicegate.health")
    clock = Clock()
    a, b = make("a"), make("b")
    hb = book([a, b], clock)
    hb.cool_down("a", 10)
    hb.cool_down("a", 2)  # a shorter ask does not shorten it
    assert names(hb.eligible([a, b], "m")) == ["b"]
    row = hb.describe("a")
    assert row["healthy"] is False and row["cooldown_until"] == 5000.0 + clock.now + 10
    assert row["reason"] == "cooling down (Retry-After)"
    clock.advance(9.999)
    assert names(hb.eligible([a, b], "m")) == ["b"]
    clock.advance(0.001)
    assert names(hb.eligible([a, b], "m")) == ["a", "b"]
    assert hb.describe("a")["healthy"] is True
    assert len(events(caplog, "cooling down")) == 1
    assert events(caplog, "cooldown over") == []  # reading changed nothing
    hb.advance()
    assert len(events(caplog, "cooldown over")) == 1


def test_good_probes_readmit_an_ejection_but_not_twice_in_a_row_on_probes_alone() -> None:
    clock = Clock()
    a, b, c = make("a"), make("b"), make("c")
    hb = book([a, b, c], clock)
    for _ in range(5):
        hb.on_failure("a", "connect")
    assert hb.out_of_rotation("a")
    # Restarted before any probe saw it down: healthy_threshold good probes readmit it.
    hb.on_probe("a", OK)
    assert "a" not in names(hb.eligible([a, b, c], "m"))
    hb.on_probe("a", OK)
    assert "a" in names(hb.eligible([a, b, c], "m")) and not hb.out_of_rotation("a")
    # It fails again at once: /health answers while completions fail (a hung engine). The
    # ejection doubles, and probes alone no longer end it.
    clock.advance(1)
    for _ in range(5):
        hb.on_failure("a", "timeout")
    assert hb.describe("a")["ejected_until"] == pytest.approx(5000.0 + clock.now + 60)
    for _ in range(5):
        hb.on_probe("a", OK)
    assert "a" not in names(hb.eligible([a, b, c], "m"))
    # The probe saw it down (a crash), then up twice in a row: readmitted early.
    hb.on_probe("a", FAIL)
    hb.on_probe("a", OK)
    assert "a" not in names(hb.eligible([a, b, c], "m"))
    hb.on_probe("a", OK)
    assert "a" in names(hb.eligible([a, b, c], "m"))
    assert hb.describe("a")["ejected_until"] is None


def test_out_of_rotation_backends_are_probed_every_unhealthy_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """New backends are probed at once; one ejected by traffic within `unhealthy_interval`,
    and again every `unhealthy_interval` while out of rotation; the others wait `interval`.
    On the monitor's clock and runner (a manual clock, moved a step at a time)."""
    import random

    import health.monitor
    from health.monitor import HealthMonitor
    from router.core.runner import Runner
    from tests.support.clock import ManualClock, settle, until

    unhealthy = 1.0
    step = unhealthy / 100
    cfg = HealthConfig(interval=30.0, unhealthy_interval=unhealthy, unhealthy_threshold=1)
    clock = ManualClock()
    backends = [make("a"), make("b"), make("c")]
    hb = HealthBook(cfg, clock=clock.now)
    hb.sync(backends)
    probed: list[tuple[str, float]] = []
    failing: set[str] = set()

    async def fake_probe(transport: Any, backend: Backend, cfg: HealthConfig) -> ProbeResult:
        probed.append((backend.name, clock.now()))
        if backend.name in failing:
            return ProbeResult(False, None, "connect")
        return ProbeResult(True, 1.0)

    monkeypatch.setattr(health.monitor, "probe", fake_probe)

    def count(name: str) -> int:
        return sum(1 for n, _ in probed if n == name)

    async def run_until(what: Callable[[], bool], seconds: float) -> float:
        """The clock moved a step at a time until `what()` holds: the seconds it took."""
        began = clock.now()
        while not what():
            assert clock.now() - began < seconds, probed
            clock.advance(step)
            await settle()
        return clock.now() - began

    async def main() -> None:
        runner = Runner(sleep=clock.sleep, clock=clock.now)
        runner.start()
        mon = HealthMonitor(hb, rng=random.Random(1), runner=runner, clock=clock.now)
        mon.sync(backends)
        await mon.start()
        try:
            await until(lambda: all(count(n) == 1 for n in "abc"))
            assert {t for _, t in probed} == {clock.now()}  # at once: no time has passed
            assert mon.probing() == {"a", "b", "c"}
            for _ in range(5):
                hb.on_failure("a", FailureKind.CONNECT)  # ejected by traffic
            assert hb.out_of_rotation("a")
            # Within unhealthy_interval (+-10 % jitter), not its 30 s interval.
            took = await run_until(lambda: count("a") == 2, 40 * unhealthy)
            assert 0.9 * unhealthy <= took <= 1.1 * unhealthy + step
            failing.add("c")
            mon.update([dataclasses.replace(backends[2], url="http://127.0.0.1:9/c2")], [])
            await until(lambda: count("c") == 2)  # changed: probed at once, and fails
            took = await run_until(lambda: count("c") >= 4, 80 * unhealthy)
            assert 2 * 0.9 * unhealthy <= took <= 2 * 1.1 * unhealthy + step  # every interval
            assert count("b") == 1  # in rotation: its 30 s are not up
            mon.update([], ["c"])
            gone = len(probed)
            for _ in range(400):  # four unhealthy intervals
                clock.advance(step)
                await settle(5)
            assert all(n != "c" for n, _ in probed[gone:]) and mon.probing() == {"a", "b"}
        finally:
            await mon.aclose()
            await runner.stop()

    asyncio.run(main())


def test_per_backend_overrides_merge_over_the_global_sections() -> None:
    clock = Clock()
    a = make("a", outlier={"consecutive_failures": 2}, health={"unhealthy_threshold": 1})
    b, c = make("b"), make("c")
    hb = book(
        [a, b, c],
        clock,
        health=HealthConfig(healthy_threshold=4),
        outlier=OutlierConfig(base_ejection=7),
    )
    assert hb.outlier_config("a").base_ejection == 7
    assert hb.health_config("a").healthy_threshold == 4
    assert hb.health_config("a").unhealthy_threshold == 1
    hb.on_failure("a", "connect")
    hb.on_failure("a", "connect")
    assert hb.describe("a")["ejected_until"] == 5000.0 + clock.now + 7
    hb.on_probe("b", FAIL)
    assert hb.describe("b")["healthy"] is True
    hb.on_probe("c", FAIL)
    hb.on_probe("a", FAIL)
    assert hb.describe("a")["reason"] == "probe failed (connect)"


def test_removed_or_moved_backends_are_forgotten() -> None:
    clock = Clock()
    a, b = make("a"), make("b")
    hb = book([a, b], clock)
    for _ in range(3):
        hb.on_probe("a", FAIL)
        hb.on_probe("b", FAIL)
    hb.sync([b])
    hb.sync([a, b])
    assert hb.describe("a")["healthy"] is True
    assert hb.describe("b")["healthy"] is False
    moved = Backend.from_config(BackendConfig(name="b", url="http://127.0.0.1:8", models=["m"]))
    hb.sync([a, moved])
    assert hb.describe("b")["healthy"] is True


# -- failover policy ---------------------------------------------------------------------------


class Boom(Exception):
    pass


def test_retry_budget_share_with_a_floor() -> None:
    budget = RetryBudget(20, 3)
    assert budget.allows(1)
    budget.active = 3
    assert not budget.allows(10)  # 20 % of 10 = 2 < floor 3
    assert budget.allows(100)  # 20 % of 100 = 20
    budget.active = 20
    assert not budget.allows(100)


def test_failover_retries_then_succeeds_and_releases_the_budget() -> None:
    fo = Failover(RetryConfig(attempts=3), lambda: 1, Boom)
    seen: list[tuple[int, int]] = []

    async def attempt(n: int, answered: Callable[[], None]) -> str:
        seen.append((n, fo.budget.active))
        if n < 3:
            raise Boom
        answered()  # the response started: this retry no longer counts
        seen.append((n, fo.budget.active))
        answered()
        return "done"

    assert asyncio.run(fo.run(attempt)) == "done"
    assert seen == [(1, 0), (2, 1), (3, 1), (3, 0)]
    assert fo.budget.active == 0


def test_failover_stops_at_attempts_and_raises_the_last_error() -> None:
    fo = Failover(RetryConfig(attempts=2), lambda: 1, Boom)
    calls: list[int] = []

    async def attempt(n: int, answered: Callable[[], None]) -> None:
        calls.append(n)
        raise Boom(str(n))

    with pytest.raises(Boom, match="2"):
        asyncio.run(fo.run(attempt))
    assert calls == [1, 2]


def test_failover_respects_the_budget_and_other_errors_pass_through() -> None:
    fo = Failover(RetryConfig(attempts=3, budget_percent=20, min_retries=3), lambda: 10, Boom)
    fo.budget.active = 3  # other requests already use the whole budget
    calls: list[int] = []

    async def attempt(n: int, answered: Callable[[], None]) -> None:
        calls.append(n)
        raise Boom

    with pytest.raises(Boom):
        asyncio.run(fo.run(attempt))
    assert calls == [1] and fo.budget.refused == 1

    async def broken(n: int, answered: Callable[[], None]) -> None:
        calls.append(n)
        raise ValueError("a bug is not a backend failure")

    calls.clear()
    fo.budget.active = 0
    with pytest.raises(ValueError):
        asyncio.run(fo.run(broken))
    assert calls == [1]


def test_failover_cancellation_is_not_retried_and_frees_the_budget() -> None:
    fo = Failover(RetryConfig(attempts=3), lambda: 1, Boom)
    calls: list[int] = []

    async def main() -> None:
        second = asyncio.Event()

        async def attempt(n: int, answered: Callable[[], None]) -> None:
            calls.append(n)
            if n == 1:
                raise Boom
            second.set()
            await asyncio.Event().wait()

        task = asyncio.ensure_future(fo.run(attempt))
        await asyncio.wait_for(second.wait(), 5)
        assert fo.budget.active == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert calls == [1, 2] and fo.budget.active == 0


def test_probe_intervals_are_jittered_within_ten_percent() -> None:
    import random

    from health.monitor import HealthMonitor

    mon = HealthMonitor(HealthBook(), rng=random.Random(7))
    delays = [mon.next_delay(5.0) for _ in range(1000)]
    assert all(4.5 <= d <= 5.5 for d in delays)
    assert max(delays) - min(delays) > 0.9  # spread out, not one fixed period


def test_reading_health_has_no_side_effects(caplog: pytest.LogCaptureFixture) -> None:
    """Reads answer from the clock; only `advance()` (the monitor's tick) applies transitions."""
    caplog.set_level(logging.INFO, "sluicegate.health")
    changes: list[tuple[str, bool, str]] = []
    clock = Clock()
    a, b = make("a"), make("b")
    hb = HealthBook(
        HealthConfig(),
        OutlierConfig(),
        clock=clock,
        wall=lambda: 5000.0 + clock.now,
        on_change=lambda *change: changes.append(change),
    )
    hb.sync([a, b])
    for _ in range(5):
        hb.on_failure("a", FailureKind.CONNECT)
    assert changes == [("a", False, "outlier_connect")]
    clock.advance(30)
    before = hb.describe("a")
    for _ in range(3):
        assert names(hb.eligible([a, b], "m")) == ["a", "b"]
        assert hb.routable(a, clock()) and hb.retry_after([a, b]) is None
    assert hb.describe("a") == before and len(changes) == 1
    assert events(caplog, "ejection over") == []
    hb.advance()
    assert changes[-1] == ("a", True, "ejection over")
    assert len(events(caplog, "ejection over")) == 1
    assert hb.describe("a")["consecutive_failures"] == 0
