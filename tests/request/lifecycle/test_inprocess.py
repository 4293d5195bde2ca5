"""The request lifecycle in this process: the real app (`create_app`, its lifespan, the proxy, the
in-flight store, health, metrics) with each upstream exchange answered by a scripted fake.

A failure here is an assertion in this process, not a line in a child process's log. What needs
a real socket (the transport itself, uvicorn's handling of a closed client socket, a backend
killed mid-stream) stays in the real-process tests.

Two pieces stand in for the network:
- `Upstreams` replaces `Pools.request`'s transport (the `Outgoing` it builds is the real one, so
  what the backend would be sent is what is checked). Each `send` becomes an `Exchange` the test
  answers, fails, holds before its head or breaks mid-body; it records whether the proxy gave up
  waiting for the head and whether it closed the answer before its end (the real transport
  resets the connection then, which is how the backend learns the client left).
- `Call` speaks ASGI to the app as uvicorn's httptools protocol does: the body, then
  `http.disconnect` once the client leaves or the response is complete; a message sent after
  the client left is dropped; one sent after the response completed, or a body that does not
  match its Content-Length, is an error (uvicorn raises, and drops the connection).
  `httpx.ASGITransport` cannot stand in: it buffers the whole response and reports the
  disconnect only after it, so neither a stream nor a client leaving mid-stream is visible.

Synchronisation is by events only: the test waits until the proxy is waiting (for a head, for a
body piece) or until the client got something, never for a while. `GUARD` only turns a hang
into a failure.

After every scenario `Router.assert_idle` checks what a leak would leave: an in-flight count
(admin API and metric), the drain's count of requests, a retry-budget slot, a tracked stream, a
task of the request, an answer never closed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, cast

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import Message

from router.app import create_app
from router.core.backend import Backend
from router.core.clock import SYSTEM, Clock
from router.core.settings import (
    AdmissionConfig,
    BackendConfig,
    HealthConfig,
    MigrationConfig,
    OutlierConfig,
    Settings,
)
from router.request.lifecycle.proxy import Proxy
from router.tools.mock.wire import Chunks
from router.upstream.transport import Answer, Outgoing
from router.web.api import FastPath
from tests.support.clock import ManualClock, settle
from tests.support.harness import STARVED_S

GUARD = STARVED_S  # a scenario this long is hung (a starved machine took 10 s for one that was not)
Headers = list[tuple[bytes, bytes]]
SSE: Headers = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]
BACKENDS = ("a", "b")
CHAT = "/v1/chat/completions"
PRIORITY = b"x-sluicegate-priority"


class Exchange:
    """One request to a backend, answered by the test; also the answer's body stream."""

    def __init__(self, backend: str, request: Outgoing) -> None:
        self.backend = backend
        self.request = request
        self._head: asyncio.Future[tuple[int, Headers]] = asyncio.get_running_loop().create_future()
        self._body: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._waiting = asyncio.Event()  # the proxy waits for the body's next piece
        self._failure: BaseException | None = None
        self.answered = False
        self.cancelled = False  # the proxy stopped waiting for the head
        self.finished = False  # the body was read to its end, or to its failure
        self.closed = False
        self.aborted = False  # closed before the end: the real transport resets the connection

    @property
    def sent_headers(self) -> dict[str, str]:
        """The request head's headers as written (lower-case names)."""
        lines = self.request.head.decode("latin-1").split("\r\n")[1:]
        pairs = (line.split(": ", 1) for line in lines if line)
        return {k.lower(): v for k, v in pairs}

    @property
    def state(self) -> str:
        if not self._head.done() and not self.cancelled:
            return "waiting for its head"
        if self.cancelled or not self.answered:
            return "cancelled before its head" if self.cancelled else "failed before its head"
        return "closed" if self.closed else "answered, open"

    def peer(self) -> str | None:
        """The address the answer came from: none here (the backend's URL host stands)."""
        return None

    @property
    def sent_line(self) -> str:
        return self.request.head.split(b"\r\n", 1)[0].decode("latin-1")

    # The backend's side, driven by the test.

    def answer(self, status: int = 200, headers: Headers = SSE, *chunks: bytes) -> None:
        self.answered = True
        self._head.set_result((status, headers))
        self.send(*chunks)

    def fail(self, exc: BaseException) -> None:
        """Fail before the head, as the transport does when a connection fails or closes."""
        self._head.set_exception(exc)

    def send(self, *chunks: bytes) -> None:
        self._waiting.clear()  # set again once the proxy has taken these and waits once more
        for chunk in chunks:
            self._body.put_nowait(chunk)

    def end(self, *chunks: bytes) -> None:
        self.send(*chunks)
        self._body.put_nowait(None)

    def break_off(self, exc: BaseException, *chunks: bytes) -> None:
        """`chunks`, then the connection fails mid-body."""
        self.send(*chunks)
        self._body.put_nowait(exc)

    async def body_awaited(self) -> None:
        """Until the proxy has taken everything sent and waits for more."""
        await self._waiting.wait()

    # The proxy's side: what `Answer.stream` is to it.

    def __aiter__(self) -> Exchange:
        return self

    async def __anext__(self) -> bytes:
        if self._failure is not None:
            raise self._failure
        if self.finished:
            raise StopAsyncIteration
        if self._body.empty():
            self._waiting.set()
        item = await self._body.get()
        self._waiting.clear()
        if item is None:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            self._failure = item
            raise item
        return item

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.aborted = not self.finished


class _FakeTransport:
    """What `Pools.request` hands the proxy for one backend: `send` opens an `Exchange`."""

    def __init__(self, upstreams: Upstreams, backend: str) -> None:
        self._upstreams = upstreams
        self._backend = backend

    async def send(self, request: Outgoing) -> Answer:
        exchange = Exchange(self._backend, request)
        self._upstreams.exchanges.append(exchange)
        self._upstreams.arrived.put_nowait(exchange)
        try:
            status, headers = await exchange._head
        except asyncio.CancelledError:
            exchange.cancelled = True
            raise
        return Answer(status, headers, cast(Any, exchange))


class Upstreams:
    """Every exchange the proxy opened, in order; `next()` is the next one to arrive."""

    def __init__(self) -> None:
        self.exchanges: list[Exchange] = []
        self.arrived: asyncio.Queue[Exchange] = asyncio.Queue()

    def transport(self, backend: Backend) -> _FakeTransport:
        """`create_app`'s transport seam: every request to `backend` becomes an `Exchange`."""
        return _FakeTransport(self, backend.name)

    async def next(self) -> Exchange:
        return await self.arrived.get()

    def none_waiting(self) -> bool:
        return self.arrived.empty()


class Call:
    """One HTTP request to the app, with uvicorn's ASGI semantics (httptools protocol)."""

    def __init__(
        self,
        app: FastPath,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Iterable[tuple[bytes, bytes]] = (),
    ) -> None:
        self._request_body: bytes | None = body
        self._left = asyncio.Event()
        self._complete = asyncio.Event()
        self._messages: asyncio.Queue[Message] = asyncio.Queue()
        self.status: int | None = None
        self.headers: Headers = []
        self.body = b""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"router.test"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("127.0.0.1", 8080),
            "state": {},
        }
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> Message:
        if self._request_body is not None:
            body, self._request_body = self._request_body, None
            return {"type": "http.request", "body": body, "more_body": False}
        left = asyncio.ensure_future(self._left.wait())
        complete = asyncio.ensure_future(self._complete.wait())
        try:
            await asyncio.wait((left, complete), return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            complete.cancel()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if self._left.is_set():
            return  # uvicorn drops what is sent to a client that left
        assert not self._complete.is_set(), f"sent after the response completed: {message}"
        if message["type"] == "http.response.start":
            assert self.status is None, "a second response head"
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        else:
            assert message["type"] == "http.response.body", message
            assert self.status is not None, "a body before the head"
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                length = self.header("content-length")
                if length is not None:
                    assert int(length) == len(self.body), "body length != content-length"
                self._complete.set()
        self._messages.put_nowait(message)

    def header(self, name: str) -> str | None:
        found = [v for k, v in self.headers if k.decode().lower() == name]
        return found[0].decode("latin-1") if found else None

    async def head(self) -> int:
        """The response status, once its head reached the client."""
        message = await self._messages.get()
        assert message["type"] == "http.response.start", message
        assert self.status is not None
        return self.status

    async def chunk(self) -> bytes:
        """The next body piece the client receives."""
        message = await self._messages.get()
        assert message["type"] == "http.response.body", message
        return bytes(message.get("body", b""))

    async def leave(self) -> None:
        """The client closes its connection; returns once the app's call for it has ended."""
        self._left.set()
        await self.task

    async def done(self) -> Call:
        """The app's call ended; the response is complete."""
        await self.task
        assert self._complete.is_set(), "the app returned without completing the response"
        return self

    @property
    def complete(self) -> bool:
        return self._complete.is_set()

    def json(self) -> Any:
        return json.loads(self.body)


class Router:
    """The app of one scenario, its fake upstreams and what it exposes to check for leaks."""

    def __init__(
        self, app: FastPath, proxy: Proxy, upstreams: Upstreams, names: Iterable[str] = BACKENDS
    ) -> None:
        self.app = app
        self.proxy = proxy
        self.upstreams = upstreams
        self.names = tuple(names)  # every backend of the scenario
        self.baseline: set[asyncio.Task[Any]] = set()

    def chat(self, stream: bool = True, **extra: Any) -> Call:
        payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        return self.post(CHAT, json.dumps({**payload, **extra}).encode())

    def post(self, path: str, body: bytes, headers: Headers | None = None) -> Call:
        sent = [(b"content-type", b"application/json"), *(headers or [])]
        return Call(self.app, "POST", path, body, sent)

    async def get(self, path: str) -> Call:
        return await Call(self.app, "GET", path).done()

    async def backends(self) -> dict[str, dict[str, Any]]:
        """/admin/backends, by name."""
        rows = (await self.get("/admin/backends")).json()
        return {row["name"]: row for row in rows}

    async def metric(self, name: str, **labels: str) -> float:
        page = (await self.get("/metrics")).body.decode()
        return sum(
            s.value
            for family in text_string_to_metric_families(page)
            for s in family.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    async def assert_idle(self) -> None:
        """Nothing of any request is left: counts, slots, tracked streams, tasks, answers."""
        rows = await self.backends()
        assert {n: r["in_flight"] for n, r in rows.items()} == dict.fromkeys(self.names, 0)
        assert await self.metric("sluicegate_backend_in_flight") == 0
        assert self.app.lifecycle.active == 0, "a request still counted by the drain"
        assert self.proxy.failover.budget.active == 0, "a retry-budget slot never released"
        assert self.proxy.migration.running == {}, "a stream still tracked for migration"
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() - self.baseline if t is not me and not t.done()]
        assert pending == [], f"tasks left: {pending}"
        for ex in self.upstreams.exchanges:
            assert not ex.answered or ex.closed, f"an answer of {ex.backend} never closed"
        assert self.upstreams.none_waiting(), "an exchange the scenario never looked at"


Scenario = Callable[[Router], Awaitable[None]]


@asynccontextmanager
async def lifespan(app: FastPath) -> AsyncIterator[None]:
    """Startup and shutdown through the ASGI lifespan protocol, as uvicorn's `lifespan: on`."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()

    async def send(message: Message) -> None:
        outbox.put_nowait(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    task = asyncio.ensure_future(app(scope, inbox.get, send))
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        assert (await outbox.get())["type"] == "lifespan.shutdown.complete"
        await task


def serve(
    scenario: Scenario,
    backends: Iterable[BackendConfig] | None = None,
    clock: Clock = SYSTEM,
    **config: Any,
) -> None:
    """Run `scenario` against a fresh app (by default two backends, `a` and `b`, serving model
    `m`), then check that nothing is left, then shut the app down. `clock`: the app's (a
    `ManualClock` moves its chores, health and admission only when the scenario says)."""
    if backends is None:
        backends = [backend(n) for n in BACKENDS]
    backends = list(backends)
    settings = Settings(
        backends=backends,
        health=HealthConfig(enabled=False),
        drain_grace=0,
        **config,
    )

    async def main() -> None:
        upstreams = Upstreams()
        # The startup's collector tuning (gc.freeze) would stay on for every later test here.
        app = create_app(settings, transport=upstreams.transport, clock=clock, tune_gc=False)
        async with lifespan(app):
            r = Router(app, app.parts.proxy, upstreams, (b.name for b in backends))
            r.baseline = set(asyncio.all_tasks())
            guard = asyncio.timeout(GUARD)
            try:
                async with guard:
                    await scenario(r)
                    await r.assert_idle()
            except TimeoutError:
                if not guard.expired():
                    raise
                seen = [(ex.backend, ex.sent_line, ex.state) for ex in upstreams.exchanges]
                raise AssertionError(f"hung for {GUARD} s; exchanges: {seen}") from None

    asyncio.run(main())


def backend(name: str, **extra: Any) -> BackendConfig:
    """Backend `name` serving model `m`; no metrics_path: no engine scrape goes out (health
    probes are off in `serve`)."""
    return BackendConfig(
        name=name, url=f"http://{name}.test:8000", models={"m": "m"}, metrics_path=None, **extra
    )


def vllm_stream(tokens: int, usage: bool) -> list[bytes]:
    """vLLM's events for a chat stream of `tokens` tokens, with the usage event when asked."""
    c = Chunks(chat=True, rid="1", model="m", usage=usage)
    events = [c.first()]
    events += [c.token(f"tok{i} ".encode(), i == tokens - 1) for i in range(tokens)]
    return [*events, c.tail(prompt=9, completion=tokens, cached=0)]


def error_event(body: bytes) -> dict[str, Any]:
    """The router's error event that ends a broken stream (before its `[DONE]`)."""
    assert body.endswith(b"\n\ndata: [DONE]\n\n"), body[-200:]
    last = body[: -len(b"\n\ndata: [DONE]\n\n")].rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: "), last
    return dict(json.loads(last.removeprefix(b"data: ")))


# 1. A streamed chat completion.


def test_a_stream_is_relayed_as_it_comes_and_exactly_as_vllm_sends_it_unasked() -> None:
    upstream = vllm_stream(4, usage=True)  # the router asks for usage
    unasked = b"".join(vllm_stream(4, usage=False))  # what vLLM sends a client that did not

    async def scenario(r: Router) -> None:
        client_body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
        call = r.post(
            CHAT,
            client_body,
            [(b"authorization", b"Bearer client-key"), (b"x-request-id", b"req-1")],
        )
        ex = await r.upstreams.next()
        # What the backend is sent: the client's bytes with include_usage spliced in, nothing
        # else changed; the request id; identity (the usage event is read out of the bytes);
        # never the client's credentials.
        assert ex.sent_line == "POST /v1/chat/completions HTTP/1.1"
        assert ex.request.body == client_body[:-1] + b',"stream_options":{"include_usage":true}}'
        sent = ex.sent_headers
        assert sent["x-request-id"] == "req-1"
        assert sent["accept-encoding"] == "identity"
        assert "authorization" not in sent
        assert sent["host"] == f"{ex.backend}.test:8000"

        ex.answer(200, SSE, upstream[0])
        assert await call.head() == 200
        assert call.header("content-type") == "text/event-stream"
        assert call.header("x-request-id") == "req-1"
        assert call.header("content-length") is None
        # Each event reaches the client before the backend sends the next one.
        assert await call.chunk() == upstream[0]
        ex.send(upstream[1])
        assert await call.chunk() == upstream[1]
        # The rest cut mid-event, the usage event split across pieces.
        rest = b"".join(upstream[2:])
        cut = rest.index(b'"usage":{') + 5
        ex.end(rest[:7], rest[7:cut], rest[cut:])
        await call.done()
        assert call.body == unasked
        assert ex.finished and ex.closed and not ex.aborted
        # The usage the router asked for was counted, though the client never saw it.
        for kind, n in (("prompt", 9), ("completion", 4)):
            assert await r.metric("sluicegate_tokens_total", model="m", kind=kind) == n

    serve(scenario)


def test_a_client_that_asked_for_usage_gets_the_stream_untouched() -> None:
    upstream = vllm_stream(3, usage=True)

    async def scenario(r: Router) -> None:
        call = r.chat(stream_options={"include_usage": True})
        ex = await r.upstreams.next()
        assert json.loads(ex.request.body)["stream_options"] == {"include_usage": True}
        ex.answer(200, SSE)
        ex.end(*upstream)
        await call.done()
        assert call.status == 200 and call.body == b"".join(upstream)

    serve(scenario)


# 2. Retry before the first byte.


@pytest.mark.parametrize(
    "failure",
    [
        httpx.ConnectError("could not connect to the backend: Connection refused"),
        httpx.ReadError("connection to the backend was reset"),
        httpx.RemoteProtocolError("backend closed the connection"),
        httpx.ReadTimeout("backend sent no response headers in time"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_failure_before_the_head_is_retried_on_the_other_backend_and_charged_to_the_first(
    failure: httpx.TransportError,
) -> None:
    upstream = vllm_stream(2, usage=True)
    kind = "timeout" if isinstance(failure, httpx.TimeoutException) else "connect"

    async def scenario(r: Router) -> None:
        call = r.chat(stream=True)
        first = await r.upstreams.next()
        first.fail(failure)
        second = await r.upstreams.next()
        assert second.backend != first.backend
        # The same request, to the other one.
        assert second.request.body == first.request.body
        assert second.sent_headers["x-request-id"] == first.sent_headers["x-request-id"]
        second.answer(200, SSE)
        second.end(*upstream)
        await call.done()
        assert call.status == 200
        assert call.body == b"".join(vllm_stream(2, usage=False))
        rows = await r.backends()
        assert rows[first.backend]["consecutive_failures"] == 1
        assert rows[second.backend]["consecutive_failures"] == 0
        errors = "sluicegate_upstream_errors_total"
        assert await r.metric(errors, backend=first.backend, kind=kind) == 1
        assert await r.metric(errors, backend=second.backend) == 0
        assert await r.metric("sluicegate_retries_total", model="m") == 1

    serve(scenario)


def test_when_every_backend_fails_before_the_head_the_client_gets_a_502() -> None:
    async def scenario(r: Router) -> None:
        call = r.chat(stream=True)
        for _ in BACKENDS:
            (await r.upstreams.next()).fail(httpx.ConnectError("refused"))
        await call.done()
        assert call.status == 502
        assert call.json()["error"]["code"] == "upstream_connect_error"
        assert len(r.upstreams.exchanges) == 2  # one each: a failed backend is not tried again

    serve(scenario)


def test_an_ejection_ends_when_the_apps_clock_says_and_the_backend_gets_traffic_again() -> None:
    """Traffic ejects `a` (one connect failure, `consecutive_failures: 1`) for `base_ejection`
    seconds of the app's clock: the health tick ends it when that clock has moved past them,
    not before, and not on real time."""
    clock = ManualClock()
    outlier = OutlierConfig(consecutive_failures=1, base_ejection=30.0)

    async def served_by(r: Router, fail: str | None = None) -> list[str]:
        """One whole chat; the backends its attempts went to (`fail`'s attempt fails)."""
        call = r.chat(stream=False)
        seen = []
        while True:
            ex = await r.upstreams.next()
            seen.append(ex.backend)
            if ex.backend == fail:
                ex.fail(httpx.ConnectError("refused"))
                continue
            ex.answer(200, [(b"content-type", b"application/json")])
            ex.end(b'{"choices":[]}')
            break
        await call.done()
        assert call.status == 200
        return seen

    async def healthy(r: Router) -> float:
        return await r.metric("sluicegate_backend_healthy", backend="a")

    async def scenario(r: Router) -> None:
        while "a" not in await served_by(r, fail="a"):  # round robin: a within two
            pass
        assert (await r.backends())["a"]["healthy"] is False and await healthy(r) == 0
        for _ in range(3):
            assert await served_by(r) == ["b"]
        clock.advance(29.0)
        await settle()
        assert await healthy(r) == 0 and await served_by(r) == ["b"]
        clock.advance(1.0)  # its 30 s are up: the next tick readmits it
        await settle()
        assert await healthy(r) == 1
        assert (await r.backends())["a"]["reason"] is None
        assert "a" in [*await served_by(r), *await served_by(r)]

    serve(scenario, clock=clock, balancer="round_robin", outlier=outlier)


# 3. The client leaves, at each step.


async def _left_before_the_head(r: Router, call: Call) -> list[Exchange]:
    ex = await r.upstreams.next()  # it arrives as the proxy starts waiting for its head
    await call.leave()
    assert ex.cancelled and not ex.answered
    assert call.status is None
    return [ex]


async def _left_after_the_head(r: Router, call: Call) -> list[Exchange]:
    ex = await r.upstreams.next()
    ex.answer(200, SSE)
    assert await call.head() == 200
    await ex.body_awaited()
    await call.leave()
    assert ex.aborted
    assert call.body == b""
    return [ex]


async def _left_mid_body(r: Router, call: Call) -> list[Exchange]:
    events = vllm_stream(50, usage=True)
    ex = await r.upstreams.next()
    ex.answer(200, SSE, *events[:3])
    assert await call.head() == 200
    for event in events[:3]:
        assert await call.chunk() == event
    await ex.body_awaited()
    await call.leave()
    assert ex.aborted
    assert call.body == b"".join(events[:3])
    return [ex]


async def _left_during_a_retry(r: Router, call: Call) -> list[Exchange]:
    first = await r.upstreams.next()
    first.fail(httpx.ConnectError("refused"))
    second = await r.upstreams.next()
    await call.leave()
    assert second.cancelled and not second.answered
    return [first, second]


async def _left_while_an_error_answer_is_read(r: Router, call: Call) -> list[Exchange]:
    # A 503 is read whole before it is retried or relayed: the client leaves meanwhile.
    ex = await r.upstreams.next()
    ex.answer(503, [(b"content-type", b"application/json")], b'{"error":')
    await ex.body_awaited()
    await call.leave()
    assert ex.aborted
    assert call.status is None
    return [ex]


STEPS: dict[str, Callable[[Router, Call], Awaitable[list[Exchange]]]] = {
    "before_the_head": _left_before_the_head,
    "after_the_head": _left_after_the_head,
    "mid_body": _left_mid_body,
    "during_a_retry": _left_during_a_retry,
    "while_an_error_answer_is_read": _left_while_an_error_answer_is_read,
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("step", list(STEPS))
def test_a_client_that_leaves_stops_the_upstream_and_leaves_nothing_behind(
    step: str, stream: bool
) -> None:
    async def scenario(r: Router) -> None:
        call = r.chat(stream=stream)
        touched = await STEPS[step](r, call)
        # The app's call ended without an error, and nothing went on after the client left:
        # no other backend was tried, nothing more was sent to the client.
        assert call.task.exception() is None
        assert r.upstreams.exchanges == touched
        assert not call.complete
        await r.assert_idle()
        assert await r.metric("sluicegate_client_disconnects_total", model="m") == 1
        assert await r.metric("sluicegate_upstream_errors_total", kind="mid_stream") == 0

    serve(scenario)


# 4. The backend fails mid-body.


@pytest.mark.parametrize(
    ("failure", "code"),
    [
        (httpx.ReadError("connection to the backend was reset"), "upstream_mid_stream"),
        (
            httpx.RemoteProtocolError("backend closed the connection before the response ended"),
            "upstream_mid_stream",
        ),
        (httpx.ReadTimeout("backend sent nothing within the read timeout"), "upstream_timeout"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v,
)
def test_a_stream_that_breaks_mid_body_ends_with_an_error_event_and_releases_everything(
    failure: httpx.TransportError, code: str
) -> None:
    events = vllm_stream(20, usage=True)
    kind = "timeout" if code == "upstream_timeout" else "mid_stream"

    async def scenario(r: Router) -> None:
        call = r.chat(stream=True)
        ex = await r.upstreams.next()
        half = events[3][: len(events[3]) // 2]
        ex.answer(200, SSE)
        ex.break_off(failure, *events[:3], half)
        await call.done()
        assert call.status == 200
        # The events before the break once each, the half event ended so that the error event
        # parses on its own, then [DONE].
        relayed = b"".join(events[:3]) + half + b"\n\n"
        assert call.body.startswith(relayed)
        error = error_event(call.body)
        assert error["error"]["code"] == code
        assert f"`{ex.backend}`" in error["error"]["message"]
        assert "Not migrated" not in error["error"]["message"]  # migration is off here
        assert call.body[len(relayed) :].count(b"\n\n") == 2  # the error event, [DONE]
        assert ex.closed and not ex.aborted  # it failed: nothing left to reset
        assert r.upstreams.exchanges == [ex]  # a stream that began is never replayed
        rows = await r.backends()
        assert rows[ex.backend]["consecutive_failures"] == 1
        errors = "sluicegate_upstream_errors_total"
        assert await r.metric(errors, backend=ex.backend, kind=kind) == 1

    serve(scenario, migration=MigrationConfig(enabled=False))


def test_a_whole_answer_that_breaks_mid_body_is_cut_short_and_releases_everything() -> None:
    # A plain body cannot carry an error event: the app's call raises, and the server then
    # closes the connection, so the client sees a body shorter than its content-length.
    async def scenario(r: Router) -> None:
        call = r.chat(stream=False)
        ex = await r.upstreams.next()
        whole = b'{"id":"chatcmpl-1","choices":[]}'
        ex.answer(200, [(b"content-type", b"application/json"), (b"content-length", b"32")])
        ex.break_off(httpx.ReadError("connection to the backend was reset"), whole[:10])
        with pytest.raises(httpx.ReadError):
            await call.task
        assert call.status == 200 and call.header("content-length") == "32"
        assert call.body == whole[:10] and not call.complete
        assert ex.closed
        assert r.upstreams.exchanges == [ex]
        assert (await r.backends())[ex.backend]["consecutive_failures"] == 1

    serve(scenario, migration=MigrationConfig(enabled=False))


# 5. Answers that are not 2xx.


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_4xx_is_relayed_at_once_with_its_status_and_body(stream: bool) -> None:
    body = b'{"error":{"message":"max_tokens is too large","type":"BadRequestError","code":400}}'
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]

    async def scenario(r: Router) -> None:
        call = r.chat(stream=stream, max_tokens=10**6)
        ex = await r.upstreams.next()
        ex.answer(400, headers)
        ex.end(body)
        await call.done()
        assert call.status == 400
        assert call.body == body
        assert call.header("content-type") == "application/json"
        assert r.upstreams.exchanges == [ex]  # the client's own error: not tried elsewhere
        assert (await r.backends())[ex.backend]["consecutive_failures"] == 0

    serve(scenario)


def test_a_5xx_from_every_backend_relays_the_last_answer_with_its_status() -> None:
    async def scenario(r: Router) -> None:
        call = r.chat(stream=True)
        answers = []
        for n in range(2):
            ex = await r.upstreams.next()
            body = b'{"error":"overloaded %d"}' % n
            ex.answer(503, [(b"content-type", b"application/json"), (b"x-engine", b"%d" % n)])
            ex.end(body)
            answers.append((ex, body))
        await call.done()
        (first, _), (last, last_body) = answers
        assert first.backend != last.backend
        assert call.status == 503
        assert call.body == last_body
        assert call.header("x-engine") == "1"
        rows = await r.backends()
        assert rows[first.backend]["consecutive_failures"] == 1
        assert rows[last.backend]["consecutive_failures"] == 1
        assert await r.metric("sluicegate_upstream_errors_total", kind="status") == 2

    serve(scenario)


# The server cancels the app's call (its shutdown once the drain grace is over).


@pytest.mark.parametrize("step", ["before_the_head", "mid_body"])
def test_a_call_cancelled_by_the_server_unwinds_and_leaves_nothing_behind(step: str) -> None:
    async def scenario(r: Router) -> None:
        call = r.chat(stream=True)
        ex = await r.upstreams.next()
        if step == "mid_body":
            events = vllm_stream(10, usage=True)
            ex.answer(200, SSE, events[0])
            assert await call.head() == 200
            assert await call.chunk() == events[0]
            await ex.body_awaited()
        call.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.task
        assert ex.cancelled if step == "before_the_head" else ex.aborted
        assert r.upstreams.exchanges == [ex]

    serve(scenario)


# A stream that breaks mid-body, migration on (the default): it goes on on the other backend.


def _continuation_events(first: int, last: int) -> list[bytes]:
    """The continuation engine's own stream (its own id, a role event, usage asked for)."""
    c = Chunks(chat=True, rid="2", model="m", usage=True)
    events = [c.first()] + [c.token(f"tok{i} ".encode(), i == last) for i in range(first, last + 1)]
    return [*events, c.tail(prompt=12, completion=last + 1 - first, cached=0)]


async def _broken_after_three_tokens(r: Router) -> tuple[Call, Exchange]:
    """A 10-token chat stream whose engine resets the connection after its first 3 tokens."""
    call = r.chat(stream=True, max_tokens=10)
    ex = await r.upstreams.next()
    ex.answer(200, SSE)
    events = vllm_stream(10, usage=True)
    ex.break_off(httpx.ReadError("connection to the backend was reset"), *events[:4])
    return call, ex


def test_a_broken_stream_goes_on_on_the_other_backend_as_one_stream() -> None:
    async def scenario(r: Router) -> None:
        call, ex = await _broken_after_three_tokens(r)
        # The other engine counts the text relayed so far, then continues it.
        count = await r.upstreams.next()
        assert count.backend != ex.backend
        assert count.sent_line == "POST /tokenize HTTP/1.1"
        assert json.loads(count.request.body)["prompt"] == "tok0 tok1 tok2 "
        count.answer(200, [(b"content-type", b"application/json")])
        count.end(b'{"count":3,"max_model_len":4096,"tokens":[1,2,3]}')
        more = await r.upstreams.next()
        assert more.backend == count.backend
        sent = json.loads(more.request.body)
        assert sent["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 tok2 "}
        assert sent["max_tokens"] == 7  # the budget left
        more.answer(200, SSE)
        more.end(*_continuation_events(3, 9))
        await call.done()
        # One stream, byte for byte the one an engine that never broke sends: every token
        # once, the first stream's id, one role event, no error event, the usage event asked
        # for taken out and its fingerprint back on the last token's event.
        assert call.status == 200
        assert call.body == b"".join(vllm_stream(10, usage=False))
        assert ex.closed and count.closed and more.closed and more.finished
        assert await r.metric("sluicegate_migrations_total", model="m", result="ok") == 1
        errors = "sluicegate_upstream_errors_total"
        assert await r.metric(errors, backend=ex.backend, kind="mid_stream") == 1
        assert await r.metric(errors, backend=more.backend) == 0
        # Tokens counted once: the continuation's prompt held the 3 relayed before it.
        for kind, n in (("prompt", 9), ("completion", 10)):
            assert await r.metric("sluicegate_tokens_total", model="m", kind=kind) == n

    serve(scenario)


@pytest.mark.parametrize("step", ["token_count", "continuation_head"])
def test_a_client_that_leaves_during_a_migration_leaves_nothing_behind(step: str) -> None:
    async def scenario(r: Router) -> None:
        call, ex = await _broken_after_three_tokens(r)
        waiting = await r.upstreams.next()
        if step == "continuation_head":
            waiting.answer(200, [(b"content-type", b"application/json")])
            waiting.end(b'{"count":3}')
            waiting = await r.upstreams.next()
            assert waiting.sent_line == "POST /v1/chat/completions HTTP/1.1"
        await call.leave()
        assert waiting.cancelled
        assert ex.closed
        assert not call.complete
        assert r.upstreams.exchanges[-1] is waiting  # nothing tried after the client left

    serve(scenario)


# An exception that is no upstream failure (a bug on the way): every cleanup still runs.


@pytest.mark.parametrize("step", ["before_the_head", "mid_body"])
def test_an_unexpected_exception_still_releases_everything(step: str) -> None:
    class Bug(Exception):
        pass

    async def scenario(r: Router) -> None:
        call = r.chat(stream=True)
        ex = await r.upstreams.next()
        if step == "before_the_head":
            ex.fail(Bug())
        else:
            events = vllm_stream(10, usage=True)
            ex.answer(200, SSE)
            ex.break_off(Bug(), *events[:2])
        # It reaches the server (uvicorn answers 500 before a head, else closes the connection).
        with pytest.raises(Bug):
            await call.task
        assert not call.complete
        assert r.upstreams.exchanges == [ex]  # a bug is not a backend's failure: no retry

    serve(scenario)


def test_an_error_answer_cut_short_is_relayed_with_a_length_that_matches() -> None:
    async def scenario(r: Router) -> None:
        call = r.chat(stream=False)
        for _ in BACKENDS:
            ex = await r.upstreams.next()
            ex.answer(503, [(b"content-type", b"application/json"), (b"content-length", b"40")])
            ex.break_off(httpx.ReadError("connection to the backend was reset"), b'{"error":')
        await call.done()  # Call checks the length as uvicorn does
        assert call.status == 503 and call.body == b'{"error":'

    serve(scenario)


# 6. A full admission queue.


def test_a_full_queue_sheds_the_lowest_band_first() -> None:
    """One slot, held; `max_queue: 2`. A sheddable request waiting gives its place to a
    standard newcomer, and a sheddable newcomer to a queue of standard ones is refused itself:
    both at once, 503 `queue_full` with a Retry-After, never sent to a backend. The standard
    ones wait for their turn until `max_wait` of the app's clock has passed, not before (on real
    time a loaded machine let the sheddable one expire before the newcomer came)."""
    clock = ManualClock()
    max_wait = 1.5

    def post(r: Router, rid: str, band: str = "standard") -> Call:
        body = b'{"model":"m","messages":[]}'
        return r.post(CHAT, body, [(b"x-request-id", rid.encode()), (PRIORITY, band.encode())])

    async def depth(r: Router) -> float:
        return await r.metric("sluicegate_queue_depth")

    async def queued(r: Router, n: int) -> None:
        async with asyncio.timeout(GUARD):
            while await depth(r) != n:  # noqa: ASYNC110 (the app's tasks move it)
                await asyncio.sleep(0)

    def refused_full(call: Call) -> None:
        assert call.status == 503, call.body
        assert call.json()["error"]["code"] == "queue_full"
        assert float(call.header("retry-after") or 0) >= 1

    async def scenario(r: Router) -> None:
        blocker = post(r, "full-blocker")
        held = await r.upstreams.next()  # the only slot, held until the end
        shed = post(r, "full-shed", "sheddable")
        await queued(r, 1)
        first = post(r, "full-std-1")
        await queued(r, 2)
        second = post(r, "full-std-2")  # takes the sheddable one's place
        refused_full(await shed.done())
        await queued(r, 2)
        assert not second.complete
        refused_full(await post(r, "full-shed-late", "sheddable").done())  # the lowest: itself
        assert await r.metric("sluicegate_shed_total", reason="queue_full") == 2
        clock.advance(max_wait - 0.1)
        await settle()
        assert not first.complete and not second.complete and await depth(r) == 2
        clock.advance(0.2)  # past max_wait: both leave the queue, 503 queue_timeout
        for waited in (await first.done(), await second.done()):
            assert waited.status == 503
            assert waited.json()["error"]["code"] == "queue_timeout"
        assert await depth(r) == 0
        held.answer(200, [(b"content-type", b"application/json")])
        held.end(b'{"choices":[]}')
        assert (await blocker.done()).status == 200
        assert [ex.sent_headers["x-request-id"] for ex in r.upstreams.exchanges] == ["full-blocker"]

    serve(
        scenario,
        [backend("a", max_inflight=1)],
        clock=clock,
        admission=AdmissionConfig(max_wait=max_wait, max_queue=2),
    )
