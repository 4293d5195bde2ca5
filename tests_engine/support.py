"""Helpers for tests against real vLLM engines: their metrics, waits, routers in front of them.

Every wait is bounded and says what it waited for when it gives up.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from router.tools.enginefleet.fleet import Engine, Fleet
from tests.support.harness import Cluster, Proc
from tests.support.wait import wait_for


def metrics(engine: Engine) -> dict[str, float]:
    """The engine's `vllm:*` samples, summed over labels (`name` or `name{label=value}` too).

    Counters appear under their sample name (`vllm:prompt_tokens_total`).
    """
    return metrics_of(httpx.get(engine.metrics_url, timeout=10).content)


def metrics_of(page: bytes) -> dict[str, float]:
    """`metrics()` of a page already fetched."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page.decode()):
        for s in family.samples:
            if not s.name.startswith("vllm:") or s.name.endswith("_created"):
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

        wait_for(idle, f"engine {e.index} idle", timeout_s, 0.2)


# How long a test waits for an engine a previous one left starting (about 30 s measured, 80 s on
# a loaded machine), before it is started once more on fresh ports.
RECOVER_TIMEOUT_S = 150.0


class FleetBroken(RuntimeError):
    """An engine that did not come back even on fresh ports: later tests fail at once."""


def ensure_healthy(fleet: Fleet, timeout_s: float = RECOVER_TIMEOUT_S) -> None:
    """Every engine up and healthy: one a previous test killed (and failed to start again)
    starts, and a running one is waited for (Fleet.ensure_up). One still not healthy after
    `timeout_s` is started once more on fresh ports; if that fails too the fleet is marked
    broken, so that every later test fails at once with the reason instead of waiting again."""
    if fleet.broken:
        raise FleetBroken(f"the engine fleet broke in an earlier test: {fleet.broken}")
    try:
        fleet.ensure_up(timeout_s)
        return
    except (TimeoutError, RuntimeError) as first:
        for e in fleet.engines:
            if e.alive() and e.healthy():
                continue
            try:
                e.restart_elsewhere(timeout_s)
            except (TimeoutError, RuntimeError) as again:
                fleet.broken = f"{first}; on fresh ports: {again}\n{e.log_tail()}"
                raise FleetBroken(fleet.broken) from again


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
    metrics every 0.1 s, probes their health every 0.5 s and names the engine that served each
    response in `x-sluicegate-backend`.
    """
    base: dict[str, Any] = {
        "backends": backends(fleet, engines),
        "expose_backend_header": True,  # x-sluicegate-backend: which engine served
        # Fresh for longer than a starved engine's slowest page takes (a stale reading is none).
        "engine_metrics": {"interval": 0.1, "timeout": 10.0, "stale_after": 30.0},
        "health": {"interval": 0.5},
    }
    return cluster.router({**base, **(config or {})}, env=env)


def router_metrics(router: Proc) -> dict[str, float]:
    """The router's `sluicegate_*` samples, summed over labels except `kind` and `reason`."""
    text = httpx.get(router.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("sluicegate_") or s.name.endswith("_created"):
                continue
            key = s.name
            for label in ("kind", "reason"):
                if label in s.labels:
                    key += f"{{{label}={s.labels[label]}}}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def rows(router: Proc) -> dict[str, dict[str, Any]]:
    """`/admin/backends` by backend name."""
    r = httpx.get(router.url + "/admin/backends", timeout=10)
    r.raise_for_status()
    return {row["name"]: row for row in r.json()}


class Words:
    """Prompts of a chosen length in the engines' own tokens, from a seeded word generator.

    Different seeds give prompts that share no prefix (so earlier tests' cache cannot help).
    """

    def __init__(self, fleet: Fleet, seed: int) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(fleet.engines[0].model_dir / "tokenizer.json"))
        self.rng = random.Random(seed)

    def tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def text(self, tokens: int) -> str:
        """About `tokens` tokens (never fewer) of words no other seed produces in this order."""
        words: list[str] = []
        while True:
            words += [
                "".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))
                for _ in range(max(8, (tokens - self.tokens(" ".join(words))) // 3))
            ]
            if self.tokens(" ".join(words)) >= tokens:
                break
        while len(words) > 1 and self.tokens(" ".join(words[:-1])) >= tokens:
            words.pop()
        return " ".join(words)


class DirectLoad:
    """Streams sent straight to one engine by curl processes (not through any router), kept at
    `streams` in flight until `stop()`: a Python client here would be CPU-bound before the engine.

    Each stream has its own prompt of `prompt_tokens`, so they share no KV blocks, and asks
    for `max_tokens` with `ignore_eos`. Everything runs in one process group, stopped by it;
    a curl killed mid-stream is a client disconnect, which the engine aborts.
    """

    def __init__(
        self,
        engine: Engine,
        words: Words,
        streams: int,
        prompt_tokens: int,
        max_tokens: int,
        workdir: Path,
    ) -> None:
        self.engine = engine
        lines = ["set -u"]
        for i in range(streams):
            body = workdir / f"load-{engine.index}-{i}.json"
            body.write_text(
                json.dumps(
                    {
                        "model": engine.model,
                        "prompt": words.text(prompt_tokens),
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                        "stream": True,
                        "temperature": 0,
                    }
                )
            )
            lines.append(
                "while :; do curl -sS -N -o /dev/null --max-time 120 -H 'content-type: "
                f"application/json' --data-binary @{body} {engine.url}/v1/completions; done &"
            )
        lines.append("wait")
        curl = shutil.which("curl")
        if curl is None:
            raise RuntimeError("curl is not installed")
        self.popen = subprocess.Popen(
            ["bash", "-c", "\n".join(lines)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            process_group=0,  # a group to kill, not a session (an autogroup: see fleet.py)
        )

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def __enter__(self) -> DirectLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
