"""The admission queue's order inside one band, as a policy: slots freed one at a time go to
tenants in proportion to weight, counted in estimated tokens; a woken request that leaves hands
its wake on. (The end-to-end behaviour through a router is in test_admission.py.)"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from balancers.inflight.base import Lease
from router.core.settings import AdmissionConfig
from router.request.admit.admission import Admission, Ticket, make_ticket


class Slots:
    """A fleet with `free` slots; a lease takes one."""

    def __init__(self) -> None:
        self.free = 0

    async def try_once(self) -> Lease | None:
        if self.free <= 0:
            return None
        self.free -= 1
        return Lease("b")


def ticket(
    tenant: str, weight: float = 1.0, cost: float = 100.0, band: int = 1, size: int = 0
) -> Ticket:
    return Ticket(
        "m", band, tenant, weight, cost, deadline=1e12, deadline_reason="max_wait", size=size
    )


async def serve(adm: Admission, slots: Slots, tickets: list[Ticket], n: int) -> list[str]:
    """Queue every ticket, then free `n` slots one by one; the tenants in the order served."""
    order: list[str] = []

    async def one(t: Ticket) -> None:
        await adm.acquire(t, slots.try_once)
        order.append(t.tenant)

    tasks = [asyncio.create_task(one(t)) for t in tickets]
    await asyncio.sleep(0)
    assert adm.depth == len(tickets)
    for i in range(n):
        slots.free += 1
        adm.released()
        for _ in range(100):  # a handful of loop turns serve it; bounded all the same
            if len(order) > i:
                break
            await asyncio.sleep(0)
        assert len(order) == i + 1  # one slot, exactly one request admitted
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert adm.depth == 0  # cancelled waiters left the queue
    await adm.aclose()
    return order


def test_weights_share_slots_in_proportion() -> None:
    tickets = [t for _ in range(12) for t in (ticket("a", 1.0), ticket("b", 3.0))]
    order = asyncio.run(serve(Admission(AdmissionConfig()), Slots(), tickets, 8))
    assert Counter(order) == {"b": 6, "a": 2}


def test_shares_count_tokens_not_requests() -> None:
    # a sends prompts four times as long: the same share of tokens is a quarter of the requests.
    tickets = [t for _ in range(12) for t in (ticket("a", cost=4000), ticket("b", cost=1000))]
    order = asyncio.run(serve(Admission(AdmissionConfig()), Slots(), tickets, 10))
    assert Counter(order) == {"b": 8, "a": 2}


def test_bands_are_strict_whatever_the_weights() -> None:
    tickets = [ticket("low", weight=1000, band=2), ticket("std"), ticket("top", band=0)]
    order = asyncio.run(serve(Admission(AdmissionConfig()), Slots(), tickets, 3))
    assert order == ["top", "std", "low"]


def test_a_woken_request_that_leaves_hands_its_wake_on() -> None:
    async def main() -> None:
        adm, slots = Admission(AdmissionConfig()), Slots()
        first, second = ticket("a"), ticket("b")
        got: list[str] = []

        async def one(t: Ticket) -> None:
            await adm.acquire(t, slots.try_once)
            got.append(t.tenant)

        a = asyncio.create_task(one(first))
        b = asyncio.create_task(one(second))
        await asyncio.sleep(0)
        slots.free = 1
        adm.released()  # wakes `first`...
        a.cancel()  # ...which leaves before it runs
        for _ in range(10):
            await asyncio.sleep(0)
        assert got == ["b"] and adm.depth == 0
        await b
        await adm.aclose()

    asyncio.run(main())


def test_the_estimate_is_body_bytes_over_four_plus_the_completion_budget() -> None:
    from starlette.datastructures import Headers

    from router.request.admit.estimate import COMPLETION_LIMITS, estimate_tokens

    assert estimate_tokens({"max_tokens": 50}, 4000, default_max_tokens=256) == 1000 + 50
    assert estimate_tokens({"max_completion_tokens": 7}, 400) == 100 + 7
    assert estimate_tokens({}, 400, default_max_tokens=256) == 100 + 256
    # completions: the engine reads max_tokens only, whatever max_completion_tokens says
    both = {"max_tokens": 9, "max_completion_tokens": 10**19}
    assert estimate_tokens(both, 400, COMPLETION_LIMITS) == 100 + 9
    cfg = AdmissionConfig()
    t = make_ticket(cfg, Headers({}), "r", "m", 356, 400, 0.0, "critical", 1.0, "")
    assert isinstance(t, Ticket) and t.cost == 356 and t.size == 400 and t.band == 0


def test_real_usage_corrects_the_tenants_later_share() -> None:
    async def main(used: float) -> list[str]:
        adm, slots = Admission(AdmissionConfig()), Slots()
        order: list[str] = []

        async def one(t: Ticket) -> None:
            await adm.acquire(t, slots.try_once)
            order.append(t.tenant + str(t.seq))
            if t.tenant == "a":
                adm.settle(t, used)  # it used far more than its estimate of 100

        a1, b1 = ticket("a"), ticket("b")
        tasks = [asyncio.create_task(one(a1)), asyncio.create_task(one(b1))]
        await asyncio.sleep(0)
        slots.free = 1
        adm.released()
        for _ in range(20):
            await asyncio.sleep(0)
        assert order == ["a1"]
        a2, b2 = ticket("a"), ticket("b")
        tasks += [asyncio.create_task(one(a2)), asyncio.create_task(one(b2))]
        await asyncio.sleep(0)
        for _ in range(3):
            slots.free += 1
            adm.released()
            for _ in range(20):
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        await adm.aclose()
        return [o[0] for o in order]

    assert asyncio.run(main(1000)) == ["a", "b", "b", "a"]  # a's overrun pushed a2 back
    assert asyncio.run(main(100)) == ["a", "b", "a", "b"]  # as estimated: a2 keeps its turn


def test_a_release_while_the_head_tries_makes_it_try_again() -> None:
    """The head finds no room, but a slot freed while it was trying: it tries once more."""

    async def main() -> None:
        adm = Admission(AdmissionConfig())
        free = [0]
        tries = [0]

        async def try_once() -> Lease | None:
            tries[0] += 1
            await asyncio.sleep(0)  # a shared store's round trip
            if tries[0] == 2:  # the first woken try: room frees meanwhile, too late for it
                free[0] = 1
                adm.released()
                return None
            if free[0]:
                free[0] -= 1
                return Lease("b")
            return None

        task = asyncio.create_task(adm.acquire(ticket("a"), try_once))
        await asyncio.sleep(0)
        adm.released()  # wakes it: try 2 fails, sees the release, try 3 succeeds
        lease = await asyncio.wait_for(task, 1)
        assert lease.backend == "b" and tries[0] == 3 and adm.depth == 0
        await adm.aclose()

    asyncio.run(main())


def test_a_release_racing_a_leaving_request_wakes_the_next_one() -> None:
    """A queued request whose wait just ended (its client left, or its deadline passed: both
    cancel its future) but whose task has not run yet: a release in that window must not fail
    the releasing request, and the slot goes to the next one in the queue."""

    async def main() -> None:
        adm, slots = Admission(AdmissionConfig()), Slots()
        first, second = ticket("a"), ticket("b")
        got: list[str] = []

        async def one(t: Ticket) -> None:
            await adm.acquire(t, slots.try_once)
            got.append(t.tenant)

        a = asyncio.create_task(one(first))
        b = asyncio.create_task(one(second))
        await asyncio.sleep(0)
        a.cancel()  # the client leaves...
        slots.free = 1
        adm.released()  # ...and a slot frees before its task runs
        await asyncio.wait_for(b, 1)
        assert got == ["b"] and adm.depth == 0 and a.cancelled()
        await adm.aclose()

    asyncio.run(main())


def test_a_full_queue_racing_a_leaving_request_still_admits_the_newcomer() -> None:
    """The entry a full queue would shed has just ended its wait: it leaves by itself and the
    higher-band newcomer takes its place."""

    async def main() -> None:
        adm, slots = Admission(AdmissionConfig(max_queue=1)), Slots()
        low = asyncio.create_task(adm.acquire(ticket("low", band=2), slots.try_once))
        await asyncio.sleep(0)
        assert adm.depth == 1
        low.cancel()

        async def free_later() -> None:
            await asyncio.sleep(0)
            slots.free = 1
            adm.released()

        freer = asyncio.create_task(free_later())
        # Awaited here, not in a task: it reaches the full queue before `low`'s task runs.
        lease = await adm.acquire(ticket("top", band=0), slots.try_once)
        assert lease.backend == "b" and low.cancelled() and adm.depth == 0
        await freer
        await adm.aclose()

    asyncio.run(main())


def test_requests_that_leave_unserved_are_not_refunded_to_their_tenant() -> None:
    """A key whose queued requests leave without a slot (expired, shed, client gone) keeps the
    place it took in the fair order: refunding their estimate (the proxy settles them with 0
    tokens used) would put its next requests level with a quiet key's, and a key flooding past
    max_wait would take the quiet key's share."""

    async def main() -> list[str]:
        adm, slots = Admission(AdmissionConfig()), Slots()
        order: list[str] = []

        async def one(t: Ticket) -> None:
            used = 0.0  # as the proxy counts it: nothing without a backend's answer
            try:
                await adm.acquire(t, slots.try_once)
                order.append(t.tenant)
                used = t.cost
            finally:
                adm.settle(t, used)

        keep = asyncio.create_task(one(ticket("c")))  # keeps the queue (and its tags) alive
        flood = [asyncio.create_task(one(ticket("a"))) for _ in range(10)]
        await asyncio.sleep(0)
        for task in flood:
            task.cancel()  # a's clients give up
        await asyncio.gather(*flood, return_exceptions=True)
        later = [asyncio.create_task(one(ticket("a"))) for _ in range(3)]
        later.append(asyncio.create_task(one(ticket("b"))))
        await asyncio.sleep(0)
        for i in range(5):
            slots.free += 1
            adm.released()
            for _ in range(100):
                if len(order) > i:
                    break
                await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(keep, *later), 1)
        await adm.aclose()
        return order

    assert asyncio.run(main()) == ["c", "b", "a", "a", "a"]


def test_queued_bytes_are_bounded_and_shed_the_lowest_band_first() -> None:
    from router.request.admit.admission import QueueFull

    async def main() -> None:
        cfg = AdmissionConfig(max_queue_bytes=3000, max_wait=5)
        adm, slots = Admission(cfg), Slots()
        parked: list[str] = []

        def enter(t: Ticket, name: str) -> asyncio.Task[Lease]:
            return asyncio.create_task(adm.acquire(t, slots.try_once, lambda: parked.append(name)))

        low = [ticket("a", band=2, size=1000) for _ in range(3)]
        waiting = [enter(t, f"low{i}") for i, t in enumerate(low)]
        await asyncio.sleep(0)
        assert adm.depth == 3 and adm.queued_bytes == 3000
        assert parked == ["low0", "low1", "low2"]
        # A standard request over the bound sheds the lowest band's latest entries to fit.
        mid = enter(ticket("b", size=1500), "mid")
        await asyncio.sleep(0)
        assert adm.queued_bytes == 2500 and adm.depth == 2
        for t in waiting[1:]:
            with pytest.raises(QueueFull):
                await t
        # A newcomer lower than all that waits, and a body bigger than the bound, are refused.
        with pytest.raises(QueueFull):
            await adm.acquire(ticket("c", band=2, size=1000), slots.try_once)
        with pytest.raises(QueueFull):
            await adm.acquire(ticket("c", band=0, size=3001), slots.try_once)
        assert adm.queued_bytes == 2500
        slots.free = 2
        adm.released()
        adm.released()
        await asyncio.wait_for(asyncio.gather(waiting[0], mid), 5)
        assert adm.queued_bytes == 0 and adm.depth == 0
        await adm.aclose()

    asyncio.run(main())
