"""Where the router's CPU goes, by stage of a request, with every setting at its default.

    python -m bench.oneoff.hop_profile            # short streams (64 tokens, c=32) and long ones

The router runs under bench/oneoff/hop_serve.py: cProfile on the event loop's thread, timed by that
thread's CPU clock, switched on for the measured window only. Each function's own time goes to
the stage its module and name belong to (`STAGES`, first match wins); a builtin (`len`, a bytes
method) is charged to the stages of its callers, in proportion. cProfile inflates functions
called often more than long ones, so the shares aim the cuts; the cuts themselves are proven by
whole-process CPU in alternating rounds (bench/scenarios/hop.py). The log line is formatted and
written by a thread of its own, which cProfile does not see: its cost is the CPU difference
between `log_level: info` (the default) and `warning`, in alternating rounds.
"""

from __future__ import annotations

import asyncio
import json
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.kit.loadgen import run_load
from bench.kit.procstat import cpu_seconds
from tests.support.harness import Cluster, Proc, free_port, wait_http

CHAT = "/v1/chat/completions"
# (stage, path part, function names or None for any): the first row that matches wins.
STAGES: list[tuple[str, str, tuple[str, ...] | None]] = [
    ("client writes (ASGI send)", "uvicorn/protocols/http/httptools_impl.py", ("send",)),
    (
        "head parse",
        "router/upstream/transport.py",
        ("on_header", "on_headers_complete", "on_message_begin", "on_status"),
    ),
    (
        "head parse",
        "router/request/wire/headers.py",
        ("downstream_response_headers", "_connection_named"),
    ),
    (
        "pump per chunk",
        "router/upstream/transport.py",
        (
            "on_body",
            "_data_outside_body",
            "data_received",
            "__anext__",
            "_wake",
            "on_message_complete",
            "_arm",
            "_finish",
            "keep_alive",
            "aclose",
            "_check_silence",
        ),
    ),
    ("upstream write", "router/upstream/", None),
    ("upstream write", "httpx/", None),
    ("upstream write", "router/request/wire/headers.py", None),
    ("upstream write", "router/request/admit/hops.py", None),
    ("accept + parse (uvicorn, ASGI)", "uvicorn/", None),
    ("accept + parse (uvicorn, ASGI)", "starlette/", None),
    ("accept + parse (uvicorn, ASGI)", "fastapi/", None),
    ("accept + parse (uvicorn, ASGI)", "router/web/edge.py", None),
    ("auth", "router/web/auth.py", None),
    ("body parse + validate", "router/request/admit/validate.py", None),
    ("body parse + validate", "router/request/admit/estimate.py", None),
    ("body parse + validate", "json/decoder.py", None),
    ("body parse + validate", "json/__init__.py", ("loads",)),
    ("usage strip + inject", "router/request/usage/strip.py", None),
    ("usage strip + inject", "router/request/wire/sse.py", None),
    ("usage read", "router/request/usage/parse.py", None),
    ("migration record", "router/request/migration/relay.py", None),
    ("migration record", "router/request/migration/policy.py", None),
    ("pump per chunk", "router/request/lifecycle/pump.py", ("pump",)),
    ("accounting", "router/request/usage/book.py", None),
    ("accounting", "router/request/lifecycle/account.py", None),
    ("accounting", "router/request/admit/quota.py", None),
    ("metrics", "prometheus_client/", None),
    ("metrics", "router/ops/metrics.py", None),
    ("log line (event loop side)", "logging/", None),
    ("log line (event loop side)", "router/ops/logs.py", None),
    ("log line (event loop side)", "router/request/usage/record.py", None),
    ("log line (event loop side)", "json/encoder.py", None),
    ("log line (event loop side)", "json/__init__.py", ("dumps",)),
    ("tracing (off)", "router/ops/tracing.py", None),
    ("routing + pick", "balancers/", None),
    ("routing + pick", "health/", None),
    ("routing + pick", "router/registry/", None),
    ("routing + pick", "router/request/affinity", None),
    ("routing + pick", "router/request/lifecycle/failover.py", None),
    ("routing + pick", "router/request/admit/admission.py", None),
    ("routing + pick", "router/request/placement/prefix.py", None),
    ("admission, lifecycle, tasks", "router/request/", None),
    ("admission, lifecycle, tasks", "asyncio/", None),
    ("admission, lifecycle, tasks", "uvloop", None),
]

Func = tuple[str, int, str]


def stage_of(func: Func) -> str | None:
    path, _, name = func
    if path == "~":
        return None  # a builtin: its callers' stages
    for stage, part, names in STAGES:
        if part in path and (names is None or name in names):
            return stage
    return "other (stdlib, typing, abc)"


def shares(stats_path: str) -> dict[str, float]:
    """Seconds of the event loop thread's CPU per stage."""
    raw: dict[Func, Any] = pstats.Stats(stats_path).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for func, (_, _, tottime, _, callers) in raw.items():
        stage = stage_of(func)
        if stage is not None:
            out[stage] = out.get(stage, 0.0) + tottime
            continue
        by_caller = {c: v[2] for c, v in callers.items()}
        total = sum(by_caller.values())
        for caller, tt in by_caller.items():
            s = stage_of(caller) or "other (stdlib, typing, abc)"
            out[s] = out.get(s, 0.0) + (tottime * tt / total if total else 0.0)
        if not by_caller:
            out["other (stdlib, typing, abc)"] = out.get("other (stdlib, typing, abc)", 0.0)
            out["other (stdlib, typing, abc)"] += tottime
    return out


def _router(c: Cluster, up: Proc, out: str, env: dict[str, str]) -> Proc:
    path = c.write_config(
        {"backends": [{"name": "b0", "url": up.url, "models": {"m": "mock-model"}}]}
    )
    port = free_port()
    args = [sys.executable, "-m", "bench.oneoff.hop_serve", "serve", "--config", str(path)]
    args += ["--port", str(port), "--host", "127.0.0.1"]
    proc = c._spawn(args, port, "router", {"HOP_PROFILE_OUT": out, **env})
    wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc.popen)
    return proc


def _body(tokens: int) -> bytes:
    msg = [{"role": "user", "content": "hi"}]
    return json.dumps(
        {"model": "m", "stream": True, "max_tokens": tokens, "messages": msg}
    ).encode()


def profile(tokens: int, itl_ms: float, conc: int, seconds: float) -> dict[str, Any]:
    """One profiled window: stage -> microseconds per request and per chunk (profiled)."""
    c = Cluster()
    out = str(Path(tempfile.mkdtemp(prefix="sluicegate-hop-")) / "router.prof")
    try:
        up = c.mock("hop", tokens=tokens, itl_ms=itl_ms)
        r = _router(c, up, out, {})
        body = _body(tokens)
        asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, conc, duration=1.0))
        r.popen.send_signal(signal.SIGUSR1)
        res = asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, conc, duration=seconds))
        r.popen.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while not Path(out).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        s = shares(out)
    finally:
        c.close()
    total = sum(s.values())
    chunks = res.ok * (tokens + 3)  # the role event, each token, the finish event, [DONE]
    return {
        "requests": res.ok,
        "profiled_us_per_request": total / res.ok * 1e6,
        "share": {k: v / total for k, v in sorted(s.items(), key=lambda kv: -kv[1])},
        "profiled_us_per_chunk": total / chunks * 1e6,
    }


def log_line_ab(rounds: int = 3, seconds: float = 3.0) -> dict[str, float]:
    """Whole-process CPU per request at `log_level` info (the default) and warning."""
    c = Cluster()
    try:
        up = c.mock("hop", tokens=64)
        cfg = {"backends": [{"name": "b0", "url": up.url, "models": {"m": "mock-model"}}]}
        routers = {
            lvl: c.router(cfg, env={"SLUICEGATE_LOG_LEVEL": lvl}) for lvl in ("info", "warning")
        }
        body = _body(64)
        totals = {k: [0.0, 0] for k in routers}
        for r in routers.values():
            asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, 32, duration=1.0))
        for rnd in range(rounds):
            for k in list(routers)[rnd % 2 :] + list(routers)[: rnd % 2]:
                r = routers[k]
                cpu0 = cpu_seconds(r.pid)
                res = asyncio.run(run_load("127.0.0.1", r.port, CHAT, body, 32, duration=seconds))
                totals[k][0] += cpu_seconds(r.pid) - cpu0
                totals[k][1] += res.ok
    finally:
        c.close()
    ms = {k: cpu / n * 1000 for k, (cpu, n) in totals.items()}
    return {**ms, "log_line_share": (ms["info"] - ms["warning"]) / ms["info"]}


def main() -> int:
    short = profile(64, 0.0, 32, 6.0)
    long = profile(256, 10.0, 100, 6.0)
    logs = log_line_ab()
    print(json.dumps({"short": short, "long": long, "log_line": logs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
