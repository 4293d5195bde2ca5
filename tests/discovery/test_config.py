"""Discovery's static rules, in process: config errors name the field; discovered entries in the
Fleet take patches like file entries; the reconciler drains vanished backends until their
streams end (injected clock and in-flight counts)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.core.backend import Backend
from router.core.settings import BackendConfig, ConfigError, KubernetesDiscovery, load_settings
from router.discovery.kubernetes import _slice_endpoints
from router.discovery.reconcile import Endpoint, Reconciler, backend_name
from router.registry.fleet import Discovered, Fleet, LocalRecords, Registry


def load(tmp_path: Path, source: dict[str, Any]) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"discovery": [source]}))
    with pytest.raises(ConfigError) as err:
        load_settings(path)
    return str(err.value)


K8S = {"kind": "kubernetes", "namespace": "models", "service": "vllm", "port": "http"}


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ({**K8S, "service": None}, ["discovery[0]", "service", "label_selector"]),
        ({**K8S, "port": "Not_A_Port"}, ["discovery[0]", "port", "port name"]),
        ({**K8S, "port": 70000}, ["discovery[0]", "port", "1-65535"]),
        ({**K8S, "backend": {"max_inflight": 0}}, ["backend", "max_inflight"]),
        ({**K8S, "backend": {"url": "http://x"}}, ["backend", "url", "set per endpoint"]),
        ({**K8S, "models": []}, ["models", "auto"]),
        ({**K8S, "kind": "consul"}, ["discovery[0]", "kind"]),
        ({"kind": "dns", "name": "vllm.svc", "port": "http"}, ["discovery[0]", "port"]),
        ({"kind": "dns", "name": "vllm.svc", "port": 8000, "interval": 0}, ["interval"]),
        ({**K8S, "models": ["m"], "models_allow": ["m"]}, ["models_allow", "auto"]),
        ({**K8S, "models": ["m"], "shadow": True}, ["shadow", "auto"]),
        ({**K8S, "models_allow": []}, ["models_allow"]),
        ({**K8S, "models_allow": ["bad id"]}, ["models_allow", "visible"]),
    ],
)
def test_bad_sources_stop_startup_naming_the_field(
    tmp_path: Path, source: dict[str, Any], words: list[str]
) -> None:
    message = load(tmp_path, {k: v for k, v in source.items() if v is not None})
    for word in words:
        assert word in message, message


def test_a_good_source_loads_with_the_issue_example(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        """
discovery:
  - kind: kubernetes
    namespace: models
    service: vllm-llama
    port: http
    models: auto
    backend: {kind: vllm, max_inflight: 64}
    resync: 300
  - kind: dns
    name: vllm-llama-headless.models.svc.cluster.local
    port: 8000
    interval: 5
    models: [llama-3.1-8b]
"""
    )
    k8s, dns = load_settings(path).discovery
    assert isinstance(k8s, KubernetesDiscovery)
    assert k8s.selector == "kubernetes.io/service-name=vllm-llama"
    assert dns.models == {"llama-3.1-8b": "llama-3.1-8b"}


def cfg(name: str) -> BackendConfig:
    return BackendConfig.model_validate({"name": name, "url": f"http://{name}:1", "models": ["m"]})


def test_a_patch_on_a_discovered_backend_survives_relists() -> None:
    registry = Registry([], "round_robin")
    store = LocalRecords()
    fleet = Fleet(registry, [], store)
    fleet.set_discovered("k", {"p1": Discovered(cfg("p1"), "kubernetes")})
    assert asyncio.run(store.load()) == {}  # the cluster is the truth: nothing stored
    asyncio.run(fleet.update("p1", {"weight": 5, "draining": True}))
    # Only the admin change is stored (as over a file entry), never the discovered entry.
    assert asyncio.run(store.load()) == {"p1": {"patch": {"weight": 5.0}, "draining": True}}
    for _ in range(3):  # re-lists hand the same endpoint again
        fleet.set_discovered("k", {"p1": Discovered(cfg("p1"), "kubernetes")})
    b = registry.snapshot.by_name["p1"]
    assert (b.weight, b.draining, b.source) == (5.0, True, "kubernetes")
    # A terminating endpoint drains on the source's word alone.
    fleet.set_discovered("k", {"p1": Discovered(cfg("p1"), "kubernetes", draining=True)})
    asyncio.run(fleet.update("p1", {"draining": False}))
    assert registry.snapshot.by_name["p1"].draining is True
    fleet.set_discovered("k", {})
    assert "p1" not in registry.snapshot.by_name


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def discovery_event(self, source: str, event: str, n: int = 1) -> None:
        self.seen += [(source, event)] * n


def test_a_vanished_backend_drains_until_its_streams_end_or_grace_passes() -> None:
    now = [0.0]
    inflight = {"vllm-10.0.0.1-8000": 3}

    async def counts(names: Any) -> dict[str, int]:
        return {n: inflight.get(n, 0) for n in names}

    async def run() -> None:
        registry = Registry([], "round_robin")
        fleet = Fleet(registry, [], LocalRecords())
        source = KubernetesDiscovery.model_validate({**K8S, "models": ["m"]})
        events = Events()
        rec = Reconciler("k", source, fleet, counts, events, 30, lambda: now[0])
        await rec.update([Endpoint("10.0.0.1", 8000, True), Endpoint("10.0.0.2", 8000, True)])
        assert len(registry.snapshot.backends) == 2
        await rec.update([Endpoint("10.0.0.2", 8000, True)])
        gone = registry.snapshot.by_name["vllm-10.0.0.1-8000"]
        assert gone.draining  # streams in flight: stays, takes no new requests
        now[0] = 10
        await rec.tick()
        assert "vllm-10.0.0.1-8000" in registry.snapshot.by_name
        inflight.clear()
        await rec.tick()
        assert list(registry.snapshot.by_name) == ["vllm-10.0.0.2-8000"]
        # grace: a stream that never ends does not keep a dead endpoint forever
        inflight["vllm-10.0.0.2-8000"] = 1
        await rec.update([])
        assert registry.snapshot.by_name["vllm-10.0.0.2-8000"].draining
        now[0] = 41
        await rec.tick()
        assert registry.snapshot.backends == ()
        assert [e for _, e in events.seen].count("removed") == 2

    asyncio.run(run())


def test_endpoint_conditions_map_to_routable_draining_or_absent() -> None:
    def ep(addr: str, **c: Any) -> dict[str, Any]:
        return {"addresses": [addr], "conditions": c}

    sl = {
        "endpoints": [
            ep("10.0.0.1", ready=True, serving=True, terminating=False),
            ep("10.0.0.2", ready=False, serving=True, terminating=True),
            ep("10.0.0.3", ready=False, serving=False, terminating=True),
            ep("10.0.0.4", ready=False, serving=False, terminating=False),
            ep("10.0.0.5"),  # conditions unknown: ready, as the API defines it
            {"conditions": {"ready": True}},  # no address: skipped
        ]
    }
    assert _slice_endpoints(sl, 8000) == (
        [
            Endpoint("10.0.0.1", 8000, True),
            Endpoint("10.0.0.2", 8000, False),
            Endpoint("10.0.0.5", 8000, True),
        ],
        1,  # the endpoint without an address: skipped and counted
    )


def test_backend_names_are_valid_and_stable_for_long_addresses() -> None:
    assert backend_name("vllm", "10.1.2.3", 8000) == "vllm-10.1.2.3-8000"
    long = backend_name("a-rather-long-service-prefix-xx", "fd00:1234:5678:9abc::1:2:3", 8000)
    assert len(long) <= 63 and long == backend_name(
        "a-rather-long-service-prefix-xx", "fd00:1234:5678:9abc::1:2:3", 8000
    )
    Backend.from_config(cfg("x"))  # the module's own type still builds


def test_a_slice_without_the_port_warns_again_once_deleted_and_recreated() -> None:
    from router.discovery.kubernetes import KubernetesSource

    async def counts(names: Any) -> dict[str, int]:
        return {}

    def slice_event(kind: str) -> dict[str, Any]:
        obj = {"metadata": {"name": "vllm-abc"}, "ports": [{"name": "metrics", "port": 9090}]}
        return {"type": kind, "raw_object": obj}

    async def run() -> list[str]:
        fleet = Fleet(Registry([], "round_robin"), [], LocalRecords())
        cfg = KubernetesDiscovery.model_validate({**K8S, "models": ["m"]})
        events = Events()
        rec = Reconciler("k", cfg, fleet, counts, events, 30)
        src = KubernetesSource(cfg, rec)
        for kind in ("ADDED", "MODIFIED", "DELETED", "ADDED"):
            await src._event(slice_event(kind))
        return [e for _, e in events.seen]

    assert asyncio.run(run()).count("bad_port") == 2  # once per slice life, not per event
