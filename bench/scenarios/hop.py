"""The hop beside nginx and the floor (issue #28): CPU per request and per chunk, req/s, bursts.

    python -m bench.run --only hop         # the docs section and bench/results/latest.json
    python -m bench.scenarios.hop          # the same figures, printed
    python -m bench.scenarios.hop --check  # exit 1 when sluicegate's CPU/request ratio to nginx
                                           # is more than 5 % over bench/hop_baseline.json
    python -m bench.scenarios.hop --record             # write this run's ratio as the baseline
    python -m bench.scenarios.hop --baseline-src DIR   # also a router from another checkout (A/B)
    python -m bench.scenarios.hop --ab --baseline-src DIR   # only the two routers: a cut's proof
    python -m bench.scenarios.hop --burst --rounds 7   # only the bursts

Targets, all on 127.0.0.1, each one process: the mock itself (direct), nginx (when installed),
sluicegate with every setting at its default (`log_level: info` included, the log going to a
file) and the floor (bench/kit/hop_floor.py: uvicorn, uvloop, httptools and the router's upstream
stack, nothing of sluicegate). Loads alternate between targets in rounds so that the noise of this
shared machine spreads evenly, and every figure is a ratio within this one run:
- per request: 64-token streams, no token delay, 32 keep-alive users; CPU is the target's process
  tree's user + system time per completed request. Then again at one request rate for every
  target (open loop, RATE_SHARE of sluicegate's req/s at 32 users): at one concurrency the
  faster target runs more requests per event-loop turn and so pays less for each
  (bench/scenarios/pd.py measured 1.13x CPU per request for a router at 0.89x the rate), so the
  ratio at one rate is the like-for-like one; both are shown;
- per chunk: 128-token streams at 10 ms per token (each token its own read and write), 100 users;
  CPU per streamed event, the per-request part included;
- bursts: 200 and 500 streams opened at once on new connections (64 tokens at 20 ms per
  token), sluicegate, nginx and the floor at 1 and 2 workers: each round's TTFT p99 less that
  round's direct burst's, the median of the rounds (the verdict) and the pooled p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from bench.kit.loadgen import run_load
from bench.kit.nginx import start_nginx
from bench.kit.procstat import cpu_seconds
from bench.kit.stats import pct
from tests.support.harness import Cluster, Proc, free_port, wait_http

CHAT = "/v1/chat/completions"
BASELINE = Path(__file__).resolve().parents[1] / "hop_baseline.json"
GROWTH = 1.05  # the gate: CPU/request ratio to nginx at most this much over the baseline's
SHORT, LONG, ITL_MS = 64, 128, 10.0
BURST_TOKENS, BURST_ITL_MS = 64, 20.0  # a burst's streams: about 1.3 s each
BURST_SIZES = (200, 500)  # issue #28: a 200-stream and a 500-stream burst
# Rounds per size in a full run: the 200-stream burst carries the bound, and its median moved by
# 8 ms between 5-round runs (a round's p99 is its second-slowest request); 15 rounds cost 2.3 min.
BURST_ROUNDS = {200: 15, 500: 5}
BURST_MARGIN_MS = 10.0  # issue #28: added TTFT p99 within nginx's + this
RECOMMENDED_WORKERS = 2  # the README's count for a 2-core pod (one per core)
RATE_SHARE = 0.6  # of sluicegate's closed-loop req/s: the one rate every target runs at
RATE_USERS = 64


class Target(Protocol):
    """What a load is run against: a process (its tree's CPU is read) on a loopback port; a
    harness Proc, or a peer router (bench/kit/peers.py)."""

    @property
    def pid(self) -> int: ...

    @property
    def port(self) -> int: ...


def body_of(model: str, tokens: int) -> bytes:
    msg = [{"role": "user", "content": "hi"}]
    payload = {"model": model, "stream": True, "max_tokens": tokens, "messages": msg}
    return json.dumps(payload).encode()


def _floor(c: Cluster, up: Proc, workers: int = 1) -> Proc:
    port = free_port()
    args = [sys.executable, "-m", "uvicorn", "bench.kit.hop_floor:app", "--loop", "uvloop"]
    args += ["--http", "httptools", "--no-access-log", "--log-level", "warning"]
    args += ["--workers", str(workers)]
    args += ["--host", "127.0.0.1", "--port", str(port)]
    proc = c._spawn(args, port, "floor", {"HOP_FLOOR_UPSTREAM": up.url})
    wait_http(f"http://127.0.0.1:{port}/health", proc=proc.popen)
    return proc


def _router(
    c: Cluster,
    fast: Proc,
    slow: Proc,
    workers: int = 1,
    src: str | None = None,
    burst: Proc | None = None,
) -> Proc:
    backends = [
        {"name": "fast", "url": fast.url, "models": {"m": "mock-model"}},
        {"name": "slow", "url": slow.url, "models": {"long": "mock-model"}},
    ]
    if burst is not None:
        backends.append({"name": "burst", "url": burst.url, "models": {"burst": "mock-model"}})
    cfg = {"backends": backends}
    return c.router(cfg, env={"SLUICEGATE_LOG_LEVEL": "info"}, workers=workers, src=src)


def _burst_router(c: Cluster, up: Proc, workers: int) -> Proc:
    cfg = {"backends": [{"name": "burst", "url": up.url, "models": {"burst": "mock-model"}}]}
    return c.router(cfg, env={"SLUICEGATE_LOG_LEVEL": "info"}, workers=workers)


def load_rounds(
    targets: Mapping[str, tuple[Target, bytes]], rounds: int, **load: Any
) -> dict[str, dict[str, Any]]:
    """Each target `rounds` times, the order rotating: requests, CPU, elapsed, TTFT samples."""
    agg: dict[str, dict[str, Any]] = {
        k: {"ok": 0, "errors": 0, "cpu": [], "n": [], "elapsed": 0.0, "ttfb": []} for k in targets
    }
    for rnd in range(rounds):
        for k, (proc, body) in _rotated(targets, rnd).items():
            cpu0 = cpu_seconds(proc.pid)
            r = asyncio.run(run_load("127.0.0.1", proc.port, CHAT, body, **load))
            a = agg[k]
            a["cpu"].append(cpu_seconds(proc.pid) - cpu0)
            a["n"].append(r.ok)
            a["ok"] += r.ok
            a["errors"] += r.errors
            a["elapsed"] += r.elapsed
            a["ttfb"] += r.ttfb
    return agg


def ratio_spread(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Round-by-round ratios of CPU per request (a / b): median, lowest, highest."""
    per = [
        (ca / na) / (cb / nb)
        for ca, na, cb, nb in zip(a["cpu"], a["n"], b["cpu"], b["n"], strict=True)
        if na and nb and cb
    ]
    if not per:
        return {}
    return {"median": statistics.median(per), "min": min(per), "max": max(per)}


def run(c: Cluster, quick: bool = False, baseline_src: str | None = None) -> dict[str, Any]:
    fast = c.mock("hop-fast", tokens=SHORT)
    slow = c.mock("hop-slow", tokens=LONG, itl_ms=ITL_MS)
    bursty = c.mock("hop-burst", tokens=BURST_TOKENS, itl_ms=BURST_ITL_MS)
    router = _router(c, fast, slow, burst=bursty)
    base = _router(c, fast, slow, src=baseline_src) if baseline_src else None
    ngx_fast, ngx_slow = start_nginx(c, [fast]), start_nginx(c, [slow])
    floor_fast, floor_slow = _floor(c, fast), _floor(c, slow)
    rounds = 3 if quick else 5
    res: dict[str, Any] = {"rounds": rounds}

    # Per request.
    short: dict[str, tuple[Proc, bytes]] = {
        "direct": (fast, body_of("mock-model", SHORT)),
        "sluicegate": (router, body_of("m", SHORT)),
        "floor": (floor_fast, body_of("mock-model", SHORT)),
    }
    if ngx_fast is not None:
        short["nginx"] = (ngx_fast, body_of("mock-model", SHORT))
    if base is not None:
        short["baseline"] = (base, body_of("m", SHORT))
    load_rounds(short, 1, concurrency=32, duration=1.0)  # warm-up: connections, pools, caches
    agg = load_rounds(short, rounds, concurrency=32, duration=3.0)
    per_req: dict[str, Any] = {}
    for k, a in agg.items():
        per_req[k] = {
            "rps": a["ok"] / a["elapsed"],
            "errors": a["errors"],
            "cpu_ms_per_req": sum(a["cpu"]) / a["ok"] * 1000 if k != "direct" and a["ok"] else None,
        }
    res["per_request"] = per_req
    ratios: dict[str, Any] = {}
    for ref in ("nginx", "floor", "baseline"):
        if ref in agg:
            ratios[f"cpu_vs_{ref}"] = ratio_spread(agg["sluicegate"], agg[ref])
            ratios[f"rps_vs_{ref}"] = per_req["sluicegate"]["rps"] / per_req[ref]["rps"]
    if "nginx" in agg:
        ratios["floor_cpu_vs_nginx"] = ratio_spread(agg["floor"], agg["nginx"])
    res["ratios"] = ratios

    # Per request at one rate for all (open loop).
    rate = RATE_SHARE * per_req["sluicegate"]["rps"]
    at_rate = {k: v for k, v in short.items() if k != "direct"}
    agg = load_rounds(at_rate, rounds, concurrency=RATE_USERS, duration=3.0, rate=rate)
    res["rate"] = rate
    res["per_request_at_rate"] = {
        k: {
            "rps": a["ok"] / a["elapsed"],
            "cpu_ms_per_req": sum(a["cpu"]) / a["ok"] * 1000 if a["ok"] else None,
        }
        for k, a in agg.items()
    }
    res["rate_kept"] = all(v["rps"] >= 0.95 * rate for v in res["per_request_at_rate"].values())
    for ref in ("nginx", "floor", "baseline"):
        if ref in agg:
            ratios[f"cpu_vs_{ref}_at_rate"] = ratio_spread(agg["sluicegate"], agg[ref])
    if "nginx" in agg:
        ratios["floor_cpu_vs_nginx_at_rate"] = ratio_spread(agg["floor"], agg["nginx"])

    # Per chunk on long streams.
    events = LONG + 3  # the role event, the tokens, the finish event, [DONE]
    long: dict[str, tuple[Proc, bytes]] = {
        "sluicegate": (router, body_of("long", LONG)),
        "floor": (floor_slow, body_of("mock-model", LONG)),
    }
    if ngx_slow is not None:
        long["nginx"] = (ngx_slow, body_of("mock-model", LONG))
    agg = load_rounds(long, 2 if quick else 3, concurrency=100, requests=200, request_timeout=30)
    per_chunk = {k: sum(a["cpu"]) / (a["ok"] * events) * 1e6 for k, a in agg.items() if a["ok"]}
    res["per_chunk_us"] = per_chunk
    for ref in ("nginx", "floor"):
        if ref in per_chunk:
            res["ratios"][f"chunk_cpu_vs_{ref}"] = per_chunk["sluicegate"] / per_chunk[ref]

    # Bursts: new connections all at once; sluicegate at 1 and 2 workers.
    two = _router(c, fast, slow, workers=2, burst=bursty)
    per_size = dict.fromkeys(BURST_SIZES, 3) if quick else BURST_ROUNDS
    res["bursts"] = bursts(c, bursty, router, two, per_size)
    stopped = (router, base, two, ngx_fast, ngx_slow, floor_fast, floor_slow)
    for p in (*stopped, fast, slow, bursty):
        if p is not None:
            p.stop()
    return res


def bursts(c: Cluster, up: Proc, one: Proc, two: Proc, rounds: dict[int, int]) -> dict[str, Any]:
    """Bursts of `size` streams opened at once on new connections, each target once per round
    (the order rotating), `rounds[size]` rounds for each size: sluicegate at 1 and 2 workers
    (`one`, `two`: routers serving model "burst" on `up`), nginx and the floor at 1 and 2
    workers in front of `up`, and `up` itself (direct).

    A burst's TTFT p99 moves with whatever else the shared machine runs in that second (direct's
    own read 21-77 ms across three runs), so each round's added p99 is taken against the direct
    burst of the same round, and a target's figure is the median of its rounds (lowest-highest
    beside it); the pooled p99 is shown too."""
    ngx = start_nginx(c, [up])
    floors = {w: _floor(c, up, workers=w) for w in (1, 2)}
    body = body_of("mock-model", BURST_TOKENS)
    routed = body_of("burst", BURST_TOKENS)
    targets: dict[str, tuple[Target, bytes]] = {
        "direct": (up, body),
        "sluicegate_1w": (one, routed),
        "sluicegate_2w": (two, routed),
    }
    if ngx is not None:
        targets["nginx"] = (ngx, body)
    for w, proc in floors.items():
        targets[f"floor_{w}w"] = (proc, body)
    try:
        return burst_rounds(targets, rounds)
    finally:
        for p in (ngx, *floors.values()):
            if p is not None:
                p.stop()


def burst_rounds(
    targets: Mapping[str, tuple[Target, bytes]], rounds: dict[int, int]
) -> dict[str, Any]:
    """`bursts()`'s measurement of given targets, `direct` among them (the mock itself, that
    each round's added p99 is taken against): (body, figures) per size as `bursts()` says."""
    out: dict[str, Any] = {"rounds": rounds, "tokens": BURST_TOKENS, "itl_ms": BURST_ITL_MS}
    for size, n in rounds.items():
        load = {"concurrency": size, "requests": size, "request_timeout": 30}
        load_rounds(targets, 1, **load)  # warm-up: the workers' pools, nginx's upstream keep-alive
        per_round: dict[str, list[float]] = {k: [] for k in targets}
        pooled: dict[str, list[float]] = {k: [] for k in targets}
        errors = dict.fromkeys(targets, 0)
        for rnd in range(n):
            agg = load_rounds(_rotated(targets, rnd), 1, **load)  # one round, its own order
            for k, a in agg.items():
                per_round[k].append(pct(a["ttfb"], 0.99) * 1000)
                pooled[k] += a["ttfb"]
                errors[k] += a["errors"]
        added = {
            k: [t - d for t, d in zip(v, per_round["direct"], strict=True)]
            for k, v in per_round.items()
            if k != "direct"
        }
        direct_p99 = pct(pooled["direct"], 0.99) * 1000
        out[str(size)] = {
            k: {
                "ttft_p50_ms": pct(pooled[k], 0.5) * 1000,
                "ttft_p99_ms": pct(pooled[k], 0.99) * 1000,
                "added_p99_ms": pct(pooled[k], 0.99) * 1000 - direct_p99,
                "added_p99_rounds_ms": added.get(k, []),
                "errors": errors[k],
            }
            for k in targets
        }
    return out


def _rotated(targets: Mapping[str, Any], rnd: int) -> dict[str, Any]:
    keys = list(targets)
    keys = keys[rnd % len(keys) :] + keys[: rnd % len(keys)]
    return {k: targets[k] for k in keys}


def burst_verdict(res: dict[str, Any], workers: int = RECOMMENDED_WORKERS) -> dict[str, Any]:
    """Issue #28's burst bound per size: sluicegate's added p99 (median of rounds) within
    nginx's + BURST_MARGIN_MS, at the README's worker count; the floor's beside it."""
    out: dict[str, Any] = {}
    for size in BURST_SIZES:
        got = res.get(str(size))
        if not got or "nginx" not in got:
            continue
        med = {
            k: statistics.median(v["added_p99_rounds_ms"]) for k, v in got.items() if k != "direct"
        }
        limit = med["nginx"] + BURST_MARGIN_MS
        out[str(size)] = {
            "limit_ms": limit,
            "sluicegate_ms": med[f"sluicegate_{workers}w"],
            "floor_ms": med[f"floor_{workers}w"],
            "met": med[f"sluicegate_{workers}w"] <= limit,
            "floor_met": med[f"floor_{workers}w"] <= limit,
        }
    return out


def ab(c: Cluster, baseline_src: str, rounds: int, seconds: float, tokens: int) -> dict[str, Any]:
    """This checkout's router against another's, nothing else: CPU/request ratio per round."""
    fast = c.mock("hop-fast", tokens=tokens)
    slow = c.mock("hop-slow", tokens=LONG, itl_ms=ITL_MS)
    pair = {
        "this": (_router(c, fast, slow), body_of("m", tokens)),
        "baseline": (_router(c, fast, slow, src=baseline_src), body_of("m", tokens)),
    }
    load_rounds(pair, 1, concurrency=32, duration=1.0)
    agg = load_rounds(pair, rounds, concurrency=32, duration=seconds)
    return {
        "cpu_ms_per_req": {k: sum(a["cpu"]) / a["ok"] * 1000 for k, a in agg.items()},
        "this_vs_baseline": ratio_spread(agg["this"], agg["baseline"]),
    }


def check(res: dict[str, Any], baseline: Path = BASELINE) -> tuple[bool, str]:
    """The gate: this run's CPU/request ratio to nginx against the recorded one."""
    now = res.get("ratios", {}).get("cpu_vs_nginx", {}).get("median")
    if now is None:
        return False, "no nginx in this run: the gate needs it (apt-get install nginx)"
    recorded = json.loads(baseline.read_text())["cpu_vs_nginx"]
    ok = now <= recorded * GROWTH
    verdict = "ok" if ok else "FAILED"
    return ok, (
        f"{verdict}: sluicegate CPU/request {now:.2f}x nginx's; baseline {recorded:.2f}x, "
        f"limit {recorded * GROWTH:.2f}x"
    )


def record(res: dict[str, Any], baseline: Path = BASELINE) -> None:
    ratio = res["ratios"]["cpu_vs_nginx"]
    baseline.write_text(
        json.dumps(
            {
                "cpu_vs_nginx": round(ratio["median"], 3),
                "spread": [round(ratio["min"], 3), round(ratio["max"], 3)],
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "load": f"{SHORT}-token streams, c=32, {res['rounds']} rounds of 3 s",
            },
            indent=2,
        )
        + "\n"
    )


def lines(res: dict[str, Any]) -> list[str]:
    """The docs section."""
    r = res["ratios"]
    pr = res["per_request"]

    def spread(key: str) -> str:
        v = r.get(key)
        return f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})" if v else "-"

    def f(v: float | None, fmt: str = ".3f") -> str:
        return "-" if v is None else format(v, fmt)

    out = [
        "## The hop beside nginx and the floor (`--only hop`, issue #28)",
        "",
        f"`python -m bench.run --only hop`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{res['rounds']} alternating rounds. Every setting of sluicegate at its default. The "
        "floor is `bench/kit/hop_floor.py`: uvicorn + uvloop + httptools and the router's upstream "
        "stack, nothing of sluicegate. Ratios as median (lowest-highest) of the rounds.",
        "",
        "| target | req/s (64-token streams, c=32) | CPU ms/request (c=32) "
        f"| CPU ms/request (at {res['rate']:.0f}/s) | CPU us/chunk (long streams) |",
        "|---|---|---|---|---|",
    ]
    at = res["per_request_at_rate"]
    for k in ("direct", "nginx", "floor", "sluicegate", "baseline"):
        if k in pr:
            at_k = at[k]["cpu_ms_per_req"] if k in at else None
            out.append(
                f"| {k} | {pr[k]['rps']:.0f} | {f(pr[k]['cpu_ms_per_req'])} | {f(at_k)} | "
                f"{f(res['per_chunk_us'].get(k), '.1f')} |"
            )
    out += [
        "",
        "| ratio | measured | issue #28's bound |",
        "|---|---|---|",
        f"| sluicegate CPU/request / nginx's, at one rate | {spread('cpu_vs_nginx_at_rate')} "
        "| <= 2 |",
        f"| sluicegate CPU/request / nginx's, at c=32 | {spread('cpu_vs_nginx')} | <= 2 |",
        f"| sluicegate CPU/request / the floor's, at one rate | {spread('cpu_vs_floor_at_rate')} "
        "| - |",
        f"| sluicegate CPU/request / the floor's, at c=32 | {spread('cpu_vs_floor')} | - |",
        f"| the floor's CPU/request / nginx's, at one rate "
        f"| {spread('floor_cpu_vs_nginx_at_rate')} | - |",
        f"| the floor's CPU/request / nginx's, at c=32 | {spread('floor_cpu_vs_nginx')} | - |",
        f"| sluicegate CPU/chunk / nginx's | {f(r.get('chunk_cpu_vs_nginx'), '.2f')} | <= 1.5 |",
        f"| sluicegate CPU/chunk / the floor's | {f(r.get('chunk_cpu_vs_floor'), '.2f')} | - |",
        f"| sluicegate req/s / nginx's | {f(r.get('rps_vs_nginx'), '.2f')} | >= 0.8 |",
    ]
    if "cpu_vs_baseline" in r:
        out.append(f"| sluicegate CPU/request / baseline's | {spread('cpu_vs_baseline')} | - |")
    if not res.get("rate_kept", True):
        out.append("| **a target fell behind the one rate: its ratios are not valid** | | |")
    return [*out, "", *burst_lines(res["bursts"])]


def burst_lines(res: dict[str, Any]) -> list[str]:
    out: list[str] = []
    verdict = burst_verdict(res)
    for size in BURST_SIZES:
        got = res.get(str(size))
        if not got:
            continue
        n = max(len(v["added_p99_rounds_ms"]) for v in got.values())
        out += [
            f"| {size}-stream burst, new connections ({n} rounds) | TTFT p50 ms "
            "| TTFT p99 ms | added p99 over direct ms, median of rounds (lowest-highest) "
            "| pooled |",
            "|---|---|---|---|---|",
        ]
        for k, v in got.items():
            rounds = v["added_p99_rounds_ms"]
            med = (
                f"{statistics.median(rounds):+.1f} ({min(rounds):+.1f} to {max(rounds):+.1f})"
                if rounds
                else "-"
            )
            pooled = "-" if k == "direct" else f"{v['added_p99_ms']:+.1f}"
            errors = f" ({v['errors']} errors)" if v["errors"] else ""
            out.append(
                f"| {k}{errors} | {v['ttft_p50_ms']:.1f} | {v['ttft_p99_ms']:.1f} | {med} "
                f"| {pooled} |"
            )
        v = verdict.get(str(size))
        if v:
            out += [
                "",
                f"Bound at {RECOMMENDED_WORKERS} workers (nginx's median + "
                f"{BURST_MARGIN_MS:g} ms = {v['limit_ms']:+.1f} ms): "
                f"sluicegate {v['sluicegate_ms']:+.1f} ms, "
                f"{'met' if v['met'] else 'missed'}; the floor {v['floor_ms']:+.1f} ms, "
                f"{'within' if v['floor_met'] else 'outside'} it.",
            ]
        out.append("")
    return out[:-1] if out else out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--baseline-src")
    ap.add_argument(
        "--ab",
        action="store_true",
        help="only this router against --baseline-src's, alternating rounds (a cut's proof)",
    )
    ap.add_argument(
        "--burst",
        action="store_true",
        help="only the bursts (200 and 500 streams), --rounds rounds",
    )
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=SHORT)
    opts = ap.parse_args()
    c = Cluster()
    if opts.burst:
        try:
            up = c.mock("hop-burst", tokens=BURST_TOKENS, itl_ms=BURST_ITL_MS)
            one, two = _burst_router(c, up, 1), _burst_router(c, up, 2)
            got = bursts(c, up, one, two, dict.fromkeys(BURST_SIZES, opts.rounds))
        finally:
            c.close()
        print(json.dumps(got, indent=2))
        print("\n".join(burst_lines(got)))
        return 0
    if opts.ab:
        try:
            print(json.dumps(ab(c, opts.baseline_src, opts.rounds, 2.0, opts.tokens), indent=2))
        finally:
            c.close()
        return 0
    try:
        res = run(c, opts.quick, opts.baseline_src)
    finally:
        c.close()
    print(json.dumps(res, indent=2))
    print("\n".join(lines(res)))
    if opts.record:
        record(res)
    if opts.check:
        ok, message = check(res)
        print(message)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
