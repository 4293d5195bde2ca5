"""A third-party balancer from `examples/`, really installed (into a directory the router sees
on its path) and selected by name, routing real traffic, with the local and the Redis store."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.harness import ROOT, STARVED_S, Cluster, Proc, backend, control, stats

EXAMPLE = ROOT / "examples" / "sluicegate-priority"


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("plugin")
    src = work / "src"
    shutil.copytree(EXAMPLE, src)  # build in a copy: no build/ or egg-info left in the repo
    target = work / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        timeout=120,
        capture_output=True,
    )
    return target


def env_with(plugin_path: Path) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(plugin_path), str(ROOT)])}


def test_installed_plugin_is_listed_by_name(plugin_path: Path) -> None:
    code = (
        "from balancers import available, balancer_class; print(available()); "
        "print(balancer_class('priority').__module__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env_with(plugin_path)},
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "'priority'" in out and "sluicegate_priority" in out
    bare = subprocess.run(
        [sys.executable, "-c", "from balancers import available; print(available())"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "priority" not in bare  # it is the installation that makes it appear


@pytest.fixture(scope="module")
def mocks(module_procs: Cluster) -> dict[str, Proc]:
    return {n: module_procs.mock(n, tokens=4) for n in ("primary", "overflow")}


def requests_by(mocks: dict[str, Proc]) -> dict[str, int]:
    return {n: int(stats(m)["requests"]) for n, m in mocks.items()}


@pytest.mark.parametrize("store", ["local", "redis"])
def test_router_routes_through_the_plugin(
    store: str, plugin_path: Path, procs: Cluster, mocks: dict[str, Proc]
) -> None:
    for m in mocks.values():
        control(m, reset_stats=True, itl_ms=0, fail_status=0)
    env = env_with(plugin_path)
    if store == "redis":
        env["SLUICEGATE_REDIS_URL"] = procs.redis().url
    router = procs.router(
        {
            "backends": [
                backend("primary", mocks["primary"], max_inflight=1),
                backend("overflow", mocks["overflow"]),
            ],
            "balancer": "round_robin",
            "model_balancers": {"m": "priority"},
        },
        env=env,
    )
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="k", max_retries=0)

    def ask() -> str:
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        return r.choices[0].message.content or ""

    for _ in range(5):
        assert ask() == "tok0 tok1 "
    assert requests_by(mocks) == {"primary": 5, "overflow": 0}
    # The primary is full while a stream holds its one slot: the plugin spills to the next.
    control(mocks["primary"], itl_ms=100)
    held = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=200
    )
    next(iter(held))
    try:
        for _ in range(3):
            assert ask() == "tok0 tok1 "
        assert requests_by(mocks) == {"primary": 6, "overflow": 3}
    finally:
        held.close()
    rows = httpx.get(router.url + "/admin/backends", timeout=STARVED_S).json()
    assert {r["inflight_store"] for r in rows} == {store}
    # Its bare Candidate reaches the request path as a Choice made by load.
    routed = [
        line
        for line in httpx.get(router.url + "/metrics", timeout=STARVED_S).text.splitlines()
        if line.startswith("sluicegate_routing_decisions_total{")
    ]
    assert routed and all('balancer="priority"' in r and 'reason="load"' in r for r in routed)
    assert sum(float(r.rsplit(" ", 1)[1]) for r in routed) == 9
    client.close()


def test_unknown_balancer_stops_startup_naming_the_field(procs: Cluster) -> None:
    path = procs.write_config(
        {
            "backends": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}],
            "model_balancers": {"m": "priority"},  # not installed in this environment
        }
    )
    run = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(path), "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "model_balancers" in lines[0]
    assert "unknown balancer 'priority'" in lines[0] and "least_inflight" in lines[0]
