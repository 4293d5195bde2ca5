"""Holding (router/request/admit/holding.py) on a manual clock: a held request is woken by the
first ready backend, sends its keep-alive every `keepalive_s`, ends at its timeout with
`NoBackend` and Retry-After, is refused past `max_held` without touching another model, and
gives back its count and future however it ends (the client's cancel included)."""

from __future__ import annotations

import asyncio

import pytest

from router.core.errors import NoBackend, TooManyHeld
from router.core.settings import ScaleFromZeroConfig, Settings
from router.request.admit.holding import Holding, declared_models
from tests.support.clock import ManualClock, settle, until

CFG = ScaleFromZeroConfig(models=["a", "b"], hold_timeout_s=60, max_held=2, keepalive_s=15)


def _holding(clock: ManualClock, ready: set[str]) -> Holding:
    return Holding(CFG, CFG.models, clock, lambda m: m in ready)


def test_declared_models_come_from_the_section_and_discovery_lists() -> None:
    s = Settings.model_validate(
        {
            "scale_from_zero": {"models": ["a"]},
            "discovery": [
                {"kind": "dns", "name": "pool.local", "port": 8000, "models": ["b", "a"]},
                {"kind": "dns", "name": "auto.local", "port": 8000},
            ],
        }
    )
    assert declared_models(s) == ("a", "b")
    assert declared_models(Settings()) == ()


def test_woken_by_the_first_ready_backend_with_keepalives_meanwhile() -> None:
    async def main() -> None:
        clock = ManualClock()
        ready: set[str] = set()
        h = _holding(clock, ready)
        beats: list[float] = []

        async def keepalive() -> None:
            beats.append(clock.now())

        task = asyncio.create_task(h.hold("a", 60, keepalive))
        await until(lambda: h.held("a") == 1 and clock.sleeping == 1)
        assert h.demand("a") == 1
        clock.advance(15)
        await until(lambda: len(beats) == 1)
        clock.advance(15)
        await until(lambda: len(beats) == 2)
        h.changed()  # not ready yet: still held
        await settle()
        assert not task.done()
        ready.add("a")
        h.changed()
        await asyncio.wait_for(task, 1)
        assert h.held("a") == 0 and clock.sleeping == 0

    asyncio.run(main())


def test_timeout_is_no_backend_with_retry_after() -> None:
    async def main() -> None:
        clock = ManualClock()
        h = _holding(clock, set())
        task = asyncio.create_task(h.hold("a", 3))
        await until(lambda: clock.sleeping == 1)
        clock.advance(3)
        with pytest.raises(NoBackend) as err:
            await asyncio.wait_for(task, 1)
        assert err.value.status == 503 and err.value.code == "no_backend"
        assert (b"retry-after", b"3") in err.value.headers
        assert h.held("a") == 0 and not h.models["a"].waiters

    asyncio.run(main())


def test_max_held_refuses_at_once_per_model_and_cancel_gives_everything_back() -> None:
    async def main() -> None:
        clock = ManualClock()
        h = _holding(clock, set())
        tasks = [asyncio.create_task(h.hold("a", 60)) for _ in range(2)]
        await until(lambda: h.held("a") == 2)
        with pytest.raises(TooManyHeld) as err:
            await h.hold("a", 60)
        assert err.value.code == "too_many_held" and err.value.headers
        other = asyncio.create_task(h.hold("b", 60))  # another model is not starved
        await until(lambda: h.held("b") == 1)
        for t in [*tasks, other]:
            t.cancel()
        await asyncio.gather(*tasks, other, return_exceptions=True)
        assert h.held("a") == h.held("b") == 0
        assert not h.models["a"].waiters and clock.sleeping == 0

    asyncio.run(main())
