"""Traces of real requests through a real router process, received by a real OTLP/HTTP receiver
(`tests/support/otlp_receiver.py`), and the TTFT/TPOT histograms the same requests feed.

One router serves the module: backend `a` (prefill 120 ms, 20 ms between tokens, vLLM's role-only
first event sent early), `bad` (answers 503) sharing model `r` with `a` by round robin, and `long`
for the disconnect. Client keys, backend keys and the admin token are set, so the last test can
look for them in everything exported.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.utils import floatToGoString

from router.core.settings import TracingConfig
from router.ops.metrics import TPOT_BUCKETS, TTFT_BUCKETS
from router.ops.tracing import resolve
from tests.ops.test_metrics import scrape, value
from tests.support.harness import Cluster, Proc, backend, control, stats
from tests.support.otlp_receiver import Receiver, Span
from tests.support.wait import wait_for

SERVER, CLIENT = 2, 3  # OTLP SpanKind
CLIENT_KEY = "sk-client-tracing-secret-0001"
SECRETS = {
    "client key": CLIENT_KEY,
    "backend key a": "sk-backend-a-secret-0002",
    "backend key bad": "sk-backend-bad-secret-0003",
    "backend key long": "sk-backend-long-secret-0004",
    "admin token": "admin-token-secret-0005",
}
TTFT_MS, ITL_MS, TOKENS = 120, 20, 6
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
EXPORT_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster, receiver: Receiver) -> dict[str, Proc]:
    a = module_procs.mock("a", ttft_ms=TTFT_MS, itl_ms=ITL_MS, tokens=TOKENS)
    control(a, role_chunk=True)
    bad = module_procs.mock("bad")
    control(bad, fail_status=503)
    long = module_procs.mock("long", itl_ms=20, tokens=500)
    router = module_procs.router(
        {
            "backends": [
                backend(
                    "a", a, {"m": "mock-model", "r": "mock-model"}, api_key=SECRETS["backend key a"]
                ),
                backend("bad", bad, {"r": "mock-model"}, api_key=SECRETS["backend key bad"]),
                backend("long", long, {"long": "mock-model"}, api_key=SECRETS["backend key long"]),
            ],
            "model_balancers": {"r": "round_robin"},
            "outlier": {"consecutive_failures": 100},
            "api_keys": [
                {"sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest(), "name": "team-a"}
            ],
            "tracing": {"otlp_endpoint": receiver.url},
        },
        env={**FAST_EXPORT, "SLUICEGATE_ADMIN_TOKEN": SECRETS["admin token"]},
    )
    return {"a": a, "bad": bad, "long": long, "router": router}


def client(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key=CLIENT_KEY, max_retries=0)


def trace_of(spans: list[Span], trace_id: str) -> tuple[Span, list[Span]]:
    mine = [s for s in spans if s.trace_id == trace_id]
    server = next(s for s in mine if s.kind == SERVER)
    return server, sorted((s for s in mine if s.kind == CLIENT), key=lambda s: s.start_ns)


def has_server_span(trace_id: str) -> Any:
    return lambda spans: any(s.trace_id == trace_id and s.kind == SERVER for s in spans)


def upstream_traceparent(mock: Proc, request_id: str) -> list[str]:
    recent = stats(mock)["recent"]
    return next(
        r["headers"]["traceparent"].split("-") for r in recent if r["request_id"] == request_id
    )


def test_streamed_request_continues_the_client_trace_and_reaches_the_backend(
    fleet: dict[str, Proc], receiver: Receiver
) -> None:
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    stream = client(fleet["router"]).chat.completions.create(
        model="m",
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "x-request-id": "trace-1"},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.startswith("tok0 ")

    server, attempts = trace_of(receiver.wait_for(has_server_span(trace_id)), trace_id)
    assert server.parent_span_id == parent_id  # the client's trace, continued
    assert server.service == "sluicegate"
    attrs = server.attributes
    assert attrs["gen_ai.request.model"] == "m"
    assert attrs["gen_ai.response.model"] == "mock-model"
    assert attrs["gen_ai.usage.input_tokens"] == 1
    assert attrs["gen_ai.usage.output_tokens"] == TOKENS
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["sluicegate.key_name"] == "team-a"
    assert attrs["http.response.status_code"] == 200
    assert attrs["sluicegate.backend"] == "a"
    names = [e[0] for e in server.events]
    assert names[:2] == ["queued", "picked"]
    assert server.event("picked")[2]["sluicegate.backend"] == "a"  # type: ignore[index]
    first_byte, first_token = server.event("first byte"), server.event("first token")
    assert first_byte is not None and first_token is not None
    # The role-only event came at once; the first content only after the engine's prefill.
    assert (first_token[1] - first_byte[1]) / 1e6 >= TTFT_MS * 0.8
    assert server.start_ns <= first_byte[1] <= first_token[1] <= server.end_ns

    assert len(attempts) == 1
    (attempt,) = attempts
    assert attempt.parent_span_id == server.span_id
    assert attempt.attributes["sluicegate.backend"] == "a"
    assert attempt.attributes["http.response.status_code"] == 200
    assert attempt.attributes["sluicegate.retried"] is False
    assert "sluicegate.failure_kind" not in attempt.attributes

    # The engine got the attempt's own traceparent: vLLM's spans join this trace under it.
    version, upstream_trace, upstream_parent, flags = upstream_traceparent(fleet["a"], "trace-1")
    assert (version, upstream_trace, upstream_parent, flags) == (
        "00",
        trace_id,
        attempt.span_id,
        "01",
    )


def test_unsampled_client_trace_is_followed_and_not_recorded(
    fleet: dict[str, Proc], receiver: Receiver
) -> None:
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    r = client(fleet["router"]).chat.completions.with_raw_response.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-00", "x-request-id": "unsampled"},
    )
    assert r.http_response.status_code == 200
    _, upstream_trace, upstream_parent, flags = upstream_traceparent(fleet["a"], "unsampled")
    assert (upstream_trace, flags) == (trace_id, "00")  # the engine won't record it either
    assert upstream_parent != parent_id
    # A request sent after it is exported; the unsampled one never is.
    marker = os.urandom(16).hex()
    client(fleet["router"]).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"traceparent": f"00-{marker}-{parent_id}-01"},
    )
    spans = receiver.wait_for(has_server_span(marker))
    assert not [s for s in spans if s.trace_id == trace_id]


def test_retried_attempt_is_a_failed_child_span_marked_retried(
    fleet: dict[str, Proc], receiver: Receiver
) -> None:
    c = client(fleet["router"])
    for i in range(4):  # round robin over (a, bad): one of two requests meets `bad` first
        rid = f"retry-{i}"
        raw = c.chat.completions.with_raw_response.create(
            model="r",
            messages=[{"role": "user", "content": "hi"}],
            extra_headers={"x-request-id": rid},
        )
        assert raw.http_response.status_code == 200
        trace_id = upstream_traceparent(fleet["a"], rid)[1]  # no client traceparent: a new trace
        server, attempts = trace_of(receiver.wait_for(has_server_span(trace_id)), trace_id)
        if len(attempts) == 2:
            break
    else:
        pytest.fail("no request was retried")
    failed, served = attempts
    assert all(s.parent_span_id == server.span_id for s in attempts)
    assert failed.attributes["sluicegate.backend"] == "bad"
    assert failed.attributes["sluicegate.failure_kind"] == "status"
    assert failed.attributes["http.response.status_code"] == 503
    assert failed.attributes["sluicegate.retried"] is True
    assert failed.status_code == 2  # STATUS_CODE_ERROR
    assert served.attributes["sluicegate.backend"] == "a"
    assert served.attributes["sluicegate.retried"] is False
    assert server.attributes["sluicegate.attempts"] == 2
    assert server.attributes["gen_ai.usage.output_tokens"] == TOKENS  # from the body's usage
    assert [e[0] for e in server.events].count("picked") == 2


def test_client_disconnect_is_an_event(fleet: dict[str, Proc], receiver: Receiver) -> None:
    headers = {"authorization": f"Bearer {CLIENT_KEY}", "x-request-id": "leaver"}
    body = {"model": "long", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream(
        "POST", fleet["router"].url + "/v1/chat/completions", json=body, headers=headers
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    trace_id = upstream_traceparent(fleet["long"], "leaver")[1]
    spans = receiver.wait_for(has_server_span(trace_id))
    server, _ = trace_of(spans, trace_id)
    assert server.event("client disconnected") is not None
    assert server.event("first token") is not None


def test_ttft_and_tpot_histograms_match_the_engine(fleet: dict[str, Proc]) -> None:
    """The router's figures sit between what the engine's settings make impossible and what
    the client itself measured around them (the router's intervals lie inside the client's),
    so a loaded machine moves them within those bounds, not out of them."""
    router = fleet["router"]
    before = scrape(router)
    n = 3
    ttfts: list[float] = []
    totals: list[float] = []
    for _ in range(n):
        sent = time.monotonic()
        stream = client(router).chat.completions.create(
            model="m", stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        content = 0
        for c in stream:
            if c.choices and c.choices[0].delta.content:
                content += 1
                if content == 1:
                    ttfts.append(time.monotonic() - sent)
        totals.append(time.monotonic() - sent)
        assert content == TOKENS
    after = scrape(router)

    def delta(name: str, le: float) -> float:
        labels = {"model": "m", "backend": "a", "le": floatToGoString(le)}
        return value(after, name, **labels) - value(before, name, **labels)

    def covering(buckets: tuple[float, ...], seconds: float) -> float:
        return next(b for b in buckets if b >= seconds)

    # Time to first content token: never under the engine's prefill (TTFT_MS), never over what
    # the client saw.
    below = max(b for b in TTFT_BUCKETS if b < TTFT_MS / 1000)
    assert delta("sluicegate_ttft_seconds_bucket", below) == 0
    assert delta("sluicegate_ttft_seconds_bucket", covering(TTFT_BUCKETS, max(ttfts))) == n

    # The first byte (the role-only event) comes before the prefill: on average by more than
    # half of it, however late both were read.
    def total(name: str) -> float:
        labels = {"model": "m", "backend": "a"}
        return value(after, name, **labels) - value(before, name, **labels)

    gap = total("sluicegate_ttft_seconds_sum") - total("sluicegate_time_to_first_token_seconds_sum")
    assert gap / n > TTFT_MS / 1000 / 2
    # Time per output token: ITL_MS between tokens (a stall can only shorten the router's
    # interval by the first token's lateness, far less than a bucket), and never more than
    # the client's whole stream spread over the same intervals.
    below = max(b for b in TPOT_BUCKETS if b < ITL_MS / 1000 * 0.75)
    assert delta("sluicegate_tpot_seconds_bucket", below) == 0
    spread = max(totals) / (TOKENS - 1)
    assert delta("sluicegate_tpot_seconds_bucket", covering(TPOT_BUCKETS, spread)) == n
    ok = {"model": "m", "backend": "a", "status_class": "2xx"}
    dur = "sluicegate_request_duration_seconds_count"
    assert value(after, dur, **ok) - value(before, dur, **ok) == n


def test_no_secret_in_any_span(fleet: dict[str, Proc], receiver: Receiver) -> None:
    spans = receiver.wait_for(lambda s: len(s) >= 4)
    for span in spans:
        text = repr((span.name, span.attributes, span.events))
        for what, secret in SECRETS.items():
            assert secret not in text, f"{what} in span {span.name}"


def _stream_ok(router: Proc) -> float:
    started = time.monotonic()
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]},
        timeout=10,
    )
    assert r.status_code == 200
    assert r.text.endswith("data: [DONE]\n\n")
    return time.monotonic() - started


def test_collector_down_or_hanging_never_touches_requests(procs: Cluster) -> None:
    up = procs.mock("up", tokens=4)
    hung = Receiver(mode="hang").start()  # takes each export and never answers
    try:
        router = procs.router(
            {"backends": [backend("up", up)], "tracing": {"otlp_endpoint": hung.url}},
            env={
                **FAST_EXPORT,
                "OTEL_BSP_MAX_QUEUE_SIZE": "4",
                "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2",
                "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": str(EXPORT_TIMEOUT_S),
            },
        )
        times = [_stream_ok(router) for _ in range(10)]
        assert max(times) < EXPORT_TIMEOUT_S / 10, times  # never waits on the hung export
        assert hung.exports >= 1  # an export really is stuck on it
        # The queue is bounded: spans beyond it are dropped, not held (the SDK says so as the
        # last requests' spans end, and the line goes out through the log queue).
        wait_for(lambda: "Queue full" in router.log(), "spans beyond the queue dropped", 10)
    finally:
        hung.close()
    # Down: nothing listens on the collector's port any more (connection refused).
    times = [_stream_ok(router) for _ in range(10)]
    assert max(times) < EXPORT_TIMEOUT_S / 10, times  # never waits on the hung export
    # A stopping router waits for the exporter only briefly: well under the exporter's own 30 s
    # timeout (half of it leaves a loaded machine room to start and drain the process).
    started = time.monotonic()
    router.signal(signal.SIGTERM)
    router.popen.wait(EXPORT_TIMEOUT_S)
    assert time.monotonic() - started < EXPORT_TIMEOUT_S / 2


def test_settings_then_standard_variables() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_SERVICE_NAME": "edge",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    assert resolve(TracingConfig(), {}) is None  # off unless configured
    plan = resolve(TracingConfig(), env)
    assert plan is not None
    assert (plan.endpoint, plan.service_name, plan.sample_ratio) == (
        "http://collector:4318/v1/traces",
        "edge",
        0.25,
    )
    cfg = TracingConfig(
        otlp_endpoint="http://c:4318/v1/traces", sample_ratio=0.5, service_name="sg"
    )
    plan = resolve(cfg, env)
    assert plan is not None
    assert (plan.endpoint, plan.service_name, plan.sample_ratio) == (
        "http://c:4318/v1/traces",
        "sg",
        0.5,
    )
    plan = resolve(TracingConfig(otlp_endpoint="http://c:4318"), {})
    assert plan is not None and (plan.service_name, plan.sample_ratio) == ("sluicegate", 1.0)
    assert resolve(TracingConfig(), {**env, "OTEL_SDK_DISABLED": "true"}) is None


def test_oversized_trace_headers_are_dropped_and_counted_not_logged_per_request(
    fleet: dict[str, Proc], receiver: Receiver
) -> None:
    """Issue 22, defect 12: a tracestate over 8 KB made one warning line per request."""
    router = fleet["router"]
    trace_id = os.urandom(16).hex()
    big_state = "k=" + "v" * 9000
    headers = {"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01", "tracestate": big_state}
    before = value(scrape(router), "sluicegate_tracing_headers_dropped_total", header="tracestate")
    lines_before = router.log().count("tracestate")
    for i in range(20):
        r = httpx.post(
            router.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={**headers, "authorization": f"Bearer {CLIENT_KEY}", "x-request-id": f"ts{i}"},
            timeout=30,
        )
        assert r.status_code == 200
    after = value(scrape(router), "sluicegate_tracing_headers_dropped_total", header="tracestate")
    assert after - before == 20
    assert router.log().count("tracestate") - lines_before <= 1  # once per process at most
    # The trace itself is continued (only the oversized tracestate went), and not forwarded.
    receiver.wait_for(has_server_span(trace_id))
    upstream = next(r for r in stats(fleet["a"])["recent"] if r["request_id"] == "ts0")
    assert upstream["headers"]["traceparent"].split("-")[1] == trace_id
    assert "tracestate" not in upstream["headers"]
    # A traceparent over 512 characters: dropped too; the request is served in a new trace.
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        headers={"traceparent": "00-" + "a" * 600, "authorization": f"Bearer {CLIENT_KEY}"},
        timeout=30,
    )
    assert r.status_code == 200
    samples = scrape(router)
    assert value(samples, "sluicegate_tracing_headers_dropped_total", header="traceparent") >= 1
