"""Noisy neighbour (`python -m bench.run --only noisy`; `python -m bench.scenarios.noisy [--quick]
[--write-docs]` runs it with the priority scenario and updates its section of the docs).

A fleet of mock engines with a known number of slots (`max_inflight`), the admission queue on,
two client keys A and B in the same band with equal weights. B alone first (its solo TTFT), then
A floods at 10x the fleet's capacity while B keeps sending at 20 % of it; then the same with a key
A2 that has an `rpm` quota (429 once past it). Targets (issue 12):
B gets no error and its TTFT p99 stays within its solo p99 plus 5 slot turnovers (mean request
duration / slots); A is queued, then refused with 503 (or 429 over a quota) carrying
`Retry-After`, and every A request is answered within `max_wait` plus a margin: none hangs.

Traffic is like real traffic in the one way that matters here: output lengths differ from request
to request (`max_tokens` drawn uniformly from `LENGTHS`, which the mock generates exactly), so
the slots free one at a time, not all together. Arrivals are open-loop, A's Poisson, B's evenly
spaced ("steadily", as the issue has it: Poisson bursts of B's own stack its fair-queue tags
behind A's, by design, and cost it a few turnovers more at p99); a flood that waited for its own
answers would slow down with the fleet and flood nothing. A's load runs in a
child process (bench/kit/traffic.py's `flood`), so B's timings are not taken on a loop busy
with A's hundreds of connections. Loopback only, bounded in requests and time.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from typing import Any

import uvloop

from bench.kit.cluster import ROOT
from bench.kit.procstat import cpu_seconds
from bench.kit.traffic import LENGTHS, Traffic, collect, durations, flood, open_loop
from bench.scenarios.admission import priorities
from tests.support.harness import Cluster, Proc

ITL_MS = 10.0
BACKENDS = 2
SLOTS = 3  # max_inflight per backend
MAX_WAIT = 2.0  # admission.max_wait in this scenario
MARGIN = 1.0  # seconds past max_wait an answer may take (a busy machine stalls loops)


def key_entry(secret: str, name: str, **extra: Any) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(secret.encode()).hexdigest(), "name": name, **extra}


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def scenario(c: Cluster, seconds: float) -> dict[str, dict[str, Any]]:
    """One fleet and router: B alone, then A floods beside B (`noisy`), then, once A's queue
    has drained, a second key A2 with an `rpm` quota floods beside B (`noisy_quota`)."""
    mocks = [c.mock(f"n{i}", itl_ms=ITL_MS) for i in range(BACKENDS)]
    slots = BACKENDS * SLOTS
    # A2's quota lets about the first third of its flood through (nominal capacity: 20 req/s).
    rpm = int(10 * slots / (0.001 * ITL_MS * sum(LENGTHS) / len(LENGTHS)) * seconds / 3)
    cfg = {
        "backends": [
            {"name": f"n{i}", "url": m.url, "models": {"m": "mock-model"}, "max_inflight": SLOTS}
            for i, m in enumerate(mocks)
        ],
        "health": {"interval": 60},
        "admission": {"max_wait": MAX_WAIT, "max_queue": 2000},
        "api_keys": [
            key_entry("sk-noisy-a", "a"),
            key_entry("sk-noisy-a2", "a2", rpm=rpm),
            key_entry("sk-noisy-b", "b"),
        ],
    }
    router = c.router(cfg, env={"SLUICEGATE_LOG_LEVEL": "warning"})
    res: dict[str, dict[str, Any]] = {}
    try:
        b_auth = "authorization: Bearer sk-noisy-b\r\n"
        took = durations(router.port, b_auth)
        mean_s = sum(took) / len(took)
        turnover = mean_s / slots
        capacity = slots / mean_s  # requests per second the fleet completes, all slots busy
        b_rate = 0.2 * capacity
        solo = asyncio.run(open_loop(router.port, b_rate, seconds, b_auth, 30, 1, steady=True))
        for name, secret in (("noisy", "sk-noisy-a"), ("noisy_quota", "sk-noisy-a2")):
            spec = {"port": router.port, "rate": 10 * capacity, "seconds": seconds + 2}
            before = _metrics(router)
            cpu0, wall0 = cpu_seconds(router.pid), time.perf_counter()
            lengths = [LENGTHS[0], LENGTHS[-1] + 1]
            # A client that gives up well after max_wait: an answer that late counts as a hang.
            a_load = flood({**spec, "secret": secret, "lengths": lengths, "give_up": MAX_WAIT + 10})
            time.sleep(1.0)  # the queue fills
            seed = len(res) + 2
            noisy = asyncio.run(
                open_loop(router.port, b_rate, seconds, b_auth, 30, seed, steady=True)
            )
            a = collect(a_load, seconds + 60)
            cpu_share = (cpu_seconds(router.pid) - cpu0) / (time.perf_counter() - wall0)
            after = _metrics(router)
            metrics: dict[str, Any] = {
                kind: {k: v - before[kind].get(k, 0.0) for k, v in after[kind].items()}
                for kind in after
            }
            metrics["cpu_share_under_flood"] = round(cpu_share, 3)
            if name == "noisy_quota":
                a["rpm"] = rpm
            res[name] = _judge(solo, noisy, a, turnover, mean_s, capacity, slots, metrics)
            time.sleep(MAX_WAIT + 0.5)  # A's queue drains before the next flood
    finally:
        router.stop()
        for m in mocks:
            m.stop()
    return res


def _metrics(router: Proc) -> dict[str, dict[str, float]]:
    import httpx

    text = httpx.get(router.url + "/metrics", timeout=10).text
    shed: dict[str, float] = {}
    limited: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sluicegate_shed_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            shed[reason] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("sluicegate_ratelimited_total{"):
            limit = line.split('limit="', 1)[1].split('"', 1)[0]
            limited[limit] = limited.get(limit, 0.0) + float(line.rsplit(" ", 1)[1])
    return {"shed_total": shed, "ratelimited_total": limited}


def _judge(
    solo: Traffic,
    noisy: Traffic,
    a: dict[str, Any],
    turnover: float,
    mean_s: float,
    capacity: float,
    slots: int,
    metrics: dict[str, Any],
) -> dict[str, Any]:
    solo_ttft = [o.first for o in solo.outcomes if o.status == 200]
    noisy_ttft = [o.first for o in noisy.outcomes if o.status == 200]
    b_errors = sum(1 for o in noisy.outcomes if o.status != 200)
    solo_p99 = _pct(solo_ttft, 0.99)
    noisy_p99 = _pct(noisy_ttft, 0.99)
    goal = solo_p99 + 5 * turnover
    a_status = a["status"]
    refused = a_status.get("503", 0) + a_status.get("429", 0)
    limit = MAX_WAIT + MARGIN
    a_slowest = max(a["slowest_answer_s"].values(), default=0.0)
    a_ok = (
        a_status.get("0", 0) == 0
        and refused > 0
        and a["refusals_without_retry_after"] == 0
        and a_slowest <= limit
    )
    return {
        "fleet": {
            "backends": BACKENDS,
            "slots": slots,
            "mean_request_s": round(mean_s, 4),
            "turnover_s": round(turnover, 4),
            "capacity_rps": round(capacity, 2),
        },
        "b": {
            "rate_rps": round(0.2 * capacity, 2),
            "solo_requests": len(solo.outcomes),
            "solo_errors": sum(1 for o in solo.outcomes if o.status != 200),
            "solo_ttft_p50_ms": round(1000 * _pct(solo_ttft, 0.5), 2),
            "solo_ttft_p99_ms": round(1000 * solo_p99, 2),
            "requests": len(noisy.outcomes),
            "errors": b_errors,
            "ttft_p50_ms": round(1000 * _pct(noisy_ttft, 0.5), 2),
            "ttft_p99_ms": round(1000 * noisy_p99, 2),
            "ttft_p99_extra_turnovers": round((noisy_p99 - solo_p99) / turnover, 2),
            "loadgen_lag_max_s": round(noisy.lag_max_s, 3),
            "goal_ttft_p99_ms": round(1000 * goal, 2),
            "met": b_errors == 0 and noisy_p99 <= goal,
        },
        "a": {
            "rate_rps": round(10 * capacity, 2),
            **a,
            "answer_limit_s": limit,
            "met": a_ok,
        },
        "router": metrics,
    }


def run(c: Cluster, quick: bool = False) -> dict[str, Any]:
    res = scenario(c, 6.0 if quick else 25.0)
    for name, r in res.items():
        print(name, json.dumps(r), flush=True)
    return res


Row = tuple[str, str, Any, bool | None]


def _target_table(rows: list[Row]) -> list[str]:
    if not rows:
        return []
    out = ["| target | goal | measured | met |", "|---|---|---|---|"]
    for name, goal, value, ok in rows:
        met = "-" if ok is None else ("yes" if ok else "no")
        out.append(f"| {name} | {goal} | {value} | {met} |")
    return [*out, ""]


def targets(r: dict[str, Any]) -> list[Row]:
    """Issue 12's noisy-neighbour targets beside what this run measured."""
    rows: list[Row] = []
    for name in ("noisy", "noisy_quota"):
        n = r.get(name)
        if not n:
            continue
        b, a = n["b"], n["a"]
        tag = "noisy neighbour" + (f" (A with rpm {a.get('rpm')})" if "rpm" in a else "")
        rows.append((f"{tag}: B errors", "0", b["errors"], b["errors"] == 0))
        rows.append(
            (
                f"{tag}: B TTFT p99 ms",
                f"<= solo p99 + 5 turnovers = {b['goal_ttft_p99_ms']}",
                b["ttft_p99_ms"],
                b["ttft_p99_ms"] <= b["goal_ttft_p99_ms"],
            )
        )
        refused = ", ".join(f"{k}: {v}" for k, v in sorted(a["status"].items()) if k != "200")
        rows.append(
            (
                f"{tag}: A refused with Retry-After, none hangs",
                f"all answered <= {a['answer_limit_s']} s",
                f"{refused}, slowest {max(a['slowest_answer_s'].values(), default=0)} s",
                a["met"],
            )
        )
    return rows


def priority_targets(r: dict[str, Any]) -> list[Row]:
    """Issue 12's priority target beside what this run measured."""
    rows: list[Row] = []
    pr = r.get("admission", {}).get("priority", {}).get("jittered")
    if pr:
        mean = pr["critical_extra_wait_turnovers"]["mean"]
        rows.append(
            (
                "priority: critical wait behind a sheddable flood (turnovers, mean)",
                "<= 1",
                f"{mean} (router: {pr['router_critical_queue_wait_turnovers']}, "
                f"{pr['critical_requests']} requests)",
                mean is not None and mean <= 1,
            )
        )
    return rows


def section(r: dict[str, Any]) -> list[str]:
    """The noisy-neighbour section of docs/benchmarks.md."""
    out = ["## Noisy neighbour (`--only noisy`)", "", *_target_table(targets(r))]
    n = r.get("noisy")
    if n:
        f = n["fleet"]
        out += [
            f"{f['backends']} mock engines x {SLOTS} slots (`max_inflight`), "
            f"output lengths uniform {LENGTHS[0]}..{LENGTHS[-1]} tokens at {ITL_MS:.0f} ms a "
            f"token: mean request {f['mean_request_s']} s, turnover (mean / slots) "
            f"{f['turnover_s']} s, capacity {f['capacity_rps']} req/s. Admission "
            f"`max_wait: {MAX_WAIT:g}`; keys A and B, same band, weight 1. B: evenly spaced "
            "arrivals at 0.2x capacity, alone first, then beside A: Poisson at 10x capacity "
            "(a child process); then the same beside a key A2 with an `rpm` quota. Loop stall: "
            "the worst lateness of a 10 ms timer in the load generators (this machine's noise).",
            "",
            "| run | B TTFT p50 / p99 ms | B solo p99 ms | B p99 extra (turnovers) | B errors "
            "| A statuses | A slowest answer s | A refusals without Retry-After | loop stall "
            "B / A s |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in ("noisy", "noisy_quota"):
            if name not in r:
                continue
            b, a = r[name]["b"], r[name]["a"]
            label = f"A with `rpm: {a['rpm']}`" if "rpm" in a else "A without quota"
            out.append(
                f"| {label} | {b['ttft_p50_ms']} / {b['ttft_p99_ms']} | {b['solo_ttft_p99_ms']} "
                f"| {b['ttft_p99_extra_turnovers']} | {b['errors']} "
                f"| {', '.join(f'{k}: {v}' for k, v in sorted(a['status'].items()))} "
                f"| {max(a['slowest_answer_s'].values(), default=0)} "
                f"| {a['refusals_without_retry_after']} "
                f"| {b['loadgen_lag_max_s']} / {a['loadgen_lag_max_s']} |"
            )
        out += [
            "",
            "B waits for the next free slot and no longer: the fair order puts it ahead of A's "
            "queued requests, and A's requests that leave unserved are not refunded to A (before "
            "that fix B's p99 was 1.9 s, 38 turnovers). That wait has its own tail: the priority "
            "table's *jittered* p99 is about 3.3 turnovers, so the 5-turnover target has little "
            "margin: on this shared machine B's p99 extra ranged from 1.7 to 5.1 turnovers "
            "between runs.",
        ]
        out.append("")
    return out


def priority_section(r: dict[str, Any]) -> list[str]:
    """The admission priority section of docs/benchmarks.md."""
    out = [
        "## Admission priority (`--only admission`)",
        "",
        *_target_table(priority_targets(r)),
    ]
    pr = r.get("admission", {}).get("priority")
    if pr:
        out += [
            "One engine, 4 slots, 64 `sheddable` clients in a closed loop, one "
            "`critical` stream at a time at a random phase. Extra time to first token over the "
            "idle fleet's, in slot turnovers; the router's own queue wait for the band "
            "(`sluicegate_queue_wait_seconds`) beside it; *independent slots*: the mean wait for "
            "the first of 4 slots to free had they run these durations independently.",
            "",
            "| output lengths | turnover ms | critical extra wait mean / p50 / p99 | router queue "
            "wait mean | independent slots | critical requests |",
            "|---|---|---|---|---|---|",
        ]
        for name, p in pr.items():
            w = p["critical_extra_wait_turnovers"]
            lo, hi = p["lengths"]
            lengths = f"{name}: {lo}" if lo == hi else f"{name}: {lo}..{hi}"
            out.append(
                f"| {lengths} | {1000 * p['turnover_s']:.0f} | {w['mean']} / {w['p50']} / "
                f"{w['p99']} | {p['router_critical_queue_wait_turnovers']} "
                f"| {p['ideal_wait_turnovers']} | {p['critical_requests']} |"
            )
        out += [
            "",
            "With every request the same length the slots free together once a request time, "
            "so a critical request waits for that one release: half a request time on average, "
            "two turnovers. The queue wakes the critical request on the first release (the "
            "mock's start times put it first of every batch, and the router's queue wait is the "
            "client's extra wait): with lengths that vary, the wait is the time to the next free "
            "slot, which has a tail (p99) when the running requests are all long ones; its mean "
            "is what the one-turnover target can bound.",
            "",
        ]
    return out


def write_docs(results: dict[str, Any]) -> None:
    """Replace this scenario's and the priority one's sections of docs/benchmarks.md."""
    from bench.kit.page import splice_page

    splice_page(
        ROOT / "docs" / "benchmarks.md",
        [("noisy", section(results)), ("admission", priority_section(results))],
    )


if __name__ == "__main__":
    uvloop.install()
    quick = "--quick" in sys.argv
    cluster = Cluster()
    try:
        results = run(cluster, quick)
        results["admission"] = {"priority": priorities(cluster, quick)}
    finally:
        cluster.close()
    print(json.dumps(results, indent=2))
    (ROOT / "bench" / "results" / "noisy.json").write_text(json.dumps(results, indent=2))
    if "--write-docs" in sys.argv:
        write_docs(results)
