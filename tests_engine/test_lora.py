"""LoRA on real vLLM: the mock's LoRA against vLLM's, adapter requests routed to the engine that
has the adapter, and an adapter unknown to the fleet loaded on demand and served.

The session's two engines run with `--enable-lora --max-loras 2 --max-lora-rank 8` and run-time
adapter loading from the start (conftest.py), so this module restarts nothing; it unloads what
it loaded when it ends. The adapters are random PEFT ones written locally
(router/tools/enginefleet/lora.py).
"""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from router.engine.parse import parse_lora
from router.tools.enginefleet.fleet import Engine, Fleet
from router.tools.enginefleet.lora import write_adapter
from tests.support.harness import Cluster, Proc
from tests.support.wait import wait_for
from tests_engine.conftest import LORA_ARGS
from tests_engine.support import ensure_healthy, router_metrics, rows, start_router


@pytest.fixture(scope="module")
def lora_fleet(
    engine_fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    adapters = tmp_path_factory.mktemp("adapters")
    model_dir = engine_fleet.engines[0].model_dir
    paths = {
        n: write_adapter(adapters, n, model_dir, seed=i) for i, n in enumerate(("sql", "chat", "x"))
    }
    assert set(LORA_ARGS) <= set(engine_fleet.options.extra_args)
    ensure_healthy(engine_fleet)
    try:
        # engine-0 holds `sql` (loaded at run time); engine-1 holds none.
        load(engine_fleet.engines[0], "sql", paths["sql"])
        yield {"fleet": engine_fleet, "paths": paths}
    finally:  # later modules see the engines as they were: no adapter loaded
        ensure_healthy(engine_fleet)
        for e in engine_fleet.engines:
            for name in set(listed(e.url)) & set(paths):
                r = httpx.post(
                    e.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30
                )
                assert r.status_code == 200, r.text


def load(engine: Engine, name: str, path: Path) -> httpx.Response:
    r = httpx.post(
        engine.url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r


def listed(url: str) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def lora_lines(url: str) -> list[str]:
    """The `vllm:lora_requests_info` sample lines of a /metrics page."""
    text = httpx.get(url + "/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{")]
    assert lines, "no vllm:lora_requests_info"
    return lines


def running_line(url: str, adapter: str, since: float) -> str | None:
    """The newest series naming `adapter` running, if one was set at or after `since`."""
    named = []
    for ln in lora_lines(url):
        found = parse_lora(("\n" + ln + "\n").encode())
        if found is not None and adapter in found[1]:
            named.append((float(ln.rsplit(" ", 1)[1]), ln))
    newest = max(named, default=None)
    return newest[1] if newest is not None and newest[0] >= since else None


def test_the_mock_speaks_vllms_lora(lora_fleet: dict[str, Any], procs: Cluster) -> None:
    fleet: Fleet = lora_fleet["fleet"]
    ensure_healthy(fleet)
    real = fleet.engines[1]
    mock = procs.mock(
        "lora-mock",
        engine_args=[
            "--engine",
            "--max-loras",
            "2",
            "--decode-ms",
            "20",
            "--served-model-name",
            real.model,
        ],
    )
    path = lora_fleet["paths"]["x"]
    answers: dict[str, list[tuple[int, Any]]] = {}
    for who, url in (("real", real.url), ("mock", mock.url)):
        got = []
        body = {"lora_name": "x", "lora_path": str(path)}
        for _ in range(2):  # the second is vLLM's "already loaded"
            r = httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=60)
            got.append((r.status_code, r.text if r.status_code == 200 else r.json()))
            got.append((0, r.headers.get("content-type")))
        entry = listed(url)["x"]
        got.append((0, (sorted(entry), entry["parent"], entry["root"], entry["object"])))
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=30)
        got.append((r.status_code, r.text))
        r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=30)
        got.append((r.status_code, r.json()))
        answers[who] = got
    assert answers["mock"] == answers["real"]
    # The metric: the same labels in the same order; while an adapter's request runs, the engine
    # sets (to the current time) a series that names it, and vLLM 0.32 lists it under both
    # running and waiting. Judged by that series' time, not by its being the newest at a poll:
    # a starved API server records a whole request's stats at once when it catches up, so the
    # newest series may already be the idle one by the time a poll is answered.
    for url in (real.url, mock.url):
        load_url = url + "/v1/load_lora_adapter"
        httpx.post(load_url, json={"lora_name": "x", "lora_path": str(path)}, timeout=60)
        try:
            begun = time.time()
            with httpx.stream(
                "POST",
                url + "/v1/completions",
                json={
                    "model": "x",
                    "prompt": "hello there",
                    "max_tokens": 1500,
                    "ignore_eos": True,  # random weights end early otherwise
                    "stream": True,
                },
                timeout=60,
            ) as stream:
                lines = stream.iter_lines()  # kept: dropping it closes the stream
                next(lines)
                # The stream is read meanwhile, so that the engine never waits on this client.
                line = None
                for n, _ in enumerate(lines):
                    if n % 20 == 0:
                        line = running_line(url, "x", since=begun)
                        if line is not None:
                            break
                else:
                    line = running_line(url, "x", since=begun)
            page = lora_lines(url)
            assert line is not None, f"{url}: no series named the adapter running: {page}"
            assert re.findall(r'(\w+)="', line) == [
                "max_lora",
                "running_lora_adapters",
                "waiting_lora_adapters",
            ], line
            found = parse_lora(("\n" + line + "\n").encode())
            assert found is not None and found[0] == 2, line
            assert 'waiting_lora_adapters="x"' in line and 'running_lora_adapters="x"' in line
        finally:  # the next tests expect engine-1 without it
            httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=30)


def ask(router: Proc, model: str, content: str = "hello") -> httpx.Response:
    return httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4},
        timeout=60,
    )


def test_adapter_requests_land_on_the_engine_that_has_it(
    lora_fleet: dict[str, Any], procs: Cluster
) -> None:
    fleet: Fleet = lora_fleet["fleet"]
    ensure_healthy(fleet)
    router = start_router(procs, fleet, {"balancer": "least_load", "lora": {"refresh": 0.3}})
    wait_for(
        lambda: (
            "sql"
            in ((rows(router)["engine-0"]["engine"] or {}).get("lora") or {}).get("loaded", [])
        ),
        "the router reads engine-0's adapters",
        30.0,
    )
    assert "sql" not in rows(router)["engine-1"]["engine"]["lora"]["loaded"]
    client = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    for i in range(8):
        raw = client.chat.completions.with_raw_response.create(
            model="sql", messages=[{"role": "user", "content": f"query {i}"}], max_tokens=4
        )
        assert raw.headers["x-sluicegate-backend"] == "engine-0"
        assert raw.parse().model == "sql"
    assert {ask(router, fleet.options.model_name, f"b{i}").status_code for i in range(4)} == {200}


def test_an_adapter_unknown_to_the_fleet_is_loaded_on_demand(
    lora_fleet: dict[str, Any], procs: Cluster
) -> None:
    fleet: Fleet = lora_fleet["fleet"]
    ensure_healthy(fleet)
    lora = {
        "load_on_demand": True,
        "sources": {"chat": str(lora_fleet["paths"]["chat"])},
        "base_model": fleet.options.model_name,
        "refresh": 0.3,
    }
    router = start_router(procs, fleet, {"balancer": "least_load", "lora": lora})
    assert all("chat" not in listed(e.url) for e in fleet.engines)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: ask(router, "chat", f"c{i}"), range(4)))
    assert [r.status_code for r in answers] == [200] * 4, answers[0].text
    where = {r.headers["x-sluicegate-backend"] for r in answers}
    assert len(where) == 1, where  # the concurrent requests waited for one load
    holder = next(e for e in fleet.engines if f"engine-{e.index}" in where)
    assert listed(holder.url)["chat"]["parent"] == fleet.options.model_name
    assert router_metrics(router)["sluicegate_lora_loads_total"] == 1
