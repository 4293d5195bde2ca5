"""Latency-aware routing on a mixed pool (`python -m bench.run --only latency`; issue 50).

Five mock vLLM engines (`--engine`): two fast, two four times slower (prefill and decode steps),
one as fast as the first two but carrying hidden load (sequences that never pass through the
router, which its readings show as running). One open-loop trace of long-tailed prompts
(Pareto, 100 to 8000 tokens, each prompt unique so that no prefix cache helps one engine more
than another) and `max_tokens` from 16 to 64, the same seed for every policy, through a router
with `least_inflight`, `least_load`, `least_load` with hand-set weights (each backend's `weight`
set to its engine's speed: the informed reference), `cache_aware`, `latency`, and `latency`
with every request carrying `x-slo-ttft-ms` (one SLO for all: routed as lowest predicted), and
`latency` with mixed SLOs (every other request tight, the rest loose: packing's case, each
class's attainment beside `latency` without SLOs on the same trace). Each router gets a warm-up of
the same kind of traffic (another seed; `latency` learns from it, `cache_aware` calibrates)
before the measured trace. Reported per policy: TTFT p50/p90/p99 (the client's first body
byte: the mock sends no role-only chunk first), output tokens per second, SLO attainment at
SLO_MS, the share per engine; for `latency` the router's own prediction error (observed /
predicted TTFT, its histogram's quantiles). Then the sheddable overload case: 1.3x the pool's
capacity, a third of it `sheddable`, `latency` with admission and shedding (the admission
queue's wait counted against the SLO) against `least_load` with admission and against
`latency` shedding nothing; standard traffic's SLO attainment.
Loopback only, bounded in requests and time.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from typing import Any

import httpx
import uvloop

from bench.kit.stats import pct
from bench.kit.traffic import Client, Outcome
from tests.support.harness import Cluster, Proc, stats

FAST = ["--prefill-ms-per-1k", "10", "--decode-ms", "5", "--decode-ms-per-seq", "0.2"]
SLOW = ["--prefill-ms-per-1k", "40", "--decode-ms", "20", "--decode-ms-per-seq", "0.8"]
COMMON = ["--engine", "--max-num-seqs", "24", "--kv-tokens", "262144"]
HIDDEN = ["--background", "10", "--background-prompt", "3000", "--background-tokens", "300"]
ENGINES = {
    "fast1": FAST,
    "fast2": FAST,
    "slow1": SLOW,
    "slow2": SLOW,
    "hidden": [*FAST, *HIDDEN],
}
# The informed reference's weights: each engine's speed relative to a slow one (the hidden
# load's share guessed at half its engine).
WEIGHTS = {"fast1": 4.0, "fast2": 4.0, "slow1": 1.0, "slow2": 1.0, "hidden": 2.0}
SLO_MS = 60.0
OVER_SLOTS = 2  # max_inflight per backend in the overload case
OVER_SLO_MS = 500.0  # its TTFT SLO (queueing included)
OVER_ROUNDS = 2  # each policy's turns in the overload case, in a rotated order
# Packing's own case: every other request with a tight TTFT SLO, the rest with a loose one;
# each class's attainment against its own SLO, beside `latency` with no SLO header (lowest
# predicted) on the same trace.
TIGHT_MS = 30.0
LOOSE_MS = 150.0
POLICIES = (  # label, balancer, hand weights, SLO headers ("", "one", "mixed")
    ("least_inflight", "least_inflight", False, ""),
    ("least_load", "least_load", False, ""),
    ("least_load, hand weights", "least_load", True, ""),
    ("cache_aware", "cache_aware", False, ""),
    ("latency", "latency", False, ""),
    ("latency, x-slo-ttft-ms", "latency", False, "one"),
    ("latency, mixed SLOs", "latency", False, "mixed"),
)


def _trace(seed: int, rate: float, seconds: float) -> list[tuple[float, bytes, int]]:
    """(send at, body, max_tokens): Poisson arrivals, Pareto prompt lengths, unique prompts."""
    rng = random.Random(seed)
    out: list[tuple[float, bytes, int]] = []
    at = 0.0
    i = 0
    while True:
        at += rng.expovariate(rate)
        if at > seconds:
            return out
        tokens = min(8000, int(100 * rng.paretovariate(1.1)))
        max_tokens = rng.randint(16, 64)
        text = f"{seed}-{i} " + "lorem " * ((tokens * 4) // 6)  # the mock: len(text) // 4
        body = {
            "model": "m",
            "stream": True,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": text}],
        }
        out.append((at, json.dumps(body).encode(), max_tokens))
        i += 1


async def _replay(
    port: int, trace: list[tuple[float, bytes, int]], headers: str, give_up: float
) -> list[tuple[Outcome, int]]:
    client = Client("127.0.0.1", port, headers, give_up)
    t0 = time.perf_counter()

    async def one(at: float, body: bytes, n: int) -> tuple[Outcome, int]:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        return await client.send(body), n

    try:
        return list(await asyncio.gather(*(one(a, b, n) for a, b, n in trace)))
    finally:
        client.close()


async def _replay_as(
    port: int, trace: list[tuple[float, bytes, int]], headers: str, mixed: bool
) -> list[tuple[Outcome, int]]:
    """`_replay`, or with `mixed` the even requests with TIGHT_MS and the odd with LOOSE_MS
    (two clients at once), the results in the trace's order."""
    if not mixed:
        return await _replay(port, trace, headers, 60)
    tight, loose = await asyncio.gather(
        _replay(port, trace[0::2], f"x-slo-ttft-ms: {TIGHT_MS:g}\r\n", 60),
        _replay(port, trace[1::2], f"x-slo-ttft-ms: {LOOSE_MS:g}\r\n", 60),
    )
    out: list[tuple[Outcome, int]] = []
    for i in range(len(trace)):
        out.append(tight[i // 2] if i % 2 == 0 else loose[i // 2])
    return out


def _by_class(results: list[tuple[Outcome, int]]) -> list[float]:
    """Attainment of the even requests at TIGHT_MS and of the odd ones at LOOSE_MS."""
    out = []
    for start, slo in ((0, TIGHT_MS), (1, LOOSE_MS)):
        part = results[start::2]
        met = sum(1 for o, _ in part if o.status == 200 and o.first * 1000 <= slo)
        out.append(round(met / max(1, len(part)), 3))
    return out


def _metric_lines(router: Proc, name: str) -> list[tuple[str, float]]:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return [
        (m.group(1) or "", float(m.group(2)))
        for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    ]


def _ratio_quantiles(router: Proc) -> dict[str, float | None]:
    """Observed / predicted TTFT from the router's histogram: its p50 and p90 bucket bounds and
    the share within [0.5, 1.5]."""
    buckets = [
        (float(re.search(r'le="([^"]+)"', labels).group(1)), v)  # type: ignore[union-attr]
        for labels, v in _metric_lines(router, "sluicegate_ttft_prediction_ratio_bucket")
    ]
    buckets.sort()
    total = buckets[-1][1] if buckets else 0.0
    if not total:
        return {"p50": None, "p90": None, "within_1.5x": None, "n": 0}

    def q(p: float) -> float:
        return next(le for le, v in buckets if v >= p * total)

    below = dict(buckets)
    within = (below.get(1.5, 0.0) - below.get(0.5, 0.0)) / total
    return {"p50": q(0.5), "p90": q(0.9), "within_1.5x": round(within, 3), "n": int(total)}


def _reasons(router: Proc) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in _metric_lines(router, "sluicegate_routing_decisions_total"):
        m = re.search(r'reason="([^"]+)"', labels)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def _settle(mocks: dict[str, Proc]) -> None:
    """Wait (bounded) until no routed request runs on the engines, then empty their caches."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        busy = 0.0
        for m in mocks.values():
            text = httpx.get(m.url + "/metrics", timeout=5).text
            found = re.search(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M)
            busy += float(found.group(1)) if found else 0.0
        if busy == 0:
            break
        time.sleep(0.2)
    for m in mocks.values():
        httpx.post(m.url + "/control", json={"reset_prefix_cache": True}, timeout=5)


def _row(
    results: list[tuple[Outcome, int]], wall: float, by_backend: dict[str, float]
) -> dict[str, Any]:
    ok = [(o, n) for o, n in results if o.status == 200]
    ttft = [o.first for o, _ in ok]
    return {
        "requests": len(results),
        "ok": len(ok),
        "ttft_p50_ms": round(pct(ttft, 0.5) * 1000, 1),
        "ttft_p90_ms": round(pct(ttft, 0.9) * 1000, 1),
        "ttft_p99_ms": round(pct(ttft, 0.99) * 1000, 1),
        "tokens_per_s": round(sum(n for _, n in ok) / wall, 1),
        "slo_attainment": round(
            sum(1 for t in ttft if t * 1000 <= SLO_MS) / max(1, len(results)), 3
        ),
        "share": by_backend,
    }


def run(c: Cluster, quick: bool) -> dict[str, Any]:
    rate = 18.0 if quick else 24.0
    seconds = 8.0 if quick else 30.0
    warm = 5.0 if quick else 15.0
    mocks = {name: c.mock(name, engine_args=[*COMMON, *args]) for name, args in ENGINES.items()}
    trace = _trace(1, rate, seconds)
    warmup = _trace(2, rate, warm)
    rows: dict[str, Any] = {}
    for label, balancer, weighted, slo in POLICIES:
        _settle(mocks)
        config = {
            "backends": [
                {
                    "name": n,
                    "url": m.url,
                    "models": {"m": "mock-model"},
                    **({"weight": WEIGHTS[n]} if weighted else {}),
                }
                for n, m in mocks.items()
            ],
            "balancer": balancer,
            "engine_metrics": {"interval": 0.25},
            "expose_backend_header": True,
            "health": {"interval": 60},
        }
        router = c.router(config, env={"SLUICEGATE_LOG_LEVEL": "warning"})
        headers = f"x-slo-ttft-ms: {SLO_MS:g}\r\n" if slo == "one" else ""
        try:
            uvloop.run(_replay_as(router.port, warmup, headers, slo == "mixed"))
            before = {n: float(stats(m)["requests"]) for n, m in mocks.items()}
            t0 = time.perf_counter()
            results = uvloop.run(_replay_as(router.port, trace, headers, slo == "mixed"))
            wall = time.perf_counter() - t0
            after = {n: float(stats(m)["requests"]) for n, m in mocks.items()}
            total = sum(after[n] - before[n] for n in mocks) or 1.0
            share = {n: round((after[n] - before[n]) / total, 3) for n in mocks}
            row = _row(results, wall, share)
            if balancer == "latency":
                row["prediction"] = _ratio_quantiles(router)
                row["reasons"] = _reasons(router)
                if slo != "one":
                    row["tight_loose"] = _by_class(results)
            rows[label] = row
            print(f"latency bench: {label}: {row}", flush=True)
        finally:
            router.stop()
    return {
        "rate": rate,
        "seconds": seconds,
        "warmup_seconds": warm,
        "slo_ms": SLO_MS,
        "requests": len(trace),
        "policies": rows,
        "overload": overload(c, mocks, quick),
    }


def _closed(port: int, trace: list[tuple[float, bytes, int]], users: int, seconds: float) -> int:
    """Answers completed by `users` clients sending back to back for `seconds`."""

    async def go() -> int:
        client = Client("127.0.0.1", port, "", 30)
        stop = time.perf_counter() + seconds
        done = 0

        async def user(i: int) -> None:
            nonlocal done
            j = i
            while time.perf_counter() < stop:
                got = await client.send(trace[j % len(trace)][1])
                done += got.status == 200
                j += users

        try:
            await asyncio.gather(*(user(i) for i in range(users)))
        finally:
            client.close()
        return done

    return uvloop.run(go())


async def _both(
    port: int,
    std: list[tuple[float, bytes, int]],
    shed: list[tuple[float, bytes, int]],
    slo: str,
    shed_slo: bool,
) -> tuple[list[tuple[Outcome, int]], list[tuple[Outcome, int]]]:
    """Standard and sheddable traffic at once, on connections of their own; the sheddable
    requests carry the SLO only if `shed_slo` (without it, none can be shed for it)."""
    sheddable = (slo if shed_slo else "") + "x-sluicegate-priority: sheddable\r\n"
    a, b = await asyncio.gather(_replay(port, std, slo, 30), _replay(port, shed, sheddable, 30))
    return a, b


def overload(c: Cluster, mocks: dict[str, Proc], quick: bool) -> dict[str, Any]:
    """1.3x the pool's capacity (OVER_SLOTS per backend, measured with a closed loop through
    `least_load`), a third of the requests `sheddable`, every one with a TTFT SLO of
    OVER_SLO_MS; `least_load` with admission against `latency` with admission (which sheds a
    sheddable request no engine is predicted to serve in time). Standard traffic's SLO
    attainment (its answers within the SLO over its requests) is what shedding is for."""
    seconds = 8.0 if quick else 20.0
    trace = _trace(3, 10.0, 60.0)
    backends = [
        {"name": n, "url": m.url, "models": {"m": "mock-model"}, "max_inflight": OVER_SLOTS}
        for n, m in mocks.items()
    ]
    base = {
        "backends": backends,
        "engine_metrics": {"interval": 0.25},
        "admission": {"max_wait": 3.0},
        "health": {"interval": 60},
    }
    out: dict[str, Any] = {"slo_ms": OVER_SLO_MS, "seconds": seconds, "rounds": OVER_ROUNDS}
    policies = [
        ("least_load + admission", "least_load", True),
        # The same routing with nothing shed (the sheddable requests carry no SLO): what the
        # shedding itself adds.
        ("latency, no shedding", "latency", False),
        ("latency + shedding", "latency", True),
    ]
    slo = f"x-slo-ttft-ms: {OVER_SLO_MS:g}\r\n"
    # At 1.3x, standard traffic alone is 0.87x the capacity: a shared machine slowing by a
    # tenth during one policy's turn tips it over. Each round runs the policies in another
    # order, and each policy's own closed-loop capacity is reported beside it.
    for rnd in range(OVER_ROUNDS):
        for label, balancer, shed_slo in policies[rnd % 3 :] + policies[: rnd % 3]:
            _settle(mocks)
            proc = c.router({**base, "balancer": balancer}, env={"SLUICEGATE_LOG_LEVEL": "warning"})
            try:
                users = OVER_SLOTS * len(mocks)
                warm = 3.0 if quick else 8.0
                capacity = _closed(proc.port, trace, users, warm) / warm
                out.setdefault("capacity_rps", round(capacity, 1))
                rate = 1.3 * out["capacity_rps"]
                load = _trace(4 + rnd, rate, seconds)
                shed = [x for i, x in enumerate(load) if i % 3 == 2]
                std = [x for i, x in enumerate(load) if i % 3 != 2]
                got_std, got_shed = uvloop.run(_both(proc.port, std, shed, slo, shed_slo))
                _tally(out.setdefault(label, {}), got_std, got_shed, capacity)
                print(f"latency bench: overload round {rnd}, {label}: {out[label]}", flush=True)
            finally:
                proc.stop()
    return out


def _tally(
    row: dict[str, Any],
    got_std: list[tuple[Outcome, int]],
    got_shed: list[tuple[Outcome, int]],
    capacity: float,
) -> None:
    """One round's counts added into a policy's row (its attainment per round kept too)."""
    met = sum(1 for o, _ in got_std if o.status == 200 and o.first * 1000 <= OVER_SLO_MS)
    row.setdefault("rounds", []).append(
        {
            "standard_attainment": round(met / max(1, len(got_std)), 3),
            "standard_ttft_p90_ms": round(
                pct([o.first for o, _ in got_std if o.status == 200] or [0.0], 0.9) * 1000, 1
            ),
            "capacity_rps_here": round(capacity, 1),
        }
    )
    for key, n in (
        ("met", met),
        ("standard_ok", sum(1 for o, _ in got_std if o.status == 200)),
        ("standard", len(got_std)),
        ("sheddable_ok", sum(1 for o, _ in got_shed if o.status == 200)),
        ("sheddable_429", sum(1 for o, _ in got_shed if o.status == 429)),
        ("sheddable_503", sum(1 for o, _ in got_shed if o.status == 503)),
        ("sheddable", len(got_shed)),
    ):
        row[key] = row.get(key, 0) + n
    row["standard_attainment"] = round(row["met"] / max(1, row["standard"]), 3)


def section(res: dict[str, Any], date: str) -> list[str]:
    rows = res["policies"]
    ref = rows.get("least_load", {})
    out = [
        "## Latency-aware routing (mixed pool)",
        "",
        f"Measured {date} (`python -m bench.run --only latency`, bench/scenarios/latency.py): five "
        "mock engines (two fast, two 4x slower, one fast with hidden load), one open-loop "
        f"trace of {res['requests']} long-tailed prompts at {res['rate']:g} req/s over "
        f"{res['seconds']:g} s after a {res['warmup_seconds']:g} s warm-up; TTFT SLO "
        f"{res['slo_ms']:g} ms.",
        "",
        "| policy | TTFT p50 ms | p90 | p99 | tokens/s | SLO attainment | p90 vs least_load |"
        " share fast/slow/hidden |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        share = r["share"]
        fast = share.get("fast1", 0) + share.get("fast2", 0)
        slow = share.get("slow1", 0) + share.get("slow2", 0)
        vs = r["ttft_p90_ms"] / ref["ttft_p90_ms"] if ref.get("ttft_p90_ms") else None
        out.append(
            f"| {label} | {r['ttft_p50_ms']:g} | {r['ttft_p90_ms']:g} | {r['ttft_p99_ms']:g} | "
            f"{r['tokens_per_s']:g} | {r['slo_attainment']:.3f} | "
            f"{'-' if vs is None else f'{vs:.2f}x'} | "
            f"{fast:.2f}/{slow:.2f}/{share.get('hidden', 0):.2f} |"
        )
    mixed = [(k, r["tight_loose"]) for k, r in rows.items() if "tight_loose" in r]
    if mixed:
        out += [
            "",
            f"Attainment of the even requests at {TIGHT_MS:g} ms / the odd ones at "
            f"{LOOSE_MS:g} ms (in `latency, mixed SLOs` they carry those SLOs, and the loose "
            "ones are packed; elsewhere they carry none): "
            + "; ".join(f"{k} {t:.2f} / {lo:.2f}" for k, (t, lo) in mixed)
            + ".",
        ]
    pred = rows.get("latency", {}).get("prediction")
    if pred and pred.get("n"):
        out += [
            "",
            f"`latency`'s prediction error (observed / predicted TTFT, {pred['n']} streamed "
            f"answers, warm-up included): p50 bucket <= {pred['p50']}, p90 bucket <= "
            f"{pred['p90']}, {pred['within_1.5x']:.0%} within [0.5, 1.5].",
        ]
    over = res.get("overload") or {}
    rows_over = [(k, v) for k, v in over.items() if isinstance(v, dict)]
    if rows_over:
        out += [
            "",
            f"Sheddable overload: 1.3x the pool's measured capacity ({over['capacity_rps']:g} "
            f"req/s with {OVER_SLOTS} slots per backend) for {over['seconds']:g} s, a third "
            f"`sheddable`, every request with a TTFT SLO of {over['slo_ms']:g} ms (queueing "
            f"included), admission on (`max_wait` 3 s); {over.get('rounds', 1)} rounds, the "
            "policies in a rotated order, counts summed (per round: standard attainment, "
            "standard TTFT p90, and the capacity a closed loop measured just before).",
            "",
            "| policy | standard SLO attainment | per round | standard answered | "
            "sheddable answered | sheddable 429 slo_unattainable | sheddable 503 |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, r in rows_over:
            rounds = "; ".join(
                f"{x['standard_attainment']:.2f}, p90 {x['standard_ttft_p90_ms']:g} ms, "
                f"{x['capacity_rps_here']:g} req/s"
                for x in r.get("rounds", [])
            )
            out.append(
                f"| {label} | {r['standard_attainment']:.3f} | {rounds or '-'} | "
                f"{r['standard_ok']}/{r['standard']} | {r['sheddable_ok']}/{r['sheddable']} | "
                f"{r['sheddable_429']} | {r['sheddable_503']} |"
            )
    return [*out, ""]
