"""sluicegate in front of 2 real vLLM engines (`python -m bench.run --only real`, ~3-5 minutes).

Two real engines (vLLM's CPU build, the tiny random-weight Llama the project writes; see
router/tools/enginefleet/), one per core, each with 64 KV blocks of 128 tokens (8,192 tokens): less
than the workload's working set, so where a conversation's turns land decides what stays cached.
Workload: CONVERSATIONS multi-turn chats at once, each with its own system prompt (~575 tokens),
TURNS turns each resending the whole history (the engine's own answers included), MAX_TOKENS
tokens per answer, streamed with `include_usage`. Clients run in CLIENTS separate processes
(bench/kit/real_client.py): one Python process is CPU-bound before a real engine is.

Targets, one after another on the same engines, each with its own prompts (a salt per target,
so none finds another's blocks cached):
- `direct`: no router; each conversation talks to one engine (half to each), the best placement
  a client could make by itself;
- `least_inflight`, `least_load`, `cache_aware`: a sluicegate (1 worker) in front of both
  engines, scraping their `/metrics` every 0.1 s.
Measured per target: TTFT (request sent to the first content token, client side) p50/p90,
completion tokens per second over the target's run, the cached share of prompt tokens (the
engines' own `usage.prompt_tokens_details.cached_tokens`, all turns and follow-up turns), and
the router's CPU per request (its process tree, from /proc). One run; compare within it.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.kit.page import fmt, table
from bench.kit.procstat import cpu_seconds
from tests.support.harness import Cluster, wait_http

CONVERSATIONS = 12
TURNS = 5
MAX_TOKENS = 24
CLIENTS = 2
SYSTEM_WORDS = 140  # about 575 tokens with the fleet's tokenizer (~4 a word)
TARGETS = ("direct", "least_inflight", "least_load", "cache_aware")
KV_BLOCKS = 64
_WORDS = (
    "account balance invoice router engine cache prefix token stream batch queue request reply "
    "latency budget region cluster replica tenant quota policy metric label scrape window retry "
    "health probe drain release admit choose reason customer ticket refund order parcel weather "
    "garden river mountain library window kitchen summer winter orange purple silver copper"
).split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def plan(target: str, urls: list[str], seed: int = 7) -> list[dict[str, Any]]:
    """The conversations of one target: the same shapes for every target, its own salt."""
    rng = random.Random(seed)
    convs = []
    for i in range(CONVERSATIONS):
        system = f"[{target} customer {i}] You answer for customer {i}. " + _text(rng, SYSTEM_WORDS)
        turns = [f"question {t}: " + _text(rng, 12) for t in range(TURNS)]
        convs.append({"id": i, "url": urls[i % len(urls)], "system": system, "turns": turns})
    return convs


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def drive(convs: list[dict[str, Any]], model: str, tmp: Path, tag: str) -> dict[str, Any]:
    """Run the conversations split over CLIENTS processes; their records and the wall time."""
    procs = []
    outs = []
    for c in range(CLIENTS):
        mine = convs[c::CLIENTS]
        plan_path, out = tmp / f"{tag}-plan-{c}.json", tmp / f"{tag}-out-{c}.json"
        plan_path.write_text(json.dumps({"conversations": mine, "model": model,
                                         "max_tokens": MAX_TOKENS}))  # fmt: skip
        outs.append(out)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench.kit.real_client", str(plan_path), str(out)],
                stdin=subprocess.DEVNULL,
            )
        )
    for p in procs:
        try:
            p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    records: list[dict[str, Any]] = []
    elapsed = 0.0
    for out in outs:
        if out.exists():
            got = json.loads(out.read_text())
            records += got["records"]
            elapsed = max(elapsed, got["elapsed_s"])
    return {"records": records, "elapsed_s": elapsed}


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    recs = run["records"]
    ok = [r for r in recs if r.get("ok")]
    follow = [r for r in ok if r["turn"] > 0]
    ttft = [r["ttft_s"] * 1000 for r in ok]
    prompt = sum(r["prompt"] for r in ok)
    fprompt = sum(r["prompt"] for r in follow)
    completion = sum(r["completion"] for r in ok)
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "ttft_p50_ms": _pct(ttft, 0.5),
        "ttft_p90_ms": _pct(ttft, 0.9),
        "tokens_per_s": completion / run["elapsed_s"] if run["elapsed_s"] else None,
        "cached_share": sum(r["cached"] for r in ok) / prompt if prompt else None,
        "cached_share_followups": sum(r["cached"] for r in follow) / fprompt if fprompt else None,
        "mean_prompt_tokens": prompt / len(ok) if ok else None,
        "elapsed_s": run["elapsed_s"],
    }


def _warm(urls: list[str], model: str) -> None:
    """One short request per engine: the first answer of a fresh engine is slower."""
    for url in urls:
        body = {"model": model, "messages": [{"role": "user", "content": "warm"}],
                "max_tokens": 4}  # fmt: skip
        httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def run(cluster: Cluster, quick: bool = False) -> dict[str, Any]:
    from router.tools.enginefleet.fleet import EngineOptions, Fleet
    from router.tools.enginefleet.install import engine_home, ensure_venv
    from router.tools.enginefleet.model import write_model

    home = engine_home()
    python = ensure_venv(home)
    model_dir = write_model(home / "models")
    fleet = Fleet(python, model_dir, count=2, options=EngineOptions(kv_blocks=KV_BLOCKS))
    out: dict[str, Any] = {
        "engines": 2,
        "kv_tokens_per_engine": KV_BLOCKS * 128,
        "conversations": CONVERSATIONS,
        "turns": TURNS,
        "max_tokens": MAX_TOKENS,
        "client_processes": CLIENTS,
        "targets": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="sg-bench-real-"))
    try:
        fleet.start()
        urls = [e.url for e in fleet.engines]
        model = fleet.engines[0].model
        _warm(urls, model)
        for target in TARGETS:
            router = None
            if target != "direct":
                router = cluster.router(
                    {
                        "backends": fleet.backends(),
                        "balancer": target,
                        "engine_metrics": {"interval": 0.1, "timeout": 2.0, "stale_after": 2.0},
                        "health": {"interval": 1.0},
                    },
                    env={"SLUICEGATE_LOG_LEVEL": "warning"},
                )
                wait_http(router.url + "/readyz")
                time.sleep(0.5)  # first engine readings (KV capacity) before traffic
            convs = plan(target, [router.url] if router else urls)
            cpu0 = cpu_seconds(router.pid) if router else 0.0
            result = drive(convs, model, tmp, target)
            row = summarise(result)
            if router is not None:
                row["router_cpu_ms_per_req"] = (
                    (cpu_seconds(router.pid) - cpu0) * 1000 / max(1, row["requests"])
                )
                router.stop()
            out["targets"][target] = row
            print(f"real {target}: " + json.dumps(row), flush=True)
    finally:
        fleet.stop()
    return out


def section(res: dict[str, Any], date: str) -> list[str]:
    rows: list[tuple[str, ...]] = [
        (
            "target",
            "TTFT p50 ms",
            "TTFT p90 ms",
            "tokens/s",
            "cached share",
            "cached share, follow-ups",
            "router CPU ms/req",
            "errors",
        )
    ]
    for name, r in res["targets"].items():
        rows.append(
            (
                name,
                fmt(r["ttft_p50_ms"]),
                fmt(r["ttft_p90_ms"]),
                fmt(r["tokens_per_s"]),
                fmt(r["cached_share"]),
                fmt(r["cached_share_followups"]),
                fmt(r.get("router_cpu_ms_per_req")),
                str(r["errors"]),
            )
        )
    return [
        "## Real engines (2 x vLLM 0.32 CPU, tiny model)",
        "",
        f"`python -m bench.run --only real`, {date}. {res['conversations']} conversations at "
        f"once, {res['turns']} turns each, {res['max_tokens']} tokens per answer, from "
        f"{res['client_processes']} client processes; each engine holds "
        f"{res['kv_tokens_per_engine']} tokens of KV (bench/scenarios/real_engine.py has the "
        "workload). `direct` pins each conversation to one engine with no router; the others go "
        "through one sluicegate. Cached share: the engines' own `cached_tokens` over prompt "
        "tokens. Targets run one after another, not interleaved in rounds: on a shared machine "
        "the drift between them is noise as much as routing.",
        "",
        table(rows),
        "",
    ]
