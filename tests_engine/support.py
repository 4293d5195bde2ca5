"""Helpers for tests against real vLLM engines: their metrics, waits, routers in front of them.

Every wait is bounded and says what it waited for when it gives up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.enginefleet.fleet import Engine, Fleet
from tests.harness import Cluster, Proc


def metrics(engine: Engine) -> dict[str, float]:
    """The engine's `vllm:*` samples, summed over labels (`name` or `name{label=value}` too).

    Counters appear under their sample name (`vllm:prompt_tokens_total`).
    """
    text = httpx.get(engine.metrics_url, timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("vllm:"):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
            for k, v in s.labels.items():
                if k not in ("engine", "model_name"):
                    key = f"{s.name}{{{k}={v}}}"
                    out[key] = out.get(key, 0.0) + s.value
    return out


def cache_config(engine: Engine) -> dict[str, str]:
    """The labels of `vllm:cache_config_info` (block_size, num_gpu_blocks, ...)."""
    text = httpx.get(engine.metrics_url, timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            return dict(family.samples[0].labels)
    raise AssertionError("no vllm:cache_config_info on the engine")


def kv_capacity_blocks(engine: Engine) -> tuple[int, int]:
    """(blocks, block_size) the engine reports."""
    info = cache_config(engine)
    return int(info["num_gpu_blocks"]), int(info["block_size"])


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> float:
    """Seconds until `check()` held; AssertionError naming `what` after `timeout_s`."""
    start = time.monotonic()
    while True:
        if check():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s:.1f} s: {what}")
        time.sleep(step_s)


def running(engine: Engine) -> float:
    return metrics(engine).get("vllm:num_requests_running", 0.0)


def wait_idle(engines: Iterable[Engine], timeout_s: float = 60.0) -> None:
    """Nothing running or waiting on any of `engines` (what a previous test left finishes)."""
    for e in engines:

        def idle(e: Engine = e) -> bool:
            m = metrics(e)
            return (
                m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0
            )

        wait_for(f"engine {e.index} idle", idle, timeout_s, 0.2)


def ensure_healthy(fleet: Fleet, timeout_s: float = 240.0) -> None:
    """Every engine up and healthy: one a previous test killed (and failed to restore) restarts."""
    for e in fleet.engines:
        if not e.alive() or not e.healthy():
            e.restart(wait=False)
    for e in fleet.engines:
        e.wait_ready(timeout_s)


def backends(
    fleet: Fleet, engines: Iterable[Engine] | None = None, **extra: Any
) -> list[dict[str, Any]]:
    """sluicegate `backends:` entries for `engines` (default: the whole fleet)."""
    chosen = list(engines if engines is not None else fleet.engines)
    return [
        {
            "name": f"engine-{e.index}",
            "url": e.url,
            "kind": "vllm",
            "models": {e.model: e.model},
            **extra,
        }
        for e in chosen
    ]


def start_router(
    cluster: Cluster,
    fleet: Fleet,
    config: dict[str, Any] | None = None,
    engines: Iterable[Engine] | None = None,
    env: dict[str, str] | None = None,
) -> Proc:
    """A real sluicegate (uvicorn subprocess) in front of `engines`, up and answering.

    `config` is merged over a base that routes the fleet's model to the engines, scrapes their
    metrics every 0.1 s and probes their health every 0.5 s.
    """
    base: dict[str, Any] = {
        "backends": backends(fleet, engines),
        "engine_metrics": {"interval": 0.1, "timeout": 2.0, "stale_after": 2.0},
        "health": {"interval": 0.5},
    }
    return cluster.router({**base, **(config or {})}, env=env)
