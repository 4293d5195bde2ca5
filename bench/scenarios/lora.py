"""LoRA adapter-aware routing against `least_load` (`python -m bench.run --only lora`).

4 mock vLLM engines with LoRA (`--max-loras 2`: two adapters run at once; all 12 adapters are
registered on every engine, as `--lora-modules` keeps them in CPU memory), 12 adapters requested
with Zipf popularity (s = 1: adapter i in proportion to 1 / (i + 1)). Moving an adapter into one
of an engine's slots costs `SLOT_MS` in that engine's step (the mock counts these loads), and a
request whose adapter is not among the two running ones waits, as vLLM's scheduler makes it.
Two routers over the same engines, in alternating rounds (ROUNDS each, so noise from the rest
of the machine falls on both alike), each under the same closed loop of `CLIENTS` streaming
clients, 20 s per router in all (10 s quick):
- `least_load`: the adapters configured as plain model names of every backend (what sluicegate
  did before it knew adapters): the choice weighs engine load only;
- `adapter_aware`: the backends name only the base model; the router learns the adapters from
  each engine's `/v1/models` and weighs `vllm:lora_requests_info` (balancers/lora.py).
Reported: TTFT p50/p90 (first content byte at the client), slot loads per 1,000 requests and the
ratios adapter_aware / least_load.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx

from tests.support.harness import Cluster, Proc

ADAPTERS = 12
ENGINES = 4
CLIENTS = 24
SLOT_MS = 40.0
TOKENS = 16
ROUNDS = 4  # per router, alternating


def zipf(n: int, s: float = 1.0) -> list[float]:
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    total = sum(weights)
    return [w / total for w in weights]


async def _load(url: str, seconds: float, seed: int) -> tuple[list[float], int, int]:
    names = [f"a{i}" for i in range(ADAPTERS)]
    weights = zipf(ADAPTERS)
    rng = random.Random(seed)
    ttft: list[float] = []
    errors = 0
    end = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def user() -> None:
            nonlocal errors
            while time.monotonic() < end:
                model = rng.choices(names, weights)[0]
                body = {
                    "model": model,
                    "stream": True,
                    "max_tokens": TOKENS,
                    "messages": [{"role": "user", "content": "hello " * 8}],
                }
                started = time.perf_counter()
                first: float | None = None
                try:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        async for chunk in r.aiter_raw():
                            if first is None and b'"content"' in chunk:
                                first = time.perf_counter() - started
                        if r.status_code != 200:
                            errors += 1
                            continue
                except httpx.HTTPError:
                    errors += 1
                    continue
                if first is not None:
                    ttft.append(first)

        await asyncio.gather(*(user() for _ in range(CLIENTS)))
    return ttft, len(ttft), errors


def _slot_loads(mocks: list[Proc]) -> int:
    return sum(int(httpx.get(m.url + "/stats", timeout=5).json()["lora_loads"]) for m in mocks)


def _p(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def run(cluster: Cluster, quick: bool) -> dict[str, Any]:
    seconds = 10.0 if quick else 20.0
    tmp = cluster.tmp / "lora-adapters"
    tmp.mkdir(exist_ok=True)
    modules = []
    for i in range(ADAPTERS):
        (tmp / f"a{i}").mkdir(exist_ok=True)
        modules.append(f"a{i}={tmp / f'a{i}'}")
    args = ["--engine", "--max-loras", "2", "--max-num-seqs", "16", "--decode-ms", "4"]
    args += [
        "--decode-ms-per-seq",
        "0.25",
        "--lora-slot-ms",
        str(SLOT_MS),
        "--lora-modules",
        *modules,
    ]
    mocks = [cluster.mock(f"e{i}", tokens=TOKENS, engine_args=args) for i in range(ENGINES)]
    common: dict[str, Any] = {
        "balancer": "least_load",
        "engine_metrics": {"interval": 0.05, "timeout": 0.5, "stale_after": 1.0},
        "health": {"interval": 60},
        "lora": {"refresh": 0.5},
    }
    plain = {f"a{i}": f"a{i}" for i in range(ADAPTERS)}
    configs = {
        "least_load": [
            {"name": f"e{i}", "url": m.url, "kind": "vllm", "models": {"m": "mock-model", **plain}}
            for i, m in enumerate(mocks)
        ],
        "adapter_aware": [
            {"name": f"e{i}", "url": m.url, "kind": "vllm", "models": {"m": "mock-model"}}
            for i, m in enumerate(mocks)
        ],
    }
    out: dict[str, Any] = {
        "engines": ENGINES,
        "max_loras": 2,
        "adapters": ADAPTERS,
        "clients": CLIENTS,
        "seconds": seconds,
        "slot_ms": SLOT_MS,
    }
    routers = {
        name: cluster.router({**common, "backends": b}, env={"SLUICEGATE_LOG_LEVEL": "warning"})
        for name, b in configs.items()
    }
    deadline = time.monotonic() + 10  # the adapter-aware router learns them from /v1/models
    while time.monotonic() < deadline:
        listed = httpx.get(routers["adapter_aware"].url + "/v1/models", timeout=5).json()["data"]
        if len(listed) > ADAPTERS:
            break
        time.sleep(0.1)
    ttfts: dict[str, list[float]] = {n: [] for n in routers}
    counts = dict.fromkeys(routers, 0)
    errors = dict.fromkeys(routers, 0)
    loads = dict.fromkeys(routers, 0)
    for router in routers.values():  # warm-up: pools, slots
        asyncio.run(_load(router.url, 1.5, seed=1))
    # Short rounds, alternating: the machine's noise (other processes) falls on both alike.
    for i in range(ROUNDS):
        for name, router in routers.items():
            before = _slot_loads(mocks)
            ttft, ok, err = asyncio.run(_load(router.url, seconds / ROUNDS, seed=2 + i))
            loads[name] += _slot_loads(mocks) - before
            ttfts[name] += ttft
            counts[name] += ok
            errors[name] += err
    for name in routers:
        out[name] = {
            "requests": counts[name],
            "errors": errors[name],
            "ttft_p50_ms": 1000 * _p(ttfts[name], 50),
            "ttft_p90_ms": 1000 * _p(ttfts[name], 90),
            "slot_loads": loads[name],
            "loads_per_1k": 1000 * loads[name] / max(1, counts[name]),
        }
        print(f"lora {name}: " + json.dumps(out[name]), flush=True)
        routers[name].stop()
    a, b = out["adapter_aware"], out["least_load"]
    out["ttft_p90_ratio"] = a["ttft_p90_ms"] / b["ttft_p90_ms"] if b["ttft_p90_ms"] else None
    out["loads_per_1k_ratio"] = a["loads_per_1k"] / b["loads_per_1k"] if b["loads_per_1k"] else None
    for m in mocks:
        m.stop()
    return out


def section(r: dict[str, Any]) -> list[str]:
    rows = [("routing", "requests", "TTFT p50 ms", "TTFT p90 ms", "slot loads / 1k requests")]
    for name in ("least_load", "adapter_aware"):
        x = r[name]
        rows.append(
            (
                name,
                str(x["requests"]),
                f"{x['ttft_p50_ms']:.1f}",
                f"{x['ttft_p90_ms']:.1f}",
                f"{x['loads_per_1k']:.1f}",
            )
        )
    head = "| " + " | ".join(rows[0]) + " |"
    sep = "|" + "---|" * len(rows[0])
    body = ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return [
        "## LoRA adapters: adapter-aware routing against least_load",
        "",
        f"{r['engines']} mock engines with `max_loras` {r['max_loras']}, {r['adapters']} adapters "
        f"with Zipf popularity, {r['clients']} streaming clients for {r['seconds']:.0f} s per "
        f"router; moving an adapter into a slot costs {r['slot_ms']:.0f} ms of that engine's step "
        "(bench/scenarios/lora.py).",
        "",
        head,
        sep,
        *body,
        "",
        f"Ratios (adapter_aware / least_load): TTFT p90 {r['ttft_p90_ratio']:.2f}, "
        f"loads per 1,000 requests {r['loads_per_1k_ratio']:.2f}.",
        "",
    ]
