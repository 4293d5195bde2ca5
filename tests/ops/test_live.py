"""What the console's live view reads, on injected clocks: the ring of routing per second
(router/ops/live.py) and the admission queue's bands; and the console's settings."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from router.core.settings import AdmissionConfig, ConsoleConfig, Settings
from router.ops.live import MAX_NAMES, MAX_SAMPLES, OTHER, SECONDS, WINDOW, Live
from router.request.admit.admission import Admission, Ticket
from router.request.admit.quota import KeyLimits, Quotas


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_rates_and_percentiles_cover_the_last_minute_of_whole_seconds() -> None:
    clock = Clock()
    live = Live(clock)
    for _ in range(WINDOW):
        for i in range(10):
            live.routed("a", "load")
            live.answered("a", 0.01 * (i + 1))  # 10 ms .. 100 ms every second
        live.routed("b", "prefix")
        live.answered("b", None)  # not a stream: counted, no TTFT
        clock.t += 1
    live.routed("a", "load")  # this second is not whole yet: not counted
    view = live.view()
    assert view["backends"]["a"]["rps"] == 10.0
    assert view["backends"]["a"]["ttft_p50"] == pytest.approx(0.06)
    assert view["backends"]["a"]["ttft_p99"] == pytest.approx(0.1)
    assert view["backends"]["b"] == {
        "rps": 1.0,
        "ttft_p50": None,
        "ttft_p99": None,
        "ttft_samples": 0,
    }
    assert view["reasons"] == {"load": 10.0, "prefix": 1.0}
    assert view["series"]["throughput"][-1] == 11
    assert len(view["series"]["throughput"]) == SECONDS - 1
    # A minute later with no traffic the rates are gone, and the old slots are reused.
    clock.t += WINDOW + 1
    assert live.view()["backends"] == {}
    clock.t += SECONDS
    assert sum(live.view()["series"]["throughput"]) == 0


def test_the_ring_is_bounded_whatever_the_traffic() -> None:
    clock = Clock()
    live = Live(clock)
    for i in range(MAX_NAMES + 50):
        live.routed(f"backend-{i}", f"reason-{i}")
    for _ in range(MAX_SAMPLES * 3):
        live.answered("backend-0", 0.5)
    slot = live._slots[int(clock.t) % SECONDS]
    assert len(slot.backends) == MAX_NAMES + 1 and slot.backends[OTHER] == 50
    assert len(slot.ttft["backend-0"]) == MAX_SAMPLES
    clock.t += 1
    view = live.view()
    assert view["backends"][OTHER]["rps"] == round(50 / WINDOW, 3)
    assert view["backends"]["backend-0"]["ttft_samples"] == MAX_SAMPLES
    assert view["series"]["throughput"][-1] == MAX_SAMPLES * 3


def test_queue_depth_is_the_seconds_peak_and_carries_through_quiet_seconds() -> None:
    clock = Clock()
    live = Live(clock)
    live.queued(1)
    live.queued(1)
    live.queued(1)
    live.queued(-2)  # peak 3, 1 left waiting
    clock.t += 5
    series = live.view()["series"]["queue"]
    assert series[-5:] == [3, 1, 1, 1, 1]
    assert live.view()["queue_now"] == 1


def test_the_view_is_built_once_a_second() -> None:
    clock = Clock()
    live = Live(clock)
    first = live.view()
    live.routed("a", "load")
    assert live.view() is first
    clock.t += 1
    assert live.view() is not first


def test_the_console_is_off_by_default_and_its_path_avoids_the_routers_own() -> None:
    assert Settings().console == ConsoleConfig(enabled=False, path="/console", refresh=1.0)
    assert ConsoleConfig(path="/ops/console").path == "/ops/console"
    for bad in ("/admin", "/admin/console", "/v1", "/metrics", "console", "/", "/a b", "/x/"):
        with pytest.raises(ValidationError):
            ConsoleConfig(path=bad)
    with pytest.raises(ValidationError):
        ConsoleConfig(refresh=0.1)  # the page may not hammer the router


def test_the_admission_queue_reports_depth_and_oldest_wait_per_band() -> None:
    clock = Clock(50.0)
    queue = Admission(AdmissionConfig(), clock=clock)

    async def nothing_free() -> None:
        return None

    async def scenario() -> dict[str, dict[str, float | int]]:
        def ticket(band: int) -> Ticket:
            return Ticket("m", band, "tenant", 1.0, 100.0, 1e9, "max_wait")

        waiting = [asyncio.create_task(queue.acquire(ticket(1), nothing_free))]
        await asyncio.sleep(0)
        clock.t += 2.0
        waiting += [asyncio.create_task(queue.acquire(ticket(b), nothing_free)) for b in (1, 0)]
        await asyncio.sleep(0)
        clock.t += 0.5
        seen = queue.bands()
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        await queue.aclose()
        return seen

    seen = asyncio.run(scenario())
    assert seen["standard"] == {"depth": 2, "oldest_wait": 2.5}
    assert seen["critical"] == {"depth": 1, "oldest_wait": 0.5}
    assert seen["sheddable"] == {"depth": 0, "oldest_wait": 0.0}
    assert queue.bands()["standard"]["depth"] == 0  # every exit takes its entry out


def test_quota_use_is_read_without_changing_the_window() -> None:
    clock = Clock(100.0)
    quotas = Quotas(clock=clock)
    limits = KeyLimits("team", rpm=10, tpm=1000, max_parallel=4, label="team")
    held = [quotas.admit_now(limits, 100, f"r{i}") for i in range(3)]
    assert quotas.in_use("team") == (3, 300, 3)
    held[0].close(40)  # the answer used 40 of its 100 estimated tokens
    clock.t += 30
    assert quotas.in_use("team") == (3, 240, 2)
    assert quotas.in_use("nobody") == (0, 0, 0)
    clock.t += 31  # the window has moved past them
    assert quotas.in_use("team") == (0, 0, 2)
    assert quotas.in_use("team") == (0, 0, 2)  # reading again reads the same
