"""An engine that died before its first byte: the gateway retries through the picker's ordered
endpoint list (`picker.fallbacks`), the client never sees the failure, the picker charges the
dead engine (ejected after `outlier.consecutive_failures`) and no lease is left behind.

The example bootstrap's ORIGINAL_DST cluster reads one address, so it cannot retry elsewhere:
this module runs it with the profile docs/endpoint-picker.md gives for fallbacks (Envoy's
override_host load-balancing policy over the engines' cluster, a retry policy, and the
`upstream.address` response attribute that tells the picker where the answer came from), with
`picker.response_body: none` and the filter's `response_body_mode: NONE`: the lighter profile,
where the response body stays in Envoy, the lease ends with the response's headers and no TTFT
is seen. Client keys are on here (the key and its quota from the headers Envoy forwards); a split
(prefill/decode) model's prompt names its prefill engine; the last test drains the picker.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import httpx
import openai
import pytest

from router.picker import messages
from tests.support.harness import (
    Cluster,
    Proc,
    backend,
    expected_text,
    free_port,
    metric,
    sha,
)
from tests.support.picker import (
    Session,
    body,
    chat,
    destination,
    envoy_config,
    head,
    health,
    in_flight,
    start_envoy,
    start_picker,
)
from tests.support.wait import wait_for

TEAM, ONE = "sk-team-picker", "sk-one-a-minute"


def fallback_profile(config: dict[str, Any], engines: list[Proc]) -> dict[str, Any]:
    """The example bootstrap, its engines' cluster and route made to retry through the list,
    the response body left out of the picker."""
    resources = config["static_resources"]
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset", "num_retries": 2}
    ext_proc = manager["http_filters"][0]["typed_config"]
    ext_proc["response_attributes"] = ["upstream.address"]
    mode = ext_proc["processing_mode"]
    mode["response_body_mode"], mode["response_trailer_mode"] = "NONE", "SKIP"
    policy = "type.googleapis.com/envoy.extensions.load_balancing_policies"
    cluster = {
        "name": "engines",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": "engines",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": "127.0.0.1",
                                        "port_value": e.port,
                                    }
                                }
                            }
                        }
                        for e in engines
                    ]
                }
            ],
        },
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": {
                            "@type": f"{policy}.override_host.v3.OverrideHost",
                            "override_host_sources": [
                                {"header": "x-gateway-destination-endpoint"},
                                {
                                    "metadata": {
                                        "key": "envoy.lb",
                                        "path": [{"key": "x-gateway-destination-endpoint"}],
                                    }
                                },
                            ],
                            "fallback_policy": {
                                "policies": [
                                    {
                                        "typed_extension_config": {
                                            "name": "envoy.load_balancing_policies.round_robin",
                                            "typed_config": {
                                                "@type": f"{policy}.round_robin.v3.RoundRobin"
                                            },
                                        }
                                    }
                                ]
                            },
                        },
                    }
                }
            ]
        },
    }
    resources["clusters"] = [
        cluster if c["name"] == "engines" else c for c in resources["clusters"]
    ]
    return config


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Any]:
    a, b = module_procs.mock("a"), module_procs.mock("b")
    picker = start_picker(
        module_procs,
        {
            "backends": [
                backend("a", a, {"m": "m"}),
                backend("b", b, {"m": "m"}),
                # A split model on the same engines: `pre` prefills, `dec` decodes.
                backend("pre", a, {"split": "m"}, role="prefill"),
                backend("dec", b, {"split": "m"}, role="decode"),
            ],
            "disaggregation": {"min_uncached_tokens": 64},
            "balancer": "round_robin",
            "picker": {"fallbacks": 1, "response_body": "none"},
            "expose_backend_header": True,
            "health": {"interval": 60},
            "outlier": {"consecutive_failures": 2},
            "drain_grace": 10,
            "api_keys": [
                {"sha256": sha(TEAM), "name": "team"},
                {"sha256": sha(ONE), "name": "one", "rpm": 1},
            ],
        },
    )
    listen, admin = free_port(), free_port()
    config = fallback_profile(envoy_config(picker.grpc_port, listen, admin), [a, b])
    envoy = start_envoy(module_procs, config, listen, admin)
    return {"a": a, "b": b, "picker": picker, "envoy": envoy}


def test_client_keys_and_their_quotas_come_from_the_forwarded_headers(
    fleet: dict[str, Any],
) -> None:
    picker = fleet["picker"]
    s = Session(picker)
    s.send(head(eos=False))
    s.send(body(chat(), True))
    (refused,) = s.recv()
    assert refused.immediate_response.status.code == 401
    assert json.loads(refused.immediate_response.body)["error"]["message"]
    s.end()
    s = Session(picker)
    s.send(head(authorization=f"Bearer {ONE}"))
    s.send(body(chat(), True))
    picked, _ = s.recv(2)
    destination(picked)
    # The client's key never reaches the engine.
    assert "authorization" in picked.request_headers.response.header_mutation.remove_headers
    s.reset()
    s = Session(picker)
    s.send(head(authorization=f"Bearer {ONE}"))
    s.send(body(chat(), True))
    (limited,) = s.recv()
    reply = limited.immediate_response
    assert reply.status.code == 429  # its rpm of 1 is spent
    sent = {o.header.key: o.header.raw_value for o in reply.headers.set_headers}
    assert float(sent["retry-after"]) > 0
    s.end()
    wait_for(lambda: set(in_flight(picker).values()) == {0}, "no lease left")


def test_a_split_prompt_names_its_prefill_engine(fleet: dict[str, Any]) -> None:
    picker = fleet["picker"]
    for words, prefiller in ((400, address(fleet["a"])), (4, None)):
        s = Session(picker)
        s.send(head(authorization=f"Bearer {TEAM}"))
        s.send(body(chat("word " * words, model="split"), True))
        picked, _ = s.recv(2)
        assert destination(picked) == address(fleet["b"])  # the decode engine
        mutation = picked.request_headers.response.header_mutation
        sent = {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
        assert sent.get(messages.PREFILLER) == prefiller  # a short prompt: served whole
        assert in_flight(picker)["pre"] == (1 if prefiller else 0)
        s.reset()
        wait_for(lambda: set(in_flight(picker).values()) == {0}, "both leases given back")


def address(mock: Proc) -> str:
    return mock.url.removeprefix("http://")


def test_engine_death_before_the_first_byte_retries_through_the_list(
    fleet: dict[str, Any],
) -> None:
    client = openai.OpenAI(base_url=fleet["envoy"].url + "/v1", api_key=TEAM, max_retries=0)
    served = {
        client.chat.completions.with_raw_response.create(
            model="m", messages=[], max_tokens=1
        ).headers["x-sluicegate-backend"]
        for _ in range(4)
    }
    assert served == {"a", "b"}  # both alive: round robin over both, the list's first
    fleet["a"].kill9()
    for _ in range(4):  # round robin picks `a` twice: each time Envoy goes on to `b`
        raw = client.chat.completions.with_raw_response.create(model="m", messages=[], max_tokens=2)
        assert raw.headers["x-sluicegate-backend"] == "b"
        assert raw.parse().choices[0].message.content
    rows = {r["name"]: r for r in httpx.get(fleet["picker"].url + "/admin/backends").json()}
    assert rows["a"]["healthy"] is False  # two failures charged to it: ejected
    assert rows["b"]["healthy"] is True
    wait_for(lambda: set(in_flight(fleet["picker"]).values()) == {0}, "no lease left")


def test_with_response_body_none_the_body_bypasses_the_picker(fleet: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=fleet["envoy"].url + "/v1", api_key=TEAM, max_retries=0)
    stream = client.chat.completions.create(model="m", messages=[], max_tokens=5, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected_text(5)
    picker = fleet["picker"]
    assert metric(picker, "sluicegate_requests_total") >= 1
    assert metric(picker, "sluicegate_ttft_seconds_count") == 0  # no body seen: no TTFT
    wait_for(lambda: set(in_flight(picker).values()) == {0}, "no lease left")


def test_draining_refuses_new_requests_and_waits_for_the_streams(fleet: dict[str, Any]) -> None:
    """Last in the module: it stops the picker."""
    picker = fleet["picker"]
    held = Session(picker)  # a request picked and not yet answered: the drain waits for it
    held.send(head(authorization=f"Bearer {TEAM}"))
    held.send(body(chat(), True))
    held.recv(2)
    picker.signal(signal.SIGTERM)
    target = picker.grpc_target
    wait_for(lambda: health(target, "readiness") == 2, "readiness NOT_SERVING while draining")
    assert health(target, "envoy.service.ext_proc.v3.ExternalProcessor") == 2
    assert health(target, "liveness") == 1
    late = httpx.post(
        fleet["envoy"].url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {TEAM}"},
        json={"model": "m", "messages": [], "max_tokens": 1},
        timeout=10,
    )
    assert late.status_code == 503
    assert late.json()["error"]["message"]
    assert picker.alive()  # still waiting for the held stream
    held.reset()
    wait_for(lambda: not picker.alive(), "the picker exits once its last stream ended")
    assert picker.popen.returncode == 0
