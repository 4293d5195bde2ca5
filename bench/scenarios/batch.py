"""The Batch API in idle capacity (`python -m bench.run --only batch`).

One mock engine with `SLOTS` batch slots (vLLM's max_num_seqs: more requests wait in its queue),
32-token answers. Measured, each for `seconds`:
1. capacity: the engine flat out (2 x SLOTS clients through the router): its tokens/s;
2. idle: one interactive streaming client alone: its TTFT p50/p90 (the idle fleet's);
3. sluicegate batch: a job of many lines through the Batch API (`per_engine` SLOTS - 1: one
   slot left for interactive requests), the interactive client alongside: the batch's tokens/s
   over capacity (the fill ratio) and the interactive TTFT;
4. fixed concurrency: the same lines sent at a fixed concurrency (`FIXED`, what LiteLLM's batch
   runner does whatever the fleet is doing), the interactive client alongside: the same figures.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from bench.kit.stats import pct
from tests.support.harness import Cluster, Proc, control

SLOTS = 8
TOKENS = 32
FIXED = 16
CHAT = "/v1/chat/completions"


def _body(i: int, stream: bool = False, model: str = "m", **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"q{i}"}],
        "max_tokens": TOKENS,
        "stream": stream,
        **extra,
    }


async def _interactive(url: str, seconds: float, **body: Any) -> list[float]:
    """One streaming client, closed loop with a 50 ms pause: TTFT (first body byte) samples."""
    out: list[float] = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        i = 0
        while loop.time() < end:
            t = time.perf_counter()
            first = None
            async with h.stream("POST", CHAT, json=_body(i, True, **body)) as r:
                async for _ in r.aiter_raw():
                    if first is None:
                        first = time.perf_counter() - t
            if first is not None:
                out.append(first)
            i += 1
            await asyncio.sleep(0.05)
    return out


async def _fixed(url: str, seconds: float, clients: int, **body: Any) -> int:
    """`clients` senders, each one request after another: completion tokens answered."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    done = 0

    async def one(h: httpx.AsyncClient, k: int) -> None:
        nonlocal done
        i = k
        while loop.time() < end:
            r = await h.post(CHAT, json=_body(i, **body))
            if r.status_code == 200:
                done += int(r.json()["usage"]["completion_tokens"])
            i += clients

    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as h:
        await asyncio.gather(*(one(h, k) for k in range(clients)))
    return done


def _ttft(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": pct(samples, 0.5) * 1000,
        "p90_ms": pct(samples, 0.9) * 1000,
        "n": len(samples),
    }


async def _with_batch(
    url: str, seconds: float, lines: int, **body: Any
) -> tuple[list[float], float]:
    """A job of `lines` through the Batch API and the interactive client: TTFT samples and the
    batch's completion tokens/s over the interactive client's time."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as h:
        data = b"".join(
            json.dumps(
                {"custom_id": f"b{i}", "method": "POST", "url": CHAT, "body": _body(i, **body)}
            ).encode()
            + b"\n"
            for i in range(lines)
        )
        f = await h.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
        job = await h.post(
            "/v1/batches",
            json={"input_file_id": f.json()["id"], "endpoint": CHAT, "completion_window": "24h"},
        )
        job_id = job.json()["id"]

        async def done() -> int:
            r = await h.get(f"/v1/batches/{job_id}")
            return int(r.json()["request_counts"]["completed"])

        await asyncio.sleep(1.0)  # the runner's first lines are in flight
        before, t0 = await done(), time.perf_counter()
        samples = await _interactive(url, seconds, **body)
        after, t1 = await done(), time.perf_counter()
        await h.post(f"/v1/batches/{job_id}/cancel")
    return samples, (after - before) * TOKENS / (t1 - t0)


def run(c: Cluster, quick: bool) -> dict[str, Any]:
    seconds = 8.0 if quick else 30.0
    engine = c.mock("batch-engine", ttft_ms=30, itl_ms=5, tokens=TOKENS)
    control(engine, max_running=SLOTS)
    redis = c.redis()
    router: Proc = c.router(
        {
            "backends": [{"name": "e", "url": engine.url, "models": {"m": "mock-model"}}],
            "redis_url": redis.url,
            "batch": {"storage_dir": str(c.tmp / "batch"), "per_engine": SLOTS - 1, "tick": 0.1},
        },
        env={"SLUICEGATE_LOG_LEVEL": "warning"},
    )
    capacity = asyncio.run(_fixed(router.url, seconds, 2 * SLOTS)) / seconds
    idle = asyncio.run(_interactive(router.url, seconds))
    lines = int(capacity / TOKENS * seconds * 3) + 100  # more than the window can finish
    ours, ours_tps = asyncio.run(_with_batch(router.url, seconds, lines))

    async def fixed_beside() -> tuple[list[float], int]:
        samples, tokens = await asyncio.gather(
            _interactive(router.url, seconds), _fixed(router.url, seconds, FIXED)
        )
        return samples, tokens

    theirs, theirs_tokens = asyncio.run(fixed_beside())
    return {
        "slots": SLOTS,
        "fixed_concurrency": FIXED,
        **_compared(seconds, capacity, idle, (ours, ours_tps), (theirs, theirs_tokens)),
    }


def _compared(
    seconds: float,
    capacity: float,
    idle: list[float],
    ours: tuple[list[float], float],
    theirs: tuple[list[float], int],
) -> dict[str, Any]:
    """The three runs' figures: idle TTFT, ours (TTFT, tokens/s) and the fixed runner's."""
    (ours_ttft, ours_tps), (theirs_ttft, theirs_tokens) = ours, theirs
    return {
        "seconds": seconds,
        "tokens": TOKENS,
        "capacity_tps": capacity,
        "idle": _ttft(idle),
        "sluicegate": {**_ttft(ours_ttft), "fill": ours_tps / capacity, "tps": ours_tps},
        "fixed": {
            **_ttft(theirs_ttft),
            "fill": theirs_tokens / seconds / capacity,
            "tps": theirs_tokens / seconds,
        },
    }


def _rows(r: dict[str, Any], *, tps: bool) -> list[str]:
    rows = []
    for name, label in (
        ("idle", "idle fleet"),
        ("sluicegate", "sluicegate Batch API"),
        ("fixed", f"fixed concurrency {r['fixed_concurrency']}"),
    ):
        x = r[name]
        cells = [f"{x['p50_ms']:.1f}", f"{x['p90_ms']:.1f}"]
        if tps:
            cells.append(f"{x['tps']:.0f}" if "tps" in x else "-")
        cells.append(f"{x['fill']:.2f}" if "fill" in x else "-")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows


def section(r: dict[str, Any], date: str) -> list[str]:
    rows = _rows(r, tps=False)
    return [
        "## Batch: filling idle capacity",
        "",
        f"One mock engine with {r['slots']} slots, {r['tokens']}-token answers, flat out "
        f"{r['capacity_tps']:.0f} tokens/s; one interactive streaming client for "
        f"{r['seconds']:.0f} s alone, beside a Batch API job, and beside the same lines sent at a "
        "fixed concurrency (what LiteLLM's runner does). Fill: the batch's tokens/s over the "
        f"engine's flat-out tokens/s (bench/scenarios/batch.py, {date}).",
        "",
        "| batch | interactive TTFT p50 ms | p90 ms | fill |",
        "|---|---|---|---|",
        *rows,
    ]


# --- the same against the real vLLM engines (`--only batch_real`) ------------------------------

REAL_SLOTS = 8  # requests in flight per engine (its backend's max_inflight)
# Batch lines per engine: half the slots. At 6 (two left) a CPU engine's step, which grows with
# its batch, slowed interactive TTFT past the budget (68.6 ms against idle 29.4).
REAL_PER_ENGINE = 4


def run_real(c: Cluster, quick: bool) -> dict[str, Any]:
    """The four measurements of `run` against two real vLLM engines (router/tools/enginefleet/,
    one per core, the tiny random-weight Llama), every answer TOKENS tokens (`ignore_eos`), with
    admission on and REAL_SLOTS slots per engine: flat out is 2 x REAL_SLOTS clients."""
    from router.tools.enginefleet.fleet import EngineOptions, Fleet
    from router.tools.enginefleet.install import engine_home, ensure_venv
    from router.tools.enginefleet.model import write_model

    seconds = 8.0 if quick else 20.0
    home = engine_home()
    fleet = Fleet(ensure_venv(home), write_model(home / "models"), count=2, options=EngineOptions())
    try:
        fleet.start()
        model = fleet.engines[0].model
        body = {"model": model, "ignore_eos": True, "temperature": 0}
        redis = c.redis()
        router = c.router(
            {
                "backends": [{**b, "max_inflight": REAL_SLOTS} for b in fleet.backends()],
                "redis_url": redis.url,
                "engine_metrics": {"interval": 0.1, "timeout": 2.0, "stale_after": 2.0},
                "admission": {"max_wait": 60},
                "batch": {
                    "storage_dir": str(c.tmp / "batch-real"),
                    "per_engine": REAL_PER_ENGINE,
                    "tick": 0.1,
                },
            },
            env={"SLUICEGATE_LOG_LEVEL": "warning"},
        )
        asyncio.run(_fixed(router.url, 2.0, 4, **body))  # warm: first requests compile paths
        flat = 2 * REAL_SLOTS
        capacity = asyncio.run(_fixed(router.url, seconds, flat, **body)) / seconds
        idle = asyncio.run(_interactive(router.url, seconds, **body))
        lines = int(capacity / TOKENS * seconds * 3) + 100
        ours, ours_tps = asyncio.run(_with_batch(router.url, seconds, lines, **body))

        async def fixed_beside() -> tuple[list[float], int]:
            return await asyncio.gather(
                _interactive(router.url, seconds, **body),
                _fixed(router.url, seconds, flat, **body),
            )

        theirs, theirs_tokens = asyncio.run(fixed_beside())
    finally:
        fleet.stop()
    return {
        "slots": REAL_SLOTS,
        "per_engine": REAL_PER_ENGINE,
        "fixed_concurrency": flat,
        **_compared(seconds, capacity, idle, (ours, ours_tps), (theirs, theirs_tokens)),
    }


def section_real(r: dict[str, Any], date: str) -> list[str]:
    rows = _rows(r, tps=True)
    return [
        "## Batch on real vLLM engines",
        "",
        f"Two real vLLM engines (CPU build, the tiny random-weight Llama, one per core), "
        f"{r['slots']} slots each, batch lines {r['per_engine']} per engine, "
        f"{r['tokens']}-token answers; flat out ({r['fixed_concurrency']} clients) "
        f"{r['capacity_tps']:.0f} tokens/s. One interactive streaming client for "
        f"{r['seconds']:.0f} s alone, beside a Batch API job, and beside the same lines at a "
        "fixed concurrency. One run on a 2-core machine shared with other work: compare within "
        f"the run (bench/scenarios/batch.py `run_real`, `--only batch_real`, {date}).",
        "",
        "| batch | interactive TTFT p50 ms | p90 ms | batch tokens/s | fill |",
        "|---|---|---|---|---|",
        *rows,
    ]
