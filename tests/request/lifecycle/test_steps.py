"""Each step of the lifecycle gives back what it took, also when an exception is raised inside it
or the request is cancelled there: getting in's quota reservation and admission ticket, the
attempt's lease (and the queue told a slot freed), the prefill leg's lease, the drain count.

The harness is the in-process one (tests/request/lifecycle/test_inprocess.py): the real app with
every upstream exchange answered by the test. `Router.assert_idle` runs after each scenario; the
checks here add what a quota or an admission queue would leave behind.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import httpx
import pytest

from router.core.settings import AdmissionConfig, ClientKeyConfig, DisaggregationConfig
from router.request.admit.admission import TIMEOUT_HEADER
from router.request.lifecycle.call import Call as RequestCall
from tests.request.lifecycle.test_inprocess import (
    BACKENDS,
    CHAT,
    SSE,
    Call,
    Router,
    backend,
    serve,
    vllm_stream,
)
from tests.support.clock import ManualClock, settle

KEY = b"client-key"
TIMEOUT = TIMEOUT_HEADER.encode()
# One client key, named `k`, with a quota: its requests hold a reservation from getting in on.
QUOTA: dict[str, Any] = {
    "api_keys": [
        ClientKeyConfig(
            sha256=hashlib.sha256(KEY).hexdigest(), name="k", max_parallel=5, tpm=1_000_000
        )
    ]
}


class Bug(Exception):
    """An exception that is no upstream failure: a bug on the way."""


def keyed_chat(r: Router) -> Call:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    return r.post(CHAT, body, [(b"authorization", b"Bearer " + KEY)])


def in_flight_of_key(r: Router) -> int:
    return r.proxy.quotas.in_use("k")[2]


def tokens_of_key(r: Router) -> float:
    return r.proxy.quotas.in_use("k")[1]


def parking(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Set when a request enters the admission queue (it parks its parsed body then)."""
    parked = asyncio.Event()
    real = RequestCall.parked

    def parked_and_told(self: RequestCall) -> None:
        real(self)
        parked.set()

    monkeypatch.setattr(RequestCall, "parked", parked_and_told)
    return parked


# Getting in: the quota reservation is closed however the request ends.


def test_the_reservation_is_corrected_to_the_tokens_a_request_used() -> None:
    async def scenario(r: Router) -> None:
        call = keyed_chat(r)
        ex = await r.upstreams.next()
        assert in_flight_of_key(r) == 1
        reserved = tokens_of_key(r)
        ex.answer(200, SSE)
        ex.end(*vllm_stream(2, usage=True))
        await call.done()
        assert call.status == 200
        assert in_flight_of_key(r) == 0
        # The estimate held while it ran, then the real use: 9 prompt + 2 completion tokens.
        assert reserved > 11
        assert tokens_of_key(r) == 11

    serve(scenario, **QUOTA)


@pytest.mark.parametrize(
    "step", ["picking", "before_the_head", "mid_body", "accounting", "server_cancel"]
)
def test_the_reservation_is_closed_when_a_later_step_raises_or_is_cancelled(
    monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    async def scenario(r: Router) -> None:
        with monkeypatch.context() as patched:  # undone before the checks after the scenario
            if step == "picking":
                patched.setattr(r.proxy.health, "eligible", _raise_bug)
            if step == "accounting":
                patched.setattr(r.proxy.usage, "record", _raise_bug)
            await _ended_at(r, step)
        assert in_flight_of_key(r) == 0
        assert r.app.lifecycle.active == 0

    serve(scenario, **QUOTA)


async def _ended_at(r: Router, step: str) -> None:
    call = keyed_chat(r)
    if step == "picking":
        with pytest.raises(Bug):
            await call.task
        assert r.upstreams.exchanges == []
    else:
        ex = await r.upstreams.next()
        assert in_flight_of_key(r) == 1
        if step == "before_the_head":
            ex.fail(Bug())
        elif step == "mid_body":
            ex.answer(200, SSE)
            ex.break_off(Bug(), *vllm_stream(10, usage=True)[:2])
        elif step == "accounting":
            ex.answer(200, SSE)
            ex.end(*vllm_stream(2, usage=True))
        else:
            call.task.cancel()
        with pytest.raises(asyncio.CancelledError if step == "server_cancel" else Bug):
            await call.task
        assert r.upstreams.exchanges == [ex]


def _raise_bug(*args: Any, **kwargs: Any) -> Any:
    raise Bug()


# The attempt: its lease is released whatever is raised between the pick and the answer.


def test_an_exception_between_the_pick_and_the_upstream_request_releases_the_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario(r: Router) -> None:
        with monkeypatch.context() as patched:
            patched.setattr(r.proxy.metrics, "routed", _raise_bug)
            call = r.chat(stream=True)
            with pytest.raises(Bug):
                await call.task
        assert r.upstreams.exchanges == []  # it never reached a backend
        # assert_idle (after the scenario): no lease left on the backend it picked

    serve(scenario)


# Admission: the ticket's queue place, and the slot an attempt frees.

FULL_AT_ONE: dict[str, Any] = {
    # Only a released lease wakes the queue in this test's time: its periodic re-check is
    # longer than the harness lets a scenario run.
    "admission": AdmissionConfig(recheck=60),
}


def _one_slot_each() -> list[Any]:
    return [backend(n, max_inflight=1) for n in BACKENDS]


async def _two_running_one_queued(
    r: Router, monkeypatch: pytest.MonkeyPatch, headers: list[tuple[bytes, bytes]] | None = None
) -> tuple[Any, ...]:
    """Both one-slot backends busy with a request each, a third (with `headers`) waiting in
    admission's queue: (admission, the two calls, their upstream exchanges, the third call)."""
    admission = r.proxy.admission
    assert admission is not None
    parked = parking(monkeypatch)
    first, second = r.chat(stream=True), r.chat(stream=True)
    held = (await r.upstreams.next(), await r.upstreams.next())
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    third = r.post(CHAT, body, headers)
    await parked.wait()
    assert admission.depth == 1  # its timers are the app runner's chores: no task of its own
    return admission, (first, second), held, third


@pytest.mark.parametrize("how", ["client_left", "server_cancel"])
def test_a_request_that_leaves_the_admission_queue_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    async def scenario(r: Router) -> None:
        admission, (first, second), held, third = await _two_running_one_queued(r, monkeypatch)
        if how == "client_left":
            await third.leave()
            assert third.task.exception() is None
        else:
            third.task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await third.task
        assert admission.depth == 0
        assert third.status is None
        for ex, call in zip(held, (first, second), strict=True):
            ex.answer(200, SSE)
            ex.end(*vllm_stream(2, usage=True))
            await call.done()
        assert len(r.upstreams.exchanges) == 2  # the third never reached a backend

    serve(scenario, _one_slot_each(), **FULL_AT_ONE)


@pytest.mark.parametrize("timeout_header", [None, "4"], ids=["max_wait", "client_deadline"])
def test_a_queued_request_gets_503_when_the_apps_clock_passes_its_deadline(
    monkeypatch: pytest.MonkeyPatch, timeout_header: str | None
) -> None:
    """The queue's deadlines are on the app's clock: a request queued behind a full fleet waits
    while that clock stands (however long it really takes), and leaves with a 503 and
    Retry-After once the clock passes `max_wait` (10 s here) or its own shorter timeout."""
    clock = ManualClock()
    limit = 10.0 if timeout_header is None else float(timeout_header)

    async def scenario(r: Router) -> None:
        admission, (first, second), held, third = await _two_running_one_queued(
            r, monkeypatch, [] if timeout_header is None else [(TIMEOUT, timeout_header.encode())]
        )
        clock.advance(limit - 1.0)
        await settle()
        assert admission.depth == 1 and not third.task.done()
        clock.advance(1.0)
        await third.done()
        assert third.status == 503 and third.json()["error"]["code"] == "queue_timeout"
        assert int(third.header("retry-after") or 0) >= 1
        reason = "max_wait" if timeout_header is None else "deadline"
        assert await r.metric("sluicegate_shed_total", reason=reason) == 1
        assert admission.depth == 0
        for ex, call in zip(held, (first, second), strict=True):
            ex.answer(200, SSE)
            ex.end(*vllm_stream(2, usage=True))
            await call.done()
        assert len(r.upstreams.exchanges) == 2  # the third never reached a backend

    config = {"admission": AdmissionConfig(max_wait=10.0, recheck=60)}
    serve(scenario, _one_slot_each(), clock=clock, **config)


@pytest.mark.parametrize("failure", ["bug", "connect_error"])
def test_an_attempt_that_raises_frees_its_slot_for_the_queued_request(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    async def scenario(r: Router) -> None:
        admission, (first, second), (ex1, ex2), third = await _two_running_one_queued(
            r, monkeypatch
        )
        if failure == "bug":
            ex1.fail(Bug())
            with pytest.raises(Bug):
                await first.task
        else:
            # The other backend is full: no retry; its slot goes to the queued request.
            ex1.fail(httpx.ConnectError("refused"))
        # The first's lease went back and the queue was told: the third is woken and sent.
        ex3 = await r.upstreams.next()
        assert ex3.backend == ex1.backend
        assert admission.depth == 0
        for ex in (ex2, ex3):
            ex.answer(200, SSE)
            ex.end(*vllm_stream(2, usage=True))
        await second.done()
        await third.done()
        if failure != "bug":
            await first.task

    serve(scenario, _one_slot_each(), **FULL_AT_ONE)


# Prefill/decode: the prefill leg's lease, and the decode lease around it.


def _split() -> tuple[list[Any], dict[str, Any]]:
    """Decode engines `a` and `b`, prefill engine `p`; every prompt is split (NIXL)."""
    backends = [*(backend(n, role="decode") for n in BACKENDS), backend("p", role="prefill")]
    return backends, {"disaggregation": DisaggregationConfig(min_uncached_tokens=0)}


def test_a_split_request_runs_its_prefill_leg_then_its_decode_leg() -> None:
    backends, config = _split()

    async def scenario(r: Router) -> None:
        call = r.chat(stream=True)
        prefill = await r.upstreams.next()
        assert prefill.backend == "p"
        assert (await r.backends())["p"]["in_flight"] == 1
        prefill.answer(200, [(b"content-type", b"application/json")])
        params = b'{"remote_block_ids":[1],"remote_host":"p.test","remote_port":5600}'
        prefill.end(b'{"kv_transfer_params":' + params + b',"choices":[]}')
        decode = await r.upstreams.next()
        assert decode.backend in BACKENDS
        assert b'"kv_transfer_params":' + params in decode.request.body
        # Phase 1 is over: its lease is back while the decode leg runs.
        rows = await r.backends()
        assert rows["p"]["in_flight"] == 0 and rows[decode.backend]["in_flight"] == 1
        decode.answer(200, SSE)
        decode.end(*vllm_stream(2, usage=True))
        await call.done()
        assert call.status == 200

    serve(scenario, backends, **config)


@pytest.mark.parametrize("how", ["client_left", "server_cancel", "bug"])
def test_a_request_ended_during_its_prefill_leg_releases_both_leases(how: str) -> None:
    backends, config = _split()

    async def scenario(r: Router) -> None:
        call = r.chat(stream=True)
        prefill = await r.upstreams.next()
        assert prefill.backend == "p"
        rows = await r.backends()
        assert rows["p"]["in_flight"] == 1 and sum(rows[n]["in_flight"] for n in BACKENDS) == 1
        if how == "client_left":
            await call.leave()
            assert call.task.exception() is None
        elif how == "server_cancel":
            call.task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call.task
        else:
            prefill.fail(Bug())
            with pytest.raises(Bug):
                await call.task
        if how != "bug":
            assert prefill.cancelled  # its connection closed: the engine aborts phase 1
        assert r.upstreams.exchanges == [prefill]  # no decode leg, no retry
        # assert_idle (after the scenario): no lease on `p`, nor on the decode engine

    serve(scenario, backends, **config)
