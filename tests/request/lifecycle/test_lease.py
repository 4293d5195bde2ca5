"""The attempt's lease (router/request/lifecycle/lease.py) gives back what an attempt took in
reverse order of taking, skips nothing when cancelled while it closes the answer, and lets a
prefill lease handed to a call aside go back only when that call ends.

The lifecycle tests hold every ending of a real request to "nothing left"
(tests/request/lifecycle/test_steps.py); these hold the owner's order, with stand-ins that log.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

from balancers.context import NO_CONTEXT
from balancers.inflight.base import Lease
from balancers.round_robin import RoundRobin
from router.core.backend import Backend
from router.core.settings import BackendConfig
from router.request.lifecycle.lease import AttemptLease


def backend(name: str) -> Backend:
    data = {"name": name, "url": f"http://{name}.test:8000", "models": ["m"]}
    return Backend.from_config(BackendConfig.model_validate(data))


A = backend("a")
P = backend("p")


class Log:
    """Stand-ins for the parts an attempt takes from, each logging what is given back."""

    def __init__(self) -> None:
        self.said: list[str] = []

    async def acquire(self, backends: Any, *_: Any) -> Lease:
        return Lease(backends[0].name)

    def release(self, lease: Lease) -> None:
        self.said.append(f"lease {lease.backend}")

    def released(self) -> None:
        self.said.append("admission told")

    def ended(self, flight: Any) -> None:
        self.said.append("kv flight")

    def start(self, backend: str, adapter: str) -> None:
        pass

    def end(self, backend: str, adapter: str) -> None:
        self.said.append("adapter flight")

    def using(self, backend: str, adapter: str) -> None:
        pass

    def done(self, backend: str, adapter: str) -> None:
        self.said.append("adapter use")


class Answer:
    def __init__(self, log: Log, closing: asyncio.Event | None = None) -> None:
        self.log = log
        self.closing = closing

    async def aclose(self) -> None:
        if self.closing is not None:
            await self.closing.wait()
        self.log.said.append("answer")


def held_by(log: Log) -> AttemptLease:
    parts = SimpleNamespace(
        store=log,
        admission=log,
        affinity=SimpleNamespace(kv=log),
        flights=log,
        lora=log,
    )
    call = SimpleNamespace(snapshot=SimpleNamespace(by_name={"a": A, "p": P}), model="m")
    return AttemptLease(cast(Any, parts), cast(Any, call))


async def take_all(held: AttemptLease, log: Log, closing: asyncio.Event | None = None) -> None:
    """What an attempt of a split request for an adapter takes, in the attempt's order."""
    assert await held.take([A], RoundRobin(), NO_CONTEXT, None) is not None
    assert held.backend is A
    held.flight = cast(Any, object())
    assert await held.take_prefill([P], RoundRobin(), NO_CONTEXT, None) is not None
    held.adapter_flying()
    held.using_adapter(cast(Any, log))
    held.answer = cast(Any, Answer(log, closing))


REVERSE = [
    "answer",
    "adapter use",
    "adapter flight",
    "lease p",
    "kv flight",
    "lease a",
    "admission told",
]


def test_close_gives_back_in_reverse_order_and_leaves_the_owner_empty() -> None:
    async def scenario() -> None:
        log = Log()
        held = held_by(log)
        await take_all(held, log)
        await held.close()
        assert log.said == REVERSE
        assert (held.lease, held.backend, held.flight, held.prefill, held.answer) == (None,) * 5
        await held.close()  # nothing twice
        assert log.said == REVERSE
        await take_all(held, log)  # the next attempt reuses it
        await held.close()
        assert log.said == REVERSE * 2

    asyncio.run(scenario())


def test_a_cancel_while_the_answer_closes_skips_nothing() -> None:
    async def scenario() -> None:
        log = Log()
        held = held_by(log)
        closing = asyncio.Event()  # never set: the answer's close hangs until cancelled
        await take_all(held, log, closing)
        task = asyncio.ensure_future(held.close())
        await asyncio.sleep(0)
        assert log.said == []  # still closing the answer
        task.cancel()
        await asyncio.wait((task,))
        assert task.cancelled()
        assert log.said == REVERSE[1:]

    asyncio.run(scenario())


def test_a_prefill_lease_handed_aside_goes_back_when_that_call_ends() -> None:
    async def scenario() -> None:
        log = Log()
        held = held_by(log)
        await take_all(held, log)
        finish = asyncio.Event()

        async def prefill_call() -> None:
            try:
                await finish.wait()
            finally:
                await asyncio.shield(finish.wait())  # outlives the cancel `close` sends

        side = asyncio.ensure_future(prefill_call())
        held.aside(side)
        assert held.prefill is None
        await asyncio.sleep(0)
        task = asyncio.ensure_future(held.close())
        await asyncio.sleep(0)
        task.cancel()  # the attempt's task cancelled again while the call aside ends
        await asyncio.wait((task,))
        assert "lease p" not in log.said  # the call aside still runs on the prefill engine
        assert log.said == [s for s in REVERSE if s != "lease p"]
        finish.set()
        await asyncio.wait((side,))  # its done callbacks run in order: the release first
        assert log.said[-1] == "lease p"

    asyncio.run(scenario())
