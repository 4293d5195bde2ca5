"""Holding in the admission queue, in process on a manual clock (the real app, scripted
upstreams: tests/request/lifecycle/test_inprocess.py's harness): with `admission:` a request for
a declared model with no backend waits in the queue (its depth, its body's bytes), a stream gets
its head and a comment every `keepalive_s`, the queue's deadline is the hold's, a backend added
to the registry dispatches it at once, and every ending leaves nothing behind. A router whose
only models are declared stays ready (/readyz)."""

from __future__ import annotations

import json
from typing import Any

from router.core.backend import Backend
from router.core.settings import AdmissionConfig, ScaleFromZeroConfig
from tests.request.lifecycle.test_inprocess import CHAT, SSE, Call, Router, backend, serve
from tests.request.lifecycle.test_inprocess import vllm_stream as stream_of
from tests.support.clock import ManualClock, settle, until

SFZ = ScaleFromZeroConfig(models=["cold"], hold_timeout_s=60, keepalive_s=15)
# A max_wait far shorter than the hold: the queue's deadline for a held request is the hold's.
ADMISSION = AdmissionConfig(max_wait=5, recheck=1)


def _cold(r: Router, stream: bool) -> Call:
    body = {"model": "cold", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return r.post(CHAT, json.dumps(body).encode())


async def _held(r: Router, n: int = 1) -> None:
    async def depth() -> float:
        return await r.metric("sluicegate_queue_depth", model="cold")

    for _ in range(200):
        if await depth() == n and r.proxy.holding.held("cold") == n:
            return
        await settle()
    raise AssertionError(f"not {n} held in the queue: depth {await depth()}")


def _scale_up(r: Router) -> None:
    """The pool's first pod, ready: a backend for `cold` joins the registry."""
    cfg = backend("c").model_copy(update={"models": {"cold": "cold"}})
    r.app.parts.registry.patch([Backend.from_config(cfg)], [])  # type: ignore[attr-defined]
    r.names = (*r.names, "c")


def test_a_held_stream_waits_in_the_queue_with_comments_and_is_served_by_the_first_backend() -> (
    None
):
    clock = ManualClock()

    async def scenario(r: Router) -> None:
        call = _cold(r, stream=True)
        await _held(r)
        assert r.app.parts.admission.queued_bytes > 0  # type: ignore[attr-defined]
        clock.advance(15)
        assert await call.head() == 200
        assert call.header("content-type") == "text/event-stream"
        assert await call.chunk() == b": waiting for a backend\n\n"
        clock.advance(5)  # past admission.max_wait: still held, the hold's deadline rules
        await settle()
        assert not call.complete and r.proxy.holding.held("cold") == 1
        _scale_up(r)
        ex = await r.upstreams.next()
        assert ex.backend == "c"
        events = stream_of(2, usage=True)
        ex.answer(200, SSE, events[0])
        ex.end(*events[1:])
        await call.done()
        assert call.body.startswith(b": waiting for a backend\n\n")
        assert b"data: [DONE]" in call.body
        assert r.proxy.holding.held("cold") == 0 and r.proxy.holding.demand("cold") == 0
        assert await r.metric("sluicegate_queue_depth", model="cold") == 0

    serve(scenario, clock=clock, admission=ADMISSION, scale_from_zero=SFZ)


def test_a_hold_in_the_queue_ends_at_its_timeout_with_no_backend() -> None:
    clock = ManualClock()

    async def scenario(r: Router) -> None:
        call = _cold(r, stream=False)
        await _held(r)
        clock.advance(61)
        await until(lambda: call.complete)
        assert call.status == 503
        assert call.json()["error"]["code"] == "no_backend"
        assert call.header("retry-after") is not None
        assert r.proxy.holding.held("cold") == 0

    serve(scenario, clock=clock, admission=ADMISSION, scale_from_zero=SFZ)


def test_a_client_that_leaves_the_queue_while_held_leaves_nothing_behind() -> None:
    clock = ManualClock()

    async def scenario(r: Router) -> None:
        calls: list[Call] = [_cold(r, stream=True), _cold(r, stream=False)]
        await _held(r, 2)
        clock.advance(15)  # the stream's keep-alive is running
        await calls[0].head()
        for call in calls:
            await call.leave()
        assert r.proxy.holding.held("cold") == 0
        assert await r.metric("sluicegate_queue_depth", model="cold") == 0
        parts: Any = r.app.parts  # type: ignore[attr-defined]
        assert parts.admission.queued_bytes == 0 and parts.proxy.bodies.held == 0

    serve(scenario, clock=clock, admission=ADMISSION, scale_from_zero=SFZ)


def test_a_router_with_only_declared_models_stays_ready() -> None:
    """Every pool at zero: the router must stay in its Service, or no request could wake one."""

    async def scenario(r: Router) -> None:
        assert (await r.get("/readyz")).status == 200
        models = (await r.get("/v1/models")).json()["data"]
        assert [m["id"] for m in models] == ["cold"]

    serve(scenario, backends=[], scale_from_zero=SFZ)

    async def empty(r: Router) -> None:
        assert (await r.get("/readyz")).status == 503

    serve(empty, backends=[])
