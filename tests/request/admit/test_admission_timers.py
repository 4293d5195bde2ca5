"""The admission queue's time, on a manual clock (the app's runner and clock, no real waits):
deadlines end waits in their order exactly when the clock passes them, a request that left is
not expired later, and the re-check lets an idle-waiting queue's head try every `recheck`
seconds while anything waits, and sleeps while nothing does."""

from __future__ import annotations

import asyncio
import time

import pytest

from balancers.inflight.base import Lease
from router.core.errors import NoCapacity
from router.core.runner import Runner
from router.core.settings import AdmissionConfig
from router.request.admit.admission import Admission, QueueTimeout, Ticket
from tests.support.clock import ManualClock, settle


def ticket(tenant: str, wait: float, reason: str = "max_wait") -> Ticket:
    # A deadline is made on the request's clock (perf_counter), as make_ticket makes it.
    return Ticket("m", 1, tenant, 1.0, 100.0, time.perf_counter() + wait, reason)


def queue(cfg: AdmissionConfig) -> tuple[Admission, ManualClock, Runner]:
    clock = ManualClock()
    runner = Runner(sleep=clock.sleep, clock=clock.now)
    return Admission(cfg, clock=clock.now, runner=runner), clock, runner


def runs(runner: Runner, chore: str) -> int:
    return next(s.runs for s in runner.stats() if s.name == chore)


def test_deadlines_end_waits_in_their_order_when_the_clock_passes_them() -> None:
    async def main() -> None:
        adm, clock, runner = queue(AdmissionConfig(max_wait=30, recheck=60))
        runner.start()
        ended: dict[str, BaseException | None] = {}
        tickets = [ticket("late", 20.0), ticket("soon", 5.0, "deadline"), ticket("left", 3.0)]

        async def one(t: Ticket) -> None:
            async def full() -> Lease | None:
                return None

            try:
                await adm.acquire(t, full)
            except NoCapacity as exc:
                ended[t.tenant] = exc

        tasks = {t.tenant: asyncio.create_task(one(t)) for t in tickets}
        await settle()
        assert adm.depth == 3
        tasks["left"].cancel()  # the client left before its deadline
        await settle()
        assert adm.depth == 2
        clock.advance(4.9)
        await settle()
        assert ended == {} and adm.depth == 2
        clock.advance(0.2)
        await settle()
        assert list(ended) == ["soon"] and isinstance(ended["soon"], QueueTimeout)
        assert "its own deadline" in str(ended["soon"])
        clock.advance(14.8)
        await settle()
        assert list(ended) == ["soon"] and adm.depth == 1
        clock.advance(0.2)
        await settle()
        assert list(ended) == ["soon", "late"] and adm.depth == 0
        assert "admission.max_wait" in str(ended["late"])
        assert all(t.done() for t in tasks.values())
        await runner.stop()
        await adm.aclose()

    asyncio.run(main())


@pytest.mark.parametrize("other_replica_frees", [False, True])
def test_the_recheck_tries_the_head_every_period_while_anything_waits(
    other_replica_frees: bool,
) -> None:
    async def main() -> None:
        adm, clock, runner = queue(AdmissionConfig(max_wait=300, recheck=2.0))
        runner.start()
        tries = 0
        free = False

        async def try_once() -> Lease | None:
            nonlocal tries
            tries += 1
            return Lease("b") if free else None

        waiting = asyncio.create_task(adm.acquire(ticket("a", 300.0), try_once))
        await settle()
        assert tries == 1 and adm.depth == 1  # found no room: queued
        clock.advance(1.9)
        await settle()
        assert tries == 1
        clock.advance(0.1)  # a period: the head tries again, still no room
        await settle()
        assert tries == 2 and adm.depth == 1
        free = other_replica_frees  # a slot freed elsewhere: no release here tells the queue
        clock.advance(2.0)
        await settle()
        assert tries == 3
        if other_replica_frees:
            assert (await waiting).backend == "b" and adm.depth == 0
            clock.advance(2.0)  # its next round finds nothing waiting...
            await settle()
            rounds = runs(runner, "admission_recheck")
            clock.advance(60.0)  # ...and it sleeps until something queues
            await settle()
            assert runs(runner, "admission_recheck") == rounds and tries == 3
        else:
            waiting.cancel()
        await runner.stop()
        await adm.aclose()

    asyncio.run(main())
