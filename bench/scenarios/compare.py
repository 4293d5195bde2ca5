"""sluicegate beside the other Python proxies people reach for (`python -m bench.run --only
compare`): a textbook FastAPI proxy (`bench/kit/textbook_proxy.py`) and LiteLLM's proxy, with a
direct connection to the mock as the floor.

The overhead scenario's load: 64-token streams from the fast mock (no token delay, so the hop's
own CPU is what limits it), 32 keep-alive users, the same pre-built request against each target
in alternating rounds; then the same with non-streamed requests. Each proxy is one process with
one worker on uvloop (LiteLLM: its own CLI, one worker, no database, no callbacks, quiet logs).
Figures per target: req/s, time to first chunk p50/p99, and the hop's CPU per request (user +
system of its process tree, from /proc); ratios sluicegate / textbook and sluicegate / LiteLLM.
LiteLLM is optional (`pip install 'litellm[proxy]'`, in the `bench` extra): when it is missing or
does not start, its row says so and the others still run. Loopback only, bounded in time; every
process started here is stopped by its PID (through the harness's Cluster).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from typing import Any

import yaml

from bench.kit.loadgen import run_load
from bench.kit.page import fmt, table
from bench.kit.procstat import cpu_seconds
from bench.kit.stats import alternating_rounds
from tests.support.harness import Cluster, Proc, free_port, wait_http

CHAT = "/v1/chat/completions"
CONCURRENCY = 32
TOKENS = 64
PROXIES = ("sluicegate", "textbook", "litellm")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def textbook(cluster: Cluster, upstream: Proc) -> Proc:
    port = free_port()
    proc = cluster._spawn(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "bench.kit.textbook_proxy:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--loop",
            "uvloop",
            "--http",
            "httptools",
            "--no-access-log",
            "--log-level",
            "warning",
        ],
        port,
        "textbook",
        {"TEXTBOOK_UPSTREAM": upstream.url},
    )
    wait_http(proc.url + "/docs", proc=proc.popen)
    return proc


def litellm(cluster: Cluster, upstream: Proc) -> Proc | str:
    """LiteLLM's proxy on a loopback port, or why it is not there."""
    if importlib.util.find_spec("litellm") is None:
        return "not installed"
    config = {
        "model_list": [
            {
                "model_name": "mock-model",
                "litellm_params": {
                    "model": "openai/mock-model",
                    "api_base": upstream.url + "/v1",
                    "api_key": "sk-bench-not-a-secret",
                },
            }
        ],
        "litellm_settings": {"set_verbose": False, "json_logs": False, "callbacks": []},
        # Like sluicegate in this run (no client keys): no master key. LiteLLM refuses to start
        # without one unless told this is deliberate.
        "general_settings": {"dangerously_permit_weak_or_unset_master_key": True},
    }
    path = cluster.tmp / "litellm.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {
        "LITELLM_LOG": "ERROR",
        # The bundled model price map, not a fetch from the internet at start.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    }
    proc = cluster._spawn(
        [
            sys.executable,
            "-m",
            "litellm.proxy.proxy_cli",
            "--config",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
            "--telemetry",
            "False",
        ],
        port,
        "litellm",
        env,
    )
    try:
        wait_http(proc.url + "/health/liveliness", deadline_s=120.0, proc=proc.popen)
    except (RuntimeError, TimeoutError) as exc:
        proc.stop()
        tail = proc.log().strip().splitlines()[-3:]
        return f"did not start: {exc}; " + " | ".join(tail)
    return proc


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def run(cluster: Cluster, quick: bool) -> dict[str, Any]:
    up = cluster.mock("compare", tokens=TOKENS)
    cfg = {"backends": [{"name": "b0", "url": up.url, "models": {"m": "mock-model"}}]}
    router = cluster.router(cfg, workers=1, env={"SLUICEGATE_LOG_LEVEL": "warning"})
    book = textbook(cluster, up)
    lite = litellm(cluster, up)
    targets: dict[str, tuple[Proc | None, Proc, str]] = {
        "direct": (None, up, "mock-model"),
        "sluicegate": (router, router, "m"),
        "textbook": (book, book, "mock-model"),
    }
    missing: dict[str, str] = {}
    if isinstance(lite, str):
        missing["litellm"] = lite
        print(f"compare: litellm {lite}", flush=True)
    else:
        targets["litellm"] = (lite, lite, "mock-model")
    rounds = 2 if quick else 3
    seconds = 2.0 if quick else 4.0
    out: dict[str, Any] = {
        "concurrency": CONCURRENCY,
        "tokens": TOKENS,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "litellm_version": _version("litellm"),
        "missing": missing,
    }
    try:
        for variant, stream in (("stream", True), ("non_stream", False)):
            out[variant] = _variant(targets, stream, rounds, seconds)
            print(f"compare {variant}: " + json.dumps(_rounded(out[variant])), flush=True)
    finally:
        for p in (router, book, lite, up):
            if isinstance(p, Proc):
                p.stop()
    return out


def _variant(
    targets: dict[str, tuple[Proc | None, Proc, str]], stream: bool, rounds: int, seconds: float
) -> dict[str, Any]:
    def load(k: str, duration: float) -> tuple[int, int, float, list[float], dict[str, float]]:
        hop, tgt, model = targets[k]
        body = json.dumps(
            {
                "model": model,
                "stream": stream,
                "max_tokens": TOKENS,
                "messages": [{"role": "user", "content": "hello"}],
            }
        ).encode()
        cpu0 = cpu_seconds(hop.pid) if hop else 0.0
        r = asyncio.run(run_load("127.0.0.1", tgt.port, CHAT, body, CONCURRENCY, duration=duration))
        cpu1 = cpu_seconds(hop.pid) if hop else 0.0
        return r.ok, r.errors, r.elapsed, r.ttfb, {"hop": cpu1 - cpu0}

    row: dict[str, Any] = {}
    for k, a in alternating_rounds(list(targets), load, rounds, seconds).items():
        row[k] = {
            "rps": a.ok / a.elapsed if a.elapsed else 0.0,
            "requests": a.ok,
            "errors": a.errors,
            "ttfc_p50_ms": _ms(_pct(a.ttfb, 0.5)),
            "ttfc_p99_ms": _ms(_pct(a.ttfb, 0.99)),
            "cpu_ms_per_req": a.cpu["hop"] / a.ok * 1000 if a.ok and k != "direct" else None,
        }
    sg = row["sluicegate"]
    for other in ("textbook", "litellm"):
        o = row.get(other)
        if o is None or not o["rps"]:
            continue
        row[f"sluicegate_vs_{other}_rps"] = sg["rps"] / o["rps"]
        if sg["cpu_ms_per_req"] and o["cpu_ms_per_req"]:
            row[f"sluicegate_vs_{other}_cpu"] = sg["cpu_ms_per_req"] / o["cpu_ms_per_req"]
    return row


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000


def _rounded(obj: Any) -> Any:
    if isinstance(obj, float):
        return round(obj, 3)
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    return obj


def section(res: dict[str, Any], date: str) -> list[str]:
    """The `compare` section of docs/benchmarks.md."""
    lines = [
        "## Beside other Python proxies (textbook FastAPI, LiteLLM)",
        "",
        f"`python -m bench.run --only compare`, {date}: {res['tokens']}-token answers from the "
        f"fast mock (no token delay), {res['concurrency']} keep-alive users, "
        f"{res['rounds']} alternating rounds of {res['seconds_per_round']:g} s per target. "
        "Each proxy is one process, one worker; CPU is its process tree's user + system time "
        "per request. The textbook proxy is `bench/kit/textbook_proxy.py` (FastAPI, one shared "
        "httpx client, `StreamingResponse(resp.aiter_raw())`, uvicorn with uvloop/httptools); "
        "LiteLLM "
        + (f"{res['litellm_version']} " if res.get("litellm_version") else "")
        + "runs its own proxy CLI with a `model_list` entry `openai/mock-model` pointing at the "
        "mock, no database, no callbacks.",
        "",
    ]
    for name, why in res.get("missing", {}).items():
        lines += [f"{name}: {why}.", ""]
    head = ("request", "target", "req/s", "TTFC p50 ms", "TTFC p99 ms", "CPU ms/req", "errors")
    rows: list[tuple[str, ...]] = [head]
    for variant, label in (("stream", "streamed"), ("non_stream", "non-streamed")):
        row = res.get(variant, {})
        for k in ("direct", *PROXIES):
            if k in row:
                v = row[k]
                rows.append(
                    (
                        label,
                        k,
                        fmt(v["rps"]),
                        fmt(v["ttfc_p50_ms"]),
                        fmt(v["ttfc_p99_ms"]),
                        fmt(v["cpu_ms_per_req"]),
                        fmt(v["errors"]),
                    )
                )
    lines += [table(rows), ""]
    ratios: list[tuple[str, ...]] = [
        (
            "request",
            "sluicegate/textbook req/s",
            "sluicegate/textbook CPU/req",
            "sluicegate/LiteLLM req/s",
            "sluicegate/LiteLLM CPU/req",
        )
    ]
    for variant, label in (("stream", "streamed"), ("non_stream", "non-streamed")):
        row = res.get(variant, {})
        ratios.append(
            (
                label,
                fmt(row.get("sluicegate_vs_textbook_rps")),
                fmt(row.get("sluicegate_vs_textbook_cpu")),
                fmt(row.get("sluicegate_vs_litellm_rps")),
                fmt(row.get("sluicegate_vs_litellm_cpu")),
            )
        )
    lines += [table(ratios), ""]
    lines += [
        "Req/s above 1 and CPU/req below 1 favour sluicegate. TTFC for non-streamed requests is "
        "the time to the first byte of the whole answer. All processes share the machine's cores "
        "with the load generator, so compare ratios within this run, not absolute numbers. "
        "Sluicegate's streamed req/s can exceed direct: it relays each upstream read as one write, "
        "so the load generator parses fewer, larger chunks. Where the others spend it (a py-spy "
        "profile under this load): the textbook proxy about 55 % in the ASGI send path, every "
        "upstream chunk one `send` through Starlette's middleware stack into uvicorn, and about "
        "27 % in httpx's `send` (pool checkout, request, response head); LiteLLM per chunk in "
        "its streaming path (the openai SDK builds a pydantic object from every chunk, then "
        "LiteLLM's stream wrapper and proxy hooks rebuild and re-serialise it).",
        "",
    ]
    return lines


if __name__ == "__main__":
    # A dry start of LiteLLM alone: does it come up here?
    c = Cluster()
    try:
        m = c.mock("probe", tokens=TOKENS)
        got = litellm(c, m)
        print(got if isinstance(got, str) else f"litellm up on {got.url}")
    finally:
        c.close()
