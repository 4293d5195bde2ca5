"""`discovery: [{kind: inferencepool}]`: the pods an InferencePool selects, on its target ports.

The source runs with the real client library (kubernetes-asyncio) against the fake API server
(tests/support/fake_kube.py: the InferencePool CRD's and the pods' list and watch, the real wire
protocol), in process, where what is checked is what routing sees: the Fleet's snapshot. The last
test runs a real router on real mock engines found this way, beside a backend of the file."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from router.core.settings import InferencePoolDiscovery, Settings
from router.discovery.inferencepool import InferencePoolSource, pool_spec
from router.discovery.reconcile import Reconciler
from router.registry.fleet import Fleet, LocalRecords, Registry
from tests.discovery.test_hostile import Events, no_streams
from tests.support.fake_kube import FakeKube
from tests.support.harness import STARVED_S, Cluster, Proc, admin_backends, free_port, stats
from tests.support.wait import wait_for, wait_for_async

VLLM = {"app": "vllm", "model": "llama"}
SGLANG = {"app": "sglang"}


@pytest.fixture(autouse=True)
def _clean(kube: FakeKube) -> Iterator[None]:
    """The module's one fake: each test starts with no pool and no pod."""
    yield
    kube.up()
    for resource in ("inferencepools", "pods"):
        for ns, name in list(kube.objects[resource]):
            kube.delete(resource, ns, name)


class Running:
    def __init__(self, src: InferencePoolSource, fleet: Fleet, events: Events) -> None:
        self.src, self.fleet, self.events = src, fleet, events
        self.task = asyncio.create_task(src.run())

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.wait([self.task])

    @property
    def names(self) -> set[str]:
        return set(self.fleet.registry.snapshot.by_name)

    def draining(self, name: str) -> bool:
        return self.fleet.registry.snapshot.by_name[name].draining


@contextlib.asynccontextmanager
async def pool_source(kube: FakeKube, tmp_path: Path, **extra: Any) -> AsyncIterator[Running]:
    cfg = InferencePoolDiscovery.model_validate(
        {
            "kind": "inferencepool",
            "name": "llama",
            "namespace": "models",
            "models": ["m"],
            "backoff_max": 0.5,
            "kubeconfig": str(kube.kubeconfig(tmp_path / "kubeconfig")),
            **extra,
        }
    )
    fleet = Fleet(Registry([], "round_robin"), [], LocalRecords())
    events = Events()
    rec = Reconciler("p", cfg, fleet, no_streams, events, 30)
    src = InferencePoolSource(cfg, rec)
    r = Running(src, fleet, events)
    try:
        yield r
    finally:
        await r.stop()
        rec.forget_questions()
        assert src._pod_watch is None  # the pods' watch ends with the source


def names(*eps: str) -> set[str]:
    return {f"llama-{ep.replace(':', '-')}" for ep in eps}


def test_pods_join_when_ready_and_leave_when_unready_or_terminating(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.put_pool("llama", VLLM, [8000])
    kube.put_pod("a", "10.0.0.1", VLLM)
    kube.put_pod("b", "10.0.0.2", VLLM, ready=False)
    kube.put_pod("c", None, VLLM, ready=False)  # pending: no IP yet
    kube.put_pod("other", "10.0.0.9", SGLANG)  # not the pool's

    async def run() -> None:
        async with pool_source(kube, tmp_path) as r:
            await wait_for_async(lambda: r.names == names("10.0.0.1:8000"), "a only")
            kube.put_pod("b", "10.0.0.2", VLLM)  # b becomes Ready
            kube.put_pod("c", "10.0.0.3", VLLM)  # c gets its IP and is Ready
            want = names("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")
            await wait_for_async(lambda: r.names == want, "b and c ready")
            kube.put_pod("a", "10.0.0.1", VLLM, ready=False)  # a fails its readiness probe
            await wait_for_async(lambda: "llama-10.0.0.1-8000" not in r.names, "a unready")
            # Terminating but still Ready: drains (no new requests, streams finish).
            kube.put_pod("b", "10.0.0.2", VLLM, terminating=True)
            await wait_for_async(lambda: r.draining("llama-10.0.0.2-8000"), "b draining")
            assert not r.draining("llama-10.0.0.3-8000")
            kube.delete_pod("b")
            await wait_for_async(lambda: r.names == names("10.0.0.3:8000"), "b gone")
            # Relabelled out of the selection: the watch says DELETED, as the API server does.
            kube.put_pod("c", "10.0.0.3", {"app": "vllm", "model": "other"})
            await wait_for_async(lambda: r.names == set(), "c relabelled away")
            assert r.src.selector == "app=vllm,model=llama"

    asyncio.run(run())


def test_a_selector_change_relists_the_pods(kube: FakeKube, tmp_path: Path) -> None:
    kube.put_pool("llama", VLLM, [8000])
    kube.put_pod("v", "10.0.0.1", VLLM)
    kube.put_pod("s", "10.0.0.2", SGLANG)

    async def run() -> None:
        async with pool_source(kube, tmp_path) as r:
            await wait_for_async(lambda: r.names == names("10.0.0.1:8000"), "the vllm pod")
            kube.put_pool("llama", SGLANG, [8000])
            await wait_for_async(lambda: r.names == names("10.0.0.2:8000"), "the sglang pod")
            # The pods were listed again with the new selector, and are watched with it.
            assert ("list", "pods", "app=sglang;") in kube.calls
            kube.put_pod("s2", "10.0.0.3", SGLANG)
            kube.put_pod("v2", "10.0.0.4", VLLM)
            want = names("10.0.0.2:8000", "10.0.0.3:8000")
            await wait_for_async(lambda: r.names == want, "a new sglang pod, by the watch")
            assert r.names == want  # the old selector's new pod is not taken

    asyncio.run(run())


def test_a_target_ports_change_applies_to_every_pod(kube: FakeKube, tmp_path: Path) -> None:
    kube.put_pool("llama", VLLM, [8000])
    kube.put_pod("a", "10.0.0.1", VLLM)
    kube.put_pod("b", "10.0.0.2", VLLM)

    async def run() -> None:
        async with pool_source(kube, tmp_path) as r:
            await wait_for_async(lambda: r.names == names("10.0.0.1:8000", "10.0.0.2:8000"), "")
            pod_lists = kube.calls.count(("list", "pods", "app=vllm,model=llama;"))
            kube.put_pool("llama", VLLM, [8000, 8001])  # each port one endpoint
            want = names("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.1:8001", "10.0.0.2:8001")
            await wait_for_async(lambda: r.names == want, "both ports of both pods")
            kube.put_pool("llama", VLLM, [8001])
            await wait_for_async(lambda: r.names == names("10.0.0.1:8001", "10.0.0.2:8001"), "")
            # Ports alone change no selection: the pods are not listed again for it.
            assert kube.calls.count(("list", "pods", "app=vllm,model=llama;")) == pod_lists

    asyncio.run(run())


def test_the_pool_deleted_takes_its_backends_and_a_new_one_brings_them_back(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.put_pod("a", "10.0.0.1", VLLM)

    async def run() -> None:
        async with pool_source(kube, tmp_path) as r:
            # No pool yet: nothing routed, warned once, the source in sync (not an error).
            await wait_for_async(lambda: "pool_missing" in r.events.seen, "missing pool")
            assert r.names == set() and not r.src.rec.stale
            kube.put_pool("llama", VLLM, [8000])
            kube.put_pool("other-pool", SGLANG, [9000])  # another pool: not watched
            await wait_for_async(lambda: r.names == names("10.0.0.1:8000"), "pool created")
            kube.delete_pool("llama")
            await wait_for_async(lambda: r.names == set(), "the pool's backends gone")
            assert r.src.selector is None and r.src._pod_watch is None
            kube.put_pool("llama", VLLM, [8000])
            await wait_for_async(lambda: r.names == names("10.0.0.1:8000"), "back again")

    asyncio.run(run())


def test_a_bad_pool_keeps_the_set_and_a_restarted_source_watches_the_pods_again(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.put_pool("llama", VLLM, [8000])
    kube.put_pod("a", "10.0.0.1", VLLM)

    async def run() -> None:
        async with pool_source(kube, tmp_path) as r:
            await wait_for_async(lambda: r.names == names("10.0.0.1:8000"), "a")
            # A spec the CRD's validation refuses (an empty selector would take every pod).
            bad = {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}
            kube.put("inferencepools", "models", "llama", {}, {"spec": bad})
            await wait_for_async(lambda: "bad_pool" in r.events.seen, "bad pool warned")
            assert r.names == names("10.0.0.1:8000")
            kube.put_pool("llama", VLLM, [8000])
            # The runner starts a source again after a bug escaped it: the pods are watched
            # again (a new pod is seen), the set kept meanwhile.
            await r.stop()
            assert r.src._pod_watch is None and r.names == names("10.0.0.1:8000")
            r.task = asyncio.create_task(r.src.run())
            kube.put_pod("b", "10.0.0.2", VLLM)
            want = names("10.0.0.1:8000", "10.0.0.2:8000")
            await wait_for_async(lambda: r.names == want, "b, by the restarted source")

    asyncio.run(run())


def test_410_gone_relists_the_pool_and_the_pods(kube: FakeKube, tmp_path: Path) -> None:
    """Events lost while the watches were down (a new pod, a port change) are found by the
    re-list a 410 Gone asks for; the set is never emptied on the way."""
    kube.put_pool("llama", VLLM, [8000])
    kube.put_pod("a", "10.0.0.1", VLLM)

    async def run() -> None:
        async with pool_source(kube, tmp_path, resync=300) as r:
            await wait_for_async(lambda: r.names == names("10.0.0.1:8000"), "a")
            kube.put_pod("b", "10.0.0.2", VLLM, silent=True)
            kube.put_pool("llama", VLLM, [8000, 8001], silent=True)
            kube.expire()
            kube.drop_watches()
            want = names("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.1:8001", "10.0.0.2:8001")
            await wait_for_async(
                lambda: r.names == want, "the lost changes, after re-lists", STARVED_S
            )
            assert kube.requests.count("410") >= 2  # both watches were told
            assert "expired" in r.events.seen

    asyncio.run(run())


def test_an_unusable_pool_spec_keeps_the_last_set() -> None:
    good = {"spec": {"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": 8000}]}}
    assert pool_spec(good) == ("app=vllm,model=llama", (8000,))
    for spec in (
        {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]},  # every pod
        {"selector": {"matchLabels": {"a": "b,c=d"}}, "targetPorts": [{"number": 8000}]},
        {"selector": {"matchLabels": VLLM}, "targetPorts": []},
        {"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": 70000}]},
        {"selector": {"matchLabels": VLLM}, "targetPorts": [{"number": 1}, {"number": 1}]},
        {"selector": {"matchLabels": VLLM}, "targetPortNumber": 8000},  # v1alpha2's field
    ):
        assert pool_spec({"spec": spec}) is None, spec


def test_the_setting_names_the_pool() -> None:
    s = Settings.model_validate(
        {"discovery": [{"kind": "inferencepool", "name": "llama", "namespace": "models"}]}
    )
    (cfg,) = s.discovery
    assert isinstance(cfg, InferencePoolDiscovery) and cfg.names_prefix == "llama"
    with pytest.raises(ValueError, match="namespace"):
        Settings.model_validate({"discovery": [{"kind": "inferencepool", "name": "llama"}]})


def test_without_the_kubernetes_client_startup_names_the_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    from router.core.settings import ConfigError
    from router.discovery.runner import check_discovery

    settings = Settings.model_validate(
        {
            "backends": [{"name": "b", "url": "http://127.0.0.1:1", "models": ["m"]}],
            "discovery": [{"kind": "inferencepool", "name": "llama", "namespace": "models"}],
        }
    )
    check_discovery(settings)  # installed here: fine
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "kubernetes_asyncio" else real(n)
    )
    with pytest.raises(ConfigError, match=r"discovery\[0\]: kind inferencepool needs"):
        check_discovery(settings)


MODEL = "mock-model"
PORT = free_port()
TOKEN = "admin-token-for-inferencepool"


@pytest.fixture(scope="module")
def engines(module_procs: Cluster) -> dict[str, Proc]:
    """Two pods' engines on one port (127.0.0.2 and .3, as pods have), and one of the file."""
    return {
        "a": module_procs.mock("a", port=PORT, host="127.0.0.2", tokens=4),
        "b": module_procs.mock("b", port=PORT, host="127.0.0.3", tokens=4),
        "file": module_procs.mock("file", tokens=4),
    }


def test_a_router_routes_to_the_pools_pods_beside_its_file_backends(
    module_procs: Cluster, kube: FakeKube, engines: dict[str, Proc]
) -> None:
    a, b, static = engines["a"], engines["b"], engines["file"]
    kube.put_pool("llama", VLLM, [PORT])
    kube.put_pod("a", "127.0.0.2", VLLM)
    kube.put_pod("b", "127.0.0.3", VLLM)
    source = {
        "kind": "inferencepool",
        "name": "llama",
        "namespace": "models",
        "models": "auto",  # asked of each pod's engine, as kind kubernetes does
        "backoff_max": 0.5,
        "kubeconfig": str(kube.kubeconfig(module_procs.tmp / "kubeconfig-pool")),
    }
    router = module_procs.router(
        {
            "backends": [{"name": "static", "url": static.url, "models": {"static": MODEL}}],
            "discovery": [source],
            "balancer": "round_robin",
        },
        env={"SLUICEGATE_ADMIN_TOKEN": TOKEN},
    )
    auth = {"authorization": f"Bearer {TOKEN}"}
    wait_for(lambda: {a.url, b.url} <= set(admin_backends(router, auth)), "both pods found")
    found = admin_backends(router, auth)
    assert found[a.url]["source"] == "inferencepool" and found[a.url]["models"] == {MODEL: MODEL}
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)

    def chat(model: str) -> str:
        out = client.chat.completions.create(
            model=model, stream=True, messages=[{"role": "user", "content": "hi"}]
        )
        return "".join(c.choices[0].delta.content or "" for c in out if c.choices)

    for _ in range(6):
        assert chat(MODEL)
    assert stats(a)["requests"] >= 2 and stats(b)["requests"] >= 2
    assert chat("static") and stats(static)["requests"] == 1  # the file's backend still serves
    # b turns unready: no new request reaches it.
    kube.put_pod("b", "127.0.0.3", VLLM, ready=False)
    wait_for(lambda: b.url not in admin_backends(router, auth), "b leaves")
    on_b = stats(b)["requests"]
    for _ in range(4):
        assert chat(MODEL)
    assert stats(b)["requests"] == on_b
