"""The background runner, in process, on an injected sleep (no real waits): chores keep their
pace, a failing chore is counted, logged once a streak and backs off, a body that ends is started
again, a wake cuts a wait short, a timer keeps the schedule its step gives, and stop leaves no task
behind."""

from __future__ import annotations

import asyncio
import logging

import pytest

from router.core.runner import Runner, Wake
from tests.support.clock import ManualClock, settle


class FakeTime:
    """`sleep` records the wait and returns at once; `clock` moves by the waits only."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)

    def clock(self) -> float:
        return self.now


async def until(done: asyncio.Event) -> None:
    async with asyncio.timeout(5):
        await done.wait()


def test_every_keeps_its_interval_read_before_each_wait() -> None:
    async def main() -> tuple[list[float], list[tuple[str, bool]]]:
        t = FakeTime()
        reports: list[tuple[str, bool]] = []
        runner = Runner(sleep=t.sleep, clock=t.clock, on_run=lambda n, ok: reports.append((n, ok)))
        intervals = iter([1.0, 2.0, 3.0] + [3.0] * 100)
        done = asyncio.Event()
        calls = 0

        async def step() -> None:
            nonlocal calls
            calls += 1
            if calls == 3:
                done.set()

        runner.every("chore", step, lambda: next(intervals))
        runner.start()
        await until(done)
        await runner.stop()
        return t.waits[:3], reports[:3]

    waits, reports = asyncio.run(main())
    assert waits == [1.0, 2.0, 3.0]
    assert reports == [("chore", True)] * 3


def test_a_failing_chore_backs_off_logs_once_a_streak_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> tuple[list[float], Runner]:
        t = FakeTime()
        runner = Runner(sleep=t.sleep, clock=t.clock)
        outcomes = iter([False, False, False, False, False, True, False, True])
        done = asyncio.Event()

        async def step() -> None:
            ok = next(outcomes, None)
            if ok is None:
                done.set()
                return
            if not ok:
                raise ValueError("boom")

        runner.every("flaky", step, 1.0, backoff_max=4.0)
        runner.start()
        await until(done)
        await runner.stop()
        return t.waits, runner

    with caplog.at_level(logging.DEBUG, logger="sluicegate.runner"):
        waits, runner = asyncio.run(main())
    # Doubling after each failure in a row, capped at backoff_max; back to the interval after a
    # good round.
    assert waits[:9] == [1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 1.0, 2.0, 1.0]
    (stats,) = runner.stats()
    assert (stats.failures, stats.streak, stats.last_error) == (6, 0, "ValueError")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    # Two streaks, two warnings (with the traceback: a ValueError is a bug, not an outage).
    assert [r.getMessage() for r in warnings] == ["flaky failed", "flaky failed"]
    assert all(r.exc_info for r in warnings)
    assert sum(r.getMessage() == "flaky works again" for r in caplog.records) == 2


def test_an_outage_is_logged_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        t = FakeTime()
        runner = Runner(sleep=t.sleep, clock=t.clock)
        done = asyncio.Event()

        async def step() -> None:
            done.set()
            raise ConnectionRefusedError("secret-host:6379 refused")

        runner.every("probe", step, 1.0)
        runner.start()
        await until(done)
        await runner.stop()

    with caplog.at_level(logging.WARNING, logger="sluicegate.runner"):
        asyncio.run(main())
    (record,) = caplog.records
    assert not record.exc_info
    assert record.fields == {"chore": "probe", "error": "ConnectionRefusedError"}  # type: ignore[attr-defined]
    assert "secret-host" not in record.getMessage()


def test_forever_restarts_a_body_with_a_backoff_reset_by_a_long_run() -> None:
    async def main() -> list[float]:
        t = FakeTime()
        runner = Runner(sleep=t.sleep, clock=t.clock)
        done = asyncio.Event()
        runs = 0

        async def body() -> None:
            nonlocal runs
            runs += 1
            if runs == 4:
                t.now += 30.0  # a watch that held for a long while before it was lost
            if runs == 6:
                done.set()
                await asyncio.Event().wait()  # runs until stopped
            raise ConnectionError("lost")

        runner.forever("watch", body, backoff=0.5, backoff_max=10.0)
        runner.start()
        await until(done)
        await runner.stop()
        assert runner.stats()[0].runs == 6
        return t.waits

    assert asyncio.run(main()) == [0.5, 1.0, 2.0, 0.5, 1.0]


def test_a_body_that_returns_is_done() -> None:
    async def main() -> int:
        t = FakeTime()
        runner = Runner(sleep=t.sleep, clock=t.clock)
        runs = 0

        async def body() -> None:
            nonlocal runs
            runs += 1
            if runs < 3:
                raise ConnectionError("lost")

        runner.forever("once", body, backoff=0.5)
        runner.start()
        for _ in range(50):  # far more turns than three runs need
            await asyncio.sleep(0)
        await runner.stop()
        return runs

    assert asyncio.run(main()) == 3


def test_a_wake_cuts_the_wait_short() -> None:
    async def main() -> int:
        runner = Runner()  # real sleep: the interval is far longer than the test
        wake = asyncio.Event()
        calls = 0
        done = asyncio.Event()

        async def step() -> None:
            nonlocal calls
            calls += 1
            if calls == 2:
                done.set()

        runner.every("owed", step, 3600.0, wake=wake)
        runner.start()
        for _ in range(2):
            wake.set()
            await asyncio.sleep(0.01)
        await until(done)
        await runner.stop()
        return calls

    assert asyncio.run(main()) == 2


def test_stop_cancels_every_chore_and_late_ones_start_at_once() -> None:
    async def main() -> None:
        runner = Runner()
        started = asyncio.Event()

        async def body() -> None:
            started.set()
            await asyncio.Event().wait()

        runner.start()
        runner.forever("late", body)  # registered after start: runs now
        await until(started)
        with pytest.raises(ValueError, match="registered already"):
            runner.every("late", body, 1.0)
        before = {t.get_name() for t in asyncio.all_tasks()}
        assert "late" in before
        await runner.stop()
        assert "late" not in {t.get_name() for t in asyncio.all_tasks()}

    asyncio.run(main())


def test_a_timer_waits_as_long_as_its_step_says_and_none_until_woken() -> None:
    async def main() -> tuple[list[float], int]:
        t = FakeTime()
        runner = Runner(sleep=t.sleep, clock=t.clock)
        wake = Wake()
        dues = iter([1.0, 2.5, None, 4.0, None])
        rounds = 0

        async def step() -> float | None:
            nonlocal rounds
            rounds += 1
            return next(dues)

        runner.timer("schedule", step, wake)
        runner.start()
        await settle()
        assert rounds == 3  # at once, after 1.0, after 2.5; then nothing is due
        wake.set()
        await settle()
        await runner.stop()
        return t.waits, rounds

    waits, rounds = asyncio.run(main())
    assert waits == [1.0, 2.5, 4.0] and rounds == 5


def test_a_wake_cuts_a_timers_wait_short_and_one_set_while_it_works_is_kept() -> None:
    async def main() -> None:
        clock = ManualClock()
        runner = Runner(sleep=clock.sleep, clock=clock.now)
        wake = Wake()
        rounds: list[float] = []

        async def step() -> float | None:
            rounds.append(clock.now())
            if len(rounds) == 2:
                wake.set()  # something became due while it worked
            return 60.0

        wake.set()  # before the chore exists: remembered, harmless
        runner.timer("schedule", step, wake)
        runner.start()
        await settle()
        assert len(rounds) == 1 and clock.sleeping == 1
        wake.set()  # the 60 s wait is cut short: no time passes
        await settle()
        assert rounds == [1000.0, 1000.0, 1000.0] and clock.sleeping == 1
        clock.advance(60.0)
        await settle()
        assert rounds[-1] == 1060.0 and len(rounds) == 4
        (stats,) = runner.stats()
        assert (stats.runs, stats.failures) == (4, 0)
        await runner.stop()

    asyncio.run(main())


def test_a_failing_timer_backs_off_whatever_wakes_it() -> None:
    async def main() -> list[float]:
        t = FakeTime()
        runner = Runner(sleep=t.sleep, clock=t.clock)
        wake = Wake()
        outcomes = iter([False, False, False, True])
        done = asyncio.Event()

        async def step() -> float | None:
            wake.set()  # a busy schedule: woken all the time
            ok = next(outcomes, None)
            if ok is None:
                done.set()
                return None
            if not ok:
                raise ValueError("boom")
            return 5.0

        runner.timer("schedule", step, wake, backoff=0.5, backoff_max=1.5)
        runner.start()
        await until(done)
        await runner.stop()
        return t.waits

    assert asyncio.run(main()) == [0.5, 1.0, 1.5]


@pytest.mark.parametrize("woken_too", [False, True])
def test_stop_ends_a_waiting_timer_even_as_a_wake_comes(woken_too: bool) -> None:
    async def main() -> None:
        clock = ManualClock()
        runner = Runner(sleep=clock.sleep, clock=clock.now)
        wake = Wake()

        async def step() -> float | None:
            return None if woken_too else 30.0

        runner.timer("schedule", step, wake)
        runner.start()
        await settle()
        (task,) = (t for t in asyncio.all_tasks() if t.get_name() == "schedule")
        stopping = asyncio.ensure_future(runner.stop())
        await asyncio.sleep(0)  # the stop's cancel is on its way
        if woken_too:
            wake.set()  # a wake racing the stop must not swallow it
        async with asyncio.timeout(5):
            await stopping
        assert task.done()

    asyncio.run(main())
