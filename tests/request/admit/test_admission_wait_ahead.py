"""The admission queue's predicted wait (`wait_ahead`, what `balancer: latency` holds against a
request's TTFT SLO before it queues) and the wait spent (`waited`), on a manual clock: the
entries ahead of a ticket times the interval between two leaving its model's queue."""

from __future__ import annotations

import asyncio
import time

import pytest

from balancers.inflight.base import Lease
from router.core.settings import AdmissionConfig
from router.request.admit.admission import Admission, Ticket
from tests.support.clock import ManualClock, settle


def ticket(tenant: str, band: int = 1) -> Ticket:
    return Ticket("m", band, tenant, 1.0, 100.0, time.perf_counter() + 60, "max_wait")


def test_the_wait_ahead_is_the_entries_before_it_times_the_drain_interval() -> None:
    async def main() -> None:
        clock = ManualClock()
        adm = Admission(AdmissionConfig(max_wait=60, recheck=60), clock=clock.now)
        free = 0

        async def try_once() -> Lease | None:
            nonlocal free
            if free <= 0:
                return None
            free -= 1
            return Lease("b")

        async def one(t: Ticket) -> None:
            await adm.acquire(t, try_once)

        probe = ticket("probe", band=2)  # sheddable: behind every band
        assert adm.wait_ahead(probe) == 0.0  # nothing waits
        tasks = [asyncio.create_task(one(ticket(f"t{i}"))) for i in range(4)]
        await settle()
        assert adm.depth == 4
        # Four ahead, but no queue has let one through yet: no interval to go on.
        assert adm.wait_ahead(probe) == 0.0
        # A slot frees every 0.5 s: the interval is learnt from the queue's own drain.
        for _ in range(2):
            clock.advance(0.5)
            free += 1
            adm.released()
            await settle()
        assert adm.depth == 2
        assert adm.wait_ahead(probe) == pytest.approx(2 * 0.5)
        # A ticket of a higher band sees only its own band and those above.
        assert adm.wait_ahead(ticket("vip", band=0)) == 0.0
        queued = tasks[3]
        clock.advance(0.25)
        assert adm.waited(probe) == 0.0  # never queued
        free += 2
        adm.released()
        await settle()
        assert queued.done() and adm.depth == 0
        assert adm.wait_ahead(probe) == 0.0
        await asyncio.gather(*tasks)
        await adm.aclose()

    asyncio.run(main())


def test_waited_is_the_time_since_it_queued() -> None:
    async def main() -> None:
        clock = ManualClock()
        adm = Admission(AdmissionConfig(max_wait=60, recheck=60), clock=clock.now)
        seen: list[float] = []
        t = ticket("a")
        tries = 0

        async def try_once() -> Lease | None:
            nonlocal tries
            tries += 1
            seen.append(adm.waited(t))
            return Lease("b") if tries > 1 else None

        task = asyncio.create_task(adm.acquire(t, try_once))
        await settle()
        clock.advance(1.5)
        adm.released()
        await settle()
        assert task.done() and seen == [0.0, 1.5]
        await adm.aclose()

    asyncio.run(main())
