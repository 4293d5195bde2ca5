"""Scale from zero end to end, on real processes: a router whose Kubernetes discovery source
declares `sfz-model` (the fake API server publishes its EndpointSlice only when a test says so)
holds requests for it, streamed and not, until a ready endpoint appears, refuses them cleanly at
their timeout or past `max_held`, and serves another model meanwhile; a KEDA client built from the
vendored .proto sees the router's external scaler go active with the first held request and
inactive once they are served. The scaler alone, in process: tests/scaling/."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest

from router.scaling.keda import externalscaler_pb2 as pb
from router.scaling.keda.externalscaler_pb2_grpc import ExternalScalerStub
from tests.support.fake_kube import FakeKube, kube_source, put_mock
from tests.support.harness import STARVED_S, Cluster, Proc, free_port
from tests.support.wait import wait_for

MODEL = "sfz-model"
OTHER = "mock-model"
KEEPALIVE = 0.2  # seconds between a held stream's comments: several during a test's hold
MAX_HELD = 4
SCALER_PORT = free_port()


@pytest.fixture(scope="module")
def pod(module_procs: Cluster) -> Proc:
    """The model's one pod, reached only once its EndpointSlice is published."""
    return module_procs.mock("pod", host="127.0.0.2", tokens=4)


@pytest.fixture(scope="module")
def router(module_procs: Cluster, kube: FakeKube, pod: Proc) -> Proc:
    other = module_procs.mock("other", tokens=4)
    source = kube_source(kube, module_procs.tmp / "kubeconfig", models=[MODEL])
    return module_procs.router(
        {
            "backends": [{"name": "other", "url": other.url, "models": [OTHER]}],
            "discovery": [source],
            "scale_from_zero": {
                "hold_timeout_s": 20,
                "max_held": MAX_HELD,
                "keepalive_s": KEEPALIVE,
                "scaler_port": SCALER_PORT,
            },
        }
    )


@pytest.fixture(autouse=True)
def _no_pods(kube: FakeKube, router: Proc) -> Iterator[None]:
    yield
    for ns, name in list(kube.slices):
        kube.delete_slice(name, ns)
    wait_for(lambda: held(router) == 0, what="nothing held after the test")


def metric(router: Proc, name: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    line = f'{name}{{model="{MODEL}"}} '
    for row in text.splitlines():
        if row.startswith(line):
            return float(row[len(line) :])
    return 0.0


def held(router: Proc) -> float:
    return metric(router, "sluicegate_model_held_requests")


def client(router: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def test_declared_model_is_listed_and_an_unknown_one_404s_at_once(router: Proc) -> None:
    ids = [m.id for m in client(router).models.list().data]
    assert MODEL in ids and OTHER in ids
    started = time.monotonic()
    with pytest.raises(openai.NotFoundError) as err:
        client(router).chat.completions.create(
            model="never-declared", messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.status_code == 404
    assert time.monotonic() - started < 2  # not held


def _chat(router: Proc, stream: bool) -> str:
    c = client(router)
    if stream:
        out = c.chat.completions.create(
            model=MODEL, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        return "".join(ch.choices[0].delta.content or "" for ch in out if ch.choices)
    resp = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    return resp.choices[0].message.content or ""


def _messages(router: Proc) -> str:
    c = anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    text = ""
    with c.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as s:
        for piece in s.text_stream:
            text += piece
    return text


def _raw_stream(router: Proc, out: list[bytes]) -> None:
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            out.append(chunk)


class KedaStream:
    """KEDA's side of `StreamIsActive` for one ScaledObject, read on a thread of its own."""

    def __init__(self, model: str) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{SCALER_PORT}")
        self.stub = ExternalScalerStub(self.channel)
        self.ref = pb.ScaledObjectRef(
            name="pool", namespace="models", scalerMetadata={"model": model}
        )
        self.seen: list[bool] = []
        self.call = self.stub.StreamIsActive(self.ref)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for answer in self.call:
                self.seen.append(answer.result)
        except grpc.RpcError:
            pass  # cancelled by `close`

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(5)
        self.channel.close()


def test_held_requests_complete_once_the_endpointslice_is_ready(
    router: Proc, kube: FakeKube, pod: Proc
) -> None:
    keda = KedaStream(MODEL)
    try:
        wait_for(lambda: keda.seen == [False], what="the stream's first answer: idle")
        _hold_and_serve(router, kube, pod, keda)
        wait_for(lambda: keda.seen == [False, True, False], what="active, then idle again")
        assert not keda.stub.IsActive(keda.ref).result
    finally:
        keda.close()


def _hold_and_serve(router: Proc, kube: FakeKube, pod: Proc, keda: KedaStream) -> None:
    raw: list[bytes] = []
    with ThreadPoolExecutor(4) as pool:
        whole = pool.submit(_chat, router, False)
        streamed = pool.submit(_chat, router, True)
        messages = pool.submit(_messages, router)
        comments = pool.submit(_raw_stream, router, raw)
        wait_for(lambda: held(router) == 4, what="four requests held")
        assert keda.seen == [False, True]  # pushed on the first held request
        assert keda.stub.IsActive(keda.ref).result
        metrics = keda.stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=keda.ref))
        assert metrics.metricValues[0].metricValue == 4
        spec = keda.stub.GetMetricSpec(keda.ref).metricSpecs[0]
        assert spec.targetSize == 16 and spec.metricName == metrics.metricValues[0].metricName
        # Comments flow while they wait; the SDKs' streams stay open through them.
        wait_for(lambda: b"".join(raw).count(b": waiting for a backend") >= 2, what="comments")
        assert not whole.done() and not streamed.done() and not messages.done()
        published = time.monotonic()
        put_mock(kube, pod, "sfz-pod")
        assert whole.result(timeout=10) and streamed.result(timeout=10)
        assert messages.result(timeout=10)
        comments.result(timeout=10)
        took = time.monotonic() - published
    assert b"data: [DONE]" in b"".join(raw)
    # The watch event, then the dispatch: well within the hold (20 s), and far from the source's
    # re-list (300 s), the only other way the slice could arrive. (5 s failed on a starved
    # machine: 5.7 s.)
    assert took < 20, took
    assert held(router) == 0


def test_an_unknown_model_in_scaler_metadata_reads_inactive(router: Proc) -> None:
    keda = KedaStream("not-declared")
    try:
        wait_for(lambda: keda.seen == [False], what="an answer, not an error")
        assert not keda.stub.IsActive(keda.ref).result
        got = keda.stub.GetMetrics(pb.GetMetricsRequest(scaledObjectRef=keda.ref))
        assert got.metricValues[0].metricValue == 0
    finally:
        keda.close()
    wait_for(lambda: "not declared in scale_from_zero" in router.log(), what="the error logged")
    # The scaler still serves the declared model after it.
    with grpc.insecure_channel(f"127.0.0.1:{SCALER_PORT}") as channel:
        ref = pb.ScaledObjectRef(scalerMetadata={"model": MODEL})
        assert ExternalScalerStub(channel).IsActive(ref).result is False


def test_timeout_answers_503_no_backend_with_retry_after(router: Proc) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    headers = {"x-sluicegate-timeout": "0.3"}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_backend"
    assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json=body,
        headers={"x-sluicegate-timeout": "soon"},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_timeout"


def test_max_held_refuses_at_once_other_models_flow_and_cancel_leaks_nothing(
    router: Proc,
) -> None:
    stop = threading.Event()
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}

    def hold_then_leave() -> None:
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=30) as r:
            for _ in r.iter_raw():  # comments until the test lets go
                if stop.is_set():
                    return  # leaving closes the connection: the router stops waiting

    with ThreadPoolExecutor(MAX_HELD) as pool:
        futures: list[Future[Any]] = [pool.submit(hold_then_leave) for _ in range(MAX_HELD)]
        wait_for(lambda: held(router) == MAX_HELD, what="max_held held")
        started = time.monotonic()
        r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_held"
        assert "retry-after" in r.headers
        assert time.monotonic() - started < 2  # at once, not after a wait
        other = client(router).chat.completions.create(
            model=OTHER, messages=[{"role": "user", "content": "x"}]
        )
        assert other.choices[0].message.content
        stop.set()
        for f in futures:
            f.result(timeout=10)
    wait_for(lambda: held(router) == 0, what="the held count back to 0 after cancels")
    assert metric(router, "sluicegate_model_demand") == 0
    body_held = httpx.get(router.url + "/metrics", timeout=STARVED_S).text
    assert "sluicegate_body_bytes_held 0.0" in body_held
