"""Prefill/decode disaggregation on 2 real vLLM engines, against the same 2 engines unified.

    python -m bench.oneoff.pd_engine [--requests 48] [--workers 4]    # ~4 minutes; one run

The larger dummy model (router/tools/enginefleet/model.py `larger`: hidden 1024, 4 layers, where a
1500-token prefill costs ~0.85 s of a core) on two engines, one per core, with NixlConnector as
`kv_both` (so both targets run on the very same engines, started once). Targets, one after the
other, each with its own prompts (a salt per target, so neither finds the other's blocks):
- `unified`: sluicegate (`cache_aware`) over both engines as `both`: every engine prefills and
  decodes whatever it gets;
- `disaggregated`: the same router with engine 0 as `prefill` and engine 1 as `decode`: long
  prompts are prefilled on engine 0 and their KV moved over NIXL; short ones go to engine 1.
Workload: WORKERS client threads, each sending streamed completions in turn, LONG_SHARE of them
with a ~1500-token prompt and the rest ~40 tokens, MAX_TOKENS tokens each (`ignore_eos`).
Measured per target and prompt kind: TTFT (sent to the first token, client side) and TPOT
(the answer's later tokens' mean gap) p50/p90; and for the split target, the decode engine's
own count of prompt tokens handed over. One run; compare within it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.kit.stats import pct
from tests.support.harness import Cluster

LONG_TOKENS, SHORT_TOKENS = 1500, 40
LONG_SHARE = 0.3
MAX_TOKENS = 48
WORKERS = 4
REQUESTS = 48  # per target
EXTERNAL = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"


def _stream(url: str, model: str, prompt: str) -> tuple[float, float] | None:
    """(TTFT, TPOT) of one streamed completion, client side; None when it failed."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    times: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        if r.status_code != 200:
            return None
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    if len(times) < 2:
        return None
    return times[0] - sent, (times[-1] - times[0]) / (len(times) - 1)


def _external(engine_url: str) -> float:
    from tests_engine.support import metrics_of

    return metrics_of(httpx.get(engine_url + "/metrics", timeout=10).content).get(EXTERNAL, 0.0)


def _load(url: str, model: str, prompts: list[tuple[str, str]], workers: int) -> dict[str, Any]:
    results: dict[str, list[tuple[float, float]]] = {"long": [], "short": []}
    failed = 0
    lock = threading.Lock()
    queue = list(prompts)

    def work() -> None:
        nonlocal failed
        while True:
            with lock:
                if not queue:
                    return
                kind, prompt = queue.pop()
            got = _stream(url, model, prompt)
            with lock:
                if got is None:
                    failed += 1
                else:
                    results[kind].append(got)

    began = time.monotonic()
    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out: dict[str, Any] = {"seconds": round(time.monotonic() - began, 1), "failed": failed}
    for kind, rows in results.items():
        ttft, tpot = [r[0] for r in rows], [r[1] for r in rows]
        out[kind] = {
            "n": len(rows),
            "ttft_p50_ms": round(1000 * pct(ttft, 0.5), 1),
            "ttft_p90_ms": round(1000 * pct(ttft, 0.9), 1),
            "tpot_p50_ms": round(1000 * pct(tpot, 0.5), 2),
            "tpot_p90_ms": round(1000 * pct(tpot, 0.9), 2),
            "tpot_mean_ms": round(1000 * statistics.fmean(tpot), 2) if tpot else None,
        }
    return out


def run(requests: int = REQUESTS, workers: int = WORKERS) -> dict[str, Any]:
    from router.tools.enginefleet.fleet import EngineOptions, Fleet
    from router.tools.enginefleet.install import engine_home, ensure_venv, nixl_dir
    from router.tools.enginefleet.model import write_model
    from tests_engine.support import Words

    home = engine_home()
    python = ensure_venv(home)
    model_dir = write_model(home / "models", size="larger")
    fleet = Fleet(python, model_dir, 2, EngineOptions(nixl=nixl_dir(home)))
    cluster = Cluster()
    out: dict[str, Any] = {"model": "larger (hidden 1024, 4 layers)", "workers": workers}
    try:
        started = time.monotonic()
        fleet.start()
        out["engines_start_s"] = round(time.monotonic() - started, 1)
        p, d = fleet.engines
        model = p.model
        rng = random.Random(29)  # the same mix, in the same order, for both targets
        kinds = ["long" if rng.random() < LONG_SHARE else "short" for _ in range(requests)]
        for seed, target in enumerate(("unified", "disaggregated"), 2950):
            words = Words(fleet, seed=seed)
            prompts = [(k, words.text(LONG_TOKENS if k == "long" else SHORT_TOKENS)) for k in kinds]
            roles = ("both", "both") if target == "unified" else ("prefill", "decode")
            backends = [
                {
                    "name": f"engine-{e.index}",
                    "url": e.url,
                    "kind": "vllm",
                    "models": {model: model},
                    "role": role,
                    "kv_events": {},
                }
                for e, role in zip(fleet.engines, roles, strict=True)
            ]
            router = cluster.router(
                {
                    "balancer": "cache_aware",
                    "affinity": {"tokenizers": {model: {"via": "router", "path": str(model_dir)}}},
                    "backends": backends,
                    "engine_metrics": {"interval": 0.1, "timeout": 10.0, "stale_after": 30.0},
                    "disaggregation": {"connector": "nixl", "min_uncached_tokens": 512},
                },
                env={"SLUICEGATE_LOG_LEVEL": "warning"},
            )
            _stream(router.url, model, "warm up")  # the router's first request pays its imports
            before = _external(d.url)
            out[target] = _load(router.url, model, prompts, workers)
            out[target]["handed_over_tokens"] = _external(d.url) - before
            router.stop(grace=5)
            print(target, json.dumps(out[target]), flush=True)
    finally:
        cluster.close()
        fleet.stop()
    return out


def markdown(res: dict[str, Any]) -> str:
    rows = [
        "| target | prompt | n | TTFT p50 (ms) | TTFT p90 (ms) | TPOT p50 (ms) | TPOT p90 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for target in ("unified", "disaggregated"):
        for kind in ("long", "short"):
            r = res[target][kind]
            rows.append(
                f"| {target} | {kind} | {r['n']} | {r['ttft_p50_ms']} | {r['ttft_p90_ms']} | "
                f"{r['tpot_p50_ms']} | {r['tpot_p90_ms']} |"
            )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=REQUESTS, help="per target")
    ap.add_argument("--workers", type=int, default=WORKERS)
    ap.add_argument("--json", help="write the results there too")
    args = ap.parse_args()
    res = run(args.requests, args.workers)
    print(markdown(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
