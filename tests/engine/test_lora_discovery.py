"""LoRA adapters learned by discovery (`models: auto`), end to end, on real processes.

A real router watches EndpointSlices on the fake Kubernetes API server (tests/support/fake_kube.py,
the real wire protocol) with `models: auto`, in front of two mock vLLM engines with LoRA
(`--max-loras 2`). Engine `a` is started with adapter `sql` (`--lora-modules`), which only its
`/v1/models` lists (`"parent": "mock-model"`); no config names it. Engine `b` has no adapter
until the second test loads one at run time through the mock's vLLM load endpoint, then unloads it.

Every wait is a poll whose deadline is derived from the settings under test: the engine scrape
interval, `lora.refresh` and the health interval.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import NotFoundError, OpenAI

from tests.support.fake_kube import FakeKube, endpoint, kube_source
from tests.support.harness import Cluster, admin_backends, free_port, stats
from tests.support.wait import wait_for

MODEL = "mock-model"
ADAPTER = "sql"
SCRAPE = 0.1  # engine_metrics.interval
REFRESH = 0.2  # lora.refresh: how often each engine's /v1/models is read
HEALTH = 0.5  # health.interval
# Discovery (a watch event, then the /v1/models question) and the first health probe, then at
# most two adapter refreshes after a scrape; 5x and 2 s of slack for a loaded 2-core machine.
LEARN_WITHIN = 5 * (HEALTH + 2 * REFRESH + 2 * SCRAPE) + 2
ENGINE = ["--engine", "--max-num-seqs", "8", "--decode-ms", "2", "--max-loras", "2"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    adapter_dir: Path = tmp_path_factory.mktemp("adapters")
    (adapter_dir / ADAPTER).mkdir()
    kube = FakeKube(free_port(), bookmark_every=0.3)
    c = Cluster()
    try:
        a = c.mock(
            "a", engine_args=[*ENGINE, "--lora-modules", f"{ADAPTER}={adapter_dir / ADAPTER}"]
        )
        b = c.mock("b", engine_args=ENGINE)
        for name, mock in (("vllm-a", a), ("vllm-b", b)):
            kube.put_slice(name, [endpoint("127.0.0.1")], [{"name": "http", "port": mock.port}])
        source = kube_source(
            kube, c.tmp / "kubeconfig", backend={"kind": "vllm", "max_inflight": 64}, resync=300
        )
        router = c.router(
            {
                "discovery": [source],
                "health": {"interval": HEALTH, "timeout": 2, "unhealthy_threshold": 1},
                "engine_metrics": {"interval": SCRAPE, "timeout": 0.5, "stale_after": 2.0},
                "expose_backend_header": True,
                "lora": {"refresh": REFRESH},
            }
        )
        yield {"a": a, "b": b, "router": router}
    finally:
        c.close()
        kube.close()


def loaded(row: dict[str, Any]) -> list[str]:
    return list(((row.get("engine") or {}).get("lora") or {}).get("loaded") or [])


def test_models_auto_learns_adapters_from_v1_models_and_routes_them(
    fleet: dict[str, Any],
) -> None:
    router, a, b = fleet["router"], fleet["a"], fleet["b"]
    wait_for(
        lambda: ADAPTER in loaded(admin_backends(router).get(a.url, {})),
        "the router learns a's adapter from its /v1/models",
        LEARN_WITHIN,
    )

    def both_healthy() -> bool:
        rows = admin_backends(router)
        return len(rows) == 2 and all(row["healthy"] for row in rows.values())

    wait_for(both_healthy, "both discovered engines are healthy", LEARN_WITHIN)

    # The adapter is learned, not turned into a backend: two backends, each with the base model
    # only (models: auto keeps the base), and only a lists the adapter.
    rows = admin_backends(router)
    assert set(rows) == {a.url, b.url}
    for row in rows.values():
        assert row["source"] == "kubernetes"
        assert row["models"] == {MODEL: MODEL}
    assert loaded(rows[b.url]) == []

    client = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    listed = {m.id for m in client.models.list()}
    assert {MODEL, ADAPTER} <= listed

    # Requests for the adapter are routed to the engine that serves it, and answered there.
    for _ in range(6):
        raw = client.chat.completions.with_raw_response.create(
            model=ADAPTER, messages=[{"role": "user", "content": "select"}], max_tokens=2
        )
        assert raw.headers["x-sluicegate-backend"] == backend_name(rows[a.url])
        resp = raw.parse()
        assert resp.model == ADAPTER
        assert resp.choices[0].message.content
    assert [r["model"] for r in stats(a)["recent"]][-6:] == [ADAPTER] * 6
    assert ADAPTER not in [r["model"] for r in stats(b)["recent"]]

    # The base model still routes to both discovered engines.
    seen = set()
    for _ in range(12):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        seen.add(raw.headers["x-sluicegate-backend"])
    assert seen == {backend_name(rows[a.url]), backend_name(rows[b.url])}


def test_an_adapter_loaded_and_unloaded_at_run_time_is_learned_and_forgotten(
    fleet: dict[str, Any], tmp_path: Path
) -> None:
    router, b = fleet["router"], fleet["b"]
    client = OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)
    r = httpx.post(
        b.url + "/v1/load_lora_adapter",
        json={"lora_name": "chat", "lora_path": str(tmp_path)},
        timeout=5,
    )
    assert r.status_code == 200, r.text
    wait_for(
        lambda: "chat" in loaded(admin_backends(router)[b.url]),
        "the router re-reads b's /v1/models",
        LEARN_WITHIN,
    )
    assert admin_backends(router)[b.url]["models"] == {MODEL: MODEL}
    raw = client.chat.completions.with_raw_response.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.headers["x-sluicegate-backend"] == backend_name(admin_backends(router)[b.url])
    assert raw.parse().model == "chat"

    gone = httpx.post(b.url + "/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=5)
    assert gone.status_code == 200, gone.text
    wait_for(
        lambda: "chat" not in {m.id for m in client.models.list()},
        "the router forgets the unloaded adapter",
        LEARN_WITHIN,
    )
    with pytest.raises(NotFoundError):
        client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )


def backend_name(row: dict[str, Any]) -> str:
    return str(row["name"])
