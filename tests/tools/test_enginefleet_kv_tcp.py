"""Engines asked for KV events on loopback tcp (`EngineOptions.kv_events_tcp`): what vLLM is told,
and the forwarder that subscribers connect to (no engine needed: a PUB that connects stands in)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import zmq

from router.engine.kv_endpoints import vllm_binds
from router.tools.enginefleet.fleet import Engine, EngineOptions
from tests.support.wait import wait_for


def test_tcp_events_stay_on_loopback_and_reach_a_subscriber_through_the_forwarder(
    tmp_path: Path,
) -> None:
    e = Engine(0, Path(sys.executable), tmp_path, tmp_path, EngineOptions(kv_events_tcp=True))
    args = e.args()
    told = json.loads(args[args.index("--kv-events-config") + 1])
    assert told["endpoint"] == e.kv_publish_endpoint != e.kv_events_endpoint
    assert told["replay_endpoint"] == e.kv_replay_endpoint
    for endpoint in (e.kv_events_endpoint, e.kv_publish_endpoint, e.kv_replay_endpoint):
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
    assert not vllm_binds(e.kv_publish_endpoint)  # vLLM connects: the forwarder binds it

    e.start()  # no vLLM in this venv: the process exits; the forwarder is what is tested
    ctx = zmq.Context()
    pub, sub = ctx.socket(zmq.PUB), ctx.socket(zmq.SUB)
    try:
        pub.connect(e.kv_publish_endpoint)  # as vLLM does with a host named
        sub.connect(e.kv_events_endpoint)  # as the vLLM router and sluicegate do
        sub.subscribe(b"kv")
        frames = [b"kv", (0).to_bytes(8, "big"), b"batch"]

        def relayed() -> bool:
            pub.send_multipart(frames)  # again until the subscription has reached the PUB
            return bool(sub.poll(50)) and sub.recv_multipart() == frames

        wait_for(relayed, "a batch relayed from the engine's side to the subscriber's", 5.0)
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
        ctx.term()
        e.stop()
        e.close_forwarder()
    with zmq.Context() as again, again.socket(zmq.XPUB) as probe:
        probe.bind(e.kv_events_endpoint)  # the forwarder's port is free once it is closed


def test_ipc_events_are_the_default_and_publish_where_subscribers_connect(tmp_path: Path) -> None:
    e = Engine(0, Path(sys.executable), tmp_path, tmp_path, EngineOptions())
    assert e.kv_publish_endpoint == e.kv_events_endpoint
    assert e.kv_events_endpoint.startswith("ipc://")
