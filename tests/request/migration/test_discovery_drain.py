"""Drain by discovery with migration on, end to end: a Kubernetes endpoint serving a stream goes
terminating, then leaves its EndpointSlice; the stream moves to another engine once the drain
grace has passed, and the client reads the whole answer in one stream.

A real router lists and watches EndpointSlices on the fake API server (tests/support/fake_kube.py,
the real wire protocol) and routes to real mock engines on 127.0.0.2 and .3, one port, as pods
behind a Service. What discovery does (router/discovery/reconcile.py): a terminating endpoint
only drains (no new requests; its streams stay); an endpoint gone from the slice is removed once
its streams end or `drain_grace` has passed, and removal moves the streams still on it
(router/request/migration/policy.py).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import openai

from tests.support.fake_kube import FakeKube, kube_source, put_mock
from tests.support.harness import (
    Cluster,
    admin_backends,
    control,
    free_port,
    in_flight,
    metric,
    stats,
)
from tests.support.wait import wait_for

MODEL = "mock-model"
GRACE = 0.5  # drain_grace, seconds
ITL_MS = 20  # the first engine's pace
TOKENS = 400  # 8 s at ITL_MS: the stream outlives the steps below by seconds
TICK = 0.25  # discovery's check for vanished backends (router/discovery/runner.py)


def test_a_stream_on_a_vanished_endpoint_migrates_after_the_drain_grace(
    procs: Cluster, kube: FakeKube
) -> None:
    port = free_port()
    mocks = {
        n: procs.mock(n, port=port, host=h, tokens=TOKENS)
        for n, h in (("a", "127.0.0.2"), ("b", "127.0.0.3"))
    }
    router = procs.router(
        {
            "discovery": [kube_source(kube, procs.tmp / "kubeconfig")],
            "drain_grace": GRACE,
            "expose_backend_header": True,
            # Migration is not configured: on by default for these (`kind: vllm`) backends.
        }
    )
    for name, mock in mocks.items():
        put_mock(kube, mock, f"vllm-{name}")
        control(mock, itl_ms=ITL_MS)
    wait_for(lambda: len(admin_backends(router)) == 2, "both endpoints discovered")

    got: dict[str, Any] = {}
    started = threading.Event()

    def read() -> None:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long answer"}],
            stream=True,
            max_tokens=TOKENS,
        )
        got["backend"] = raw.headers["x-sluicegate-backend"]
        started.set()
        chunks = list(raw.parse())
        got["ids"] = {c.id for c in chunks}
        got["text"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(10)
    url = next(u for u, b in admin_backends(router).items() if b["name"] == got["backend"])
    name, victim = next((n, m) for n, m in mocks.items() if m.url == url)
    other = mocks["b" if name == "a" else "a"]
    control(other, itl_ms=0)  # the continuation comes at once

    # Terminating: the endpoint drains; its stream stays on it past the grace and a tick.
    put_mock(kube, victim, f"vllm-{name}", ready=False, serving=True, terminating=True)
    wait_for(lambda: bool(admin_backends(router)[url]["draining"]), "the endpoint draining")
    then = stats(victim)["tokens_generated"]
    past = math.ceil((2 * GRACE + TICK) * 1000 / ITL_MS)  # tokens that take that long
    wait_for(lambda: stats(victim)["tokens_generated"] >= then + past, "the stream going on")
    assert stats(victim)["running"] == 1 and stats(other)["requests"] == 0

    # Gone from the slice: removed after the grace, and its stream moves then.
    deleted = time.time()
    kube.delete_slice(f"vllm-{name}")
    reader.join(TOKENS * ITL_MS / 1000 + 10)
    assert not reader.is_alive()
    assert got.get("text") == "".join(f"tok{i} " for i in range(TOKENS))
    assert len(got["ids"]) == 1  # one stream
    assert stats(victim)["aborted"] == 1  # the engine saw its client go
    (continued,) = stats(other)["recent"]
    assert stats(other)["completed"] == 1
    assert continued["started_at"] - deleted >= GRACE  # not before the grace ended
    assert stats(victim)["tokens_generated"] < TOKENS  # and not after the stream ended there
    assert metric(router, "sluicegate_migrations_total", model=MODEL, result="ok") == 1
    wait_for(lambda: list(admin_backends(router)) == [other.url], "the endpoint removed")
    assert in_flight(router) == 0
