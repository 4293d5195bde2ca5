"""Scale from zero with a real vLLM engine: the model's pool starts at zero (the engine stopped,
no EndpointSlice), a request for the declared model is held, and this test's scaler loop (what
KEDA does with an `external-push` trigger) watches the router's `StreamIsActive`; when it turns
true the loop starts the engine and, once vLLM answers /health, publishes its EndpointSlice on
the fake Kubernetes API, as the cluster would for a ready pod. The held request is served by that
engine; the stream turns false once it is done. The hold time (request sent to first token) is
the cold start a user of a pool at zero waits: printed, and kept in the test's report."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import openai
import pytest

from router.scaling.keda import externalscaler_pb2 as pb
from router.scaling.keda.externalscaler_pb2_grpc import ExternalScalerStub
from router.tools.enginefleet.fleet import Engine, Fleet
from tests.support.fake_kube import FakeKube, kube_source, serving
from tests.support.harness import Cluster, free_port
from tests.support.wait import wait_for


@pytest.fixture
def kube() -> Iterator[FakeKube]:
    with serving() as fk:
        yield fk


class ScalerLoop:
    """KEDA's part: StreamIsActive from the router; true -> start the pool's one pod."""

    def __init__(self, port: int, model: str, engine: Engine, kube: FakeKube) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        ref = pb.ScaledObjectRef(name="pool", namespace="models", scalerMetadata={"model": model})
        self.call = ExternalScalerStub(self.channel).StreamIsActive(ref)
        self.engine = engine
        self.kube = kube
        self.seen: list[bool] = []
        self.activated_at: float | None = None
        self.ready_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for answer in self.call:
                self.seen.append(answer.result)
                if answer.result and self.activated_at is None:
                    self.activated_at = time.monotonic()
        except grpc.RpcError:
            pass  # cancelled at the end

    def scale_up(self) -> None:
        """The scale-up, 0 -> 1, from the test's main thread: the engine dies with the thread
        that started it (the fleet's PR_SET_PDEATHSIG), and this loop's thread ends first."""
        self.engine.start()
        self.engine.wait_ready()
        self.ready_at = time.monotonic()
        ports = [{"name": "http", "port": self.engine.port}]
        self.kube.put_slice("pool-pod", [_ready("127.0.0.1")], ports)

    def close(self) -> None:
        self.call.cancel()
        self.thread.join(10)
        self.channel.close()


def _ready(address: str) -> dict[str, object]:
    return {"addresses": [address], "conditions": {"ready": True, "serving": True}}


def test_a_request_held_at_zero_is_served_by_the_engine_the_scaler_loop_starts(
    fleet: Fleet, procs: Cluster, kube: FakeKube, record_property: Callable[[str, object], None]
) -> None:
    engine = fleet.engines[0]
    model = engine.model
    engine.stop()  # the pool at zero
    scaler_port = free_port()
    source = kube_source(kube, procs.tmp / "kubeconfig", models=[model])
    router = procs.router(
        {
            "discovery": [source],
            "scale_from_zero": {"hold_timeout_s": 300, "scaler_port": scaler_port},
            "health": {"interval": 0.5},
        }
    )
    loop = ScalerLoop(scaler_port, model, engine, kube)
    try:
        wait_for(lambda: loop.seen == [False], what="the scaler idle at first")
        client = openai.OpenAI(
            base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=300
        )
        got: dict[str, object] = {}

        def ask() -> None:  # the client, held while the pool wakes
            stream = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=8,
                temperature=0,
                stream=True,
            )
            text = ""
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got.setdefault("first", time.monotonic())
                    text += chunk.choices[0].delta.content
            got["text"] = text

        sent = time.monotonic()
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        wait_for(
            lambda: loop.activated_at is not None, what="the scaler told of the demand", within=30
        )
        loop.scale_up()
        asking.join(300)
        first = got.get("first")
        text = got.get("text")
        assert isinstance(first, float)
        assert text and first is not None
        assert loop.activated_at is not None and loop.ready_at is not None
        hold = first - sent
        push = loop.activated_at - sent
        start = loop.ready_at - loop.activated_at
        record_property("hold_s", round(hold, 2))
        record_property("engine_start_s", round(start, 2))
        print(f"held {hold:.1f} s: push {push * 1000:.0f} ms, engine start {start:.1f} s")
        assert push < 5  # pushed with the hold, not at a polling round
        wait_for(lambda: loop.seen == [False, True, False], what="idle again once served")
    finally:
        loop.close()
        engine.start()  # the session's fleet keeps its engines (idempotent when running)
        engine.wait_ready()
