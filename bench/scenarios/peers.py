"""sluicegate beside the routers people would pick instead (`--only peers`, issue 50).

Two halves, one run:
- **On real engines**: kv_real's runner (bench/scenarios/kv_real.py: 2 vLLM CPU engines with KV
  events, `vllm bench serve`, rounds alternating, prefix caches emptied between targets), every
  target of both issues at once, so this run also fills `--only kv_real`'s figures and never
  starts the engines twice. This section shows the roomy size's `prefix_repetition` and `random`
  workloads: TTFT p50/p90/p99, ITL p50, tokens/s and the engines' own prefix-cache hit rates,
  and sluicegate's best TTFT p90 over the best peer's (`lead`).
- **On the hop** (mock engines, hop.py's loads): req/s and CPU per request (64-token streams, 32
  keep-alive users, HOP_ROUNDS alternating rounds) and the 200-stream burst (new connections,
  TTFT p99 over direct's in the same round), for sluicegate (every setting at its default), the
  vLLM router and smg (each at its default policy, `cache_aware`, logging at warning), beside
  nginx and the mock itself (direct).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.kit import peers
from bench.kit.nginx import start_nginx
from bench.kit.page import fmt, table
from bench.scenarios import hop, kv_real
from tests.support.harness import Cluster, Proc

HOP_ROUNDS = 5
BURST = 200  # issue 50: the 200-stream burst
BURST_ROUNDS = 9
HOP_POLICY = "cache_aware"  # both peers' default
PEER_KINDS = tuple(peers.PEERS)
SHOWN_SIZE = "roomy"  # the real-engine workloads this section shows (kv_real's shows both sizes)


def run(cluster: Cluster, quick: bool = False) -> dict[str, Any]:
    """The hop first (minutes, mock engines), then the real engines: {"hop", "real"}."""
    return {"hop": on_the_hop(cluster, quick), "real": kv_real.run(cluster, quick)}


def _peer_procs(bin_dir: Path, up: Proc, tmp: Path, label: str) -> dict[str, peers.Peer]:
    return {
        kind: peers.start(bin_dir, kind, HOP_POLICY, [up.url], tmp / f"{kind}-{label}.log")
        for kind in PEER_KINDS
    }


def on_the_hop(c: Cluster, quick: bool = False) -> dict[str, Any]:
    from router.tools.enginefleet.install import engine_home

    bin_dir = peers.ensure_peers(engine_home())
    fast = c.mock("peers-fast", tokens=hop.SHORT)
    bursty = c.mock("peers-burst", tokens=hop.BURST_TOKENS, itl_ms=hop.BURST_ITL_MS)
    backends = [
        {"name": "fast", "url": fast.url, "models": {"m": "mock-model"}},
        {"name": "burst", "url": bursty.url, "models": {"burst": "mock-model"}},
    ]
    router = c.router({"backends": backends}, env={"SLUICEGATE_LOG_LEVEL": "info"})
    started: list[Any] = [router, fast, bursty]
    rounds = 2 if quick else HOP_ROUNDS
    out: dict[str, Any] = {"rounds": rounds, "policy": HOP_POLICY}
    try:

        def targets_for(
            engine: Proc, model: str, tokens: int, name: str
        ) -> tuple[dict[str, tuple[hop.Target, bytes]], dict[str, peers.Peer]]:
            """One engine behind each: direct, sluicegate (as `model`), nginx, the peers."""
            plain = hop.body_of("mock-model", tokens)
            made: dict[str, tuple[hop.Target, bytes]] = {
                "direct": (engine, plain),
                "sluicegate": (router, hop.body_of(model, tokens)),
            }
            ngx = start_nginx(c, [engine])
            started.append(ngx)
            if ngx is not None:
                made["nginx"] = (ngx, plain)
            peers_of = _peer_procs(bin_dir, engine, c.tmp, name)
            started.extend(peers_of.values())
            return made | {kind: (p, plain) for kind, p in peers_of.items()}, peers_of

        short, near = targets_for(fast, "m", hop.SHORT, "fast")
        hop.load_rounds(short, 1, concurrency=32, duration=1.0)  # warm-up
        agg = hop.load_rounds(short, rounds, concurrency=32, duration=3.0)
        out["per_request"] = {
            k: {
                "rps": a["ok"] / a["elapsed"],
                "errors": a["errors"],
                "cpu_ms_per_req": sum(a["cpu"]) / a["ok"] * 1000
                if k != "direct" and a["ok"]
                else None,
            }
            for k, a in agg.items()
        }
        if "nginx" in agg:
            out["cpu_vs_nginx"] = {
                k: hop.ratio_spread(agg[k], agg["nginx"])
                for k in ("sluicegate", *PEER_KINDS)
                if agg[k]["ok"]
            }
        for p in near.values():
            p.stop()

        targets, _ = targets_for(bursty, "burst", hop.BURST_TOKENS, "burst")
        got = hop.burst_rounds(targets, {BURST: 3 if quick else BURST_ROUNDS})
        out["burst"] = got[str(BURST)]
    finally:
        for p in started:
            if p is not None:
                p.stop()
    return out


def _lead(d: dict[str, Any]) -> dict[str, Any] | None:
    """sluicegate's best TTFT p90 among its targets over the best peer's (below 1: it leads)."""
    t = d.get("targets", {})
    ours = [(v["ttft_p90_ms"], k) for k, v in t.items() if k in kv_real.OURS]
    theirs = [(v["ttft_p90_ms"], k) for k, v in t.items() if k in kv_real.PEER_TARGETS]
    if not ours or not theirs:
        return None
    (a, best_ours), (b, best_peer) = min(ours), min(theirs)
    return {"ours": best_ours, "peer": best_peer, "p90_x": round(a / b, 2), "leads": a <= b}


def real_lines(real: dict[str, Any]) -> list[str]:
    size = real.get("sizes", {}).get(SHOWN_SIZE)
    if not size:
        return []
    out = [
        f"**On 2 real vLLM CPU engines** ({size['kv_blocks']} KV blocks each; the same run as "
        "the `kv_real` section, which also shows the pressured size and issue 52's criteria). "
        f"{real['workload']}; {real.get('random', 'random prompts')}. Hit rate: the engines' "
        "own prefix-cache hits over queries during the target's runs.",
        "",
    ]
    for dataset in ("prefix", "random"):
        d = size.get(dataset)
        if not d:
            continue
        rows: list[tuple[str, ...]] = [
            ("target", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "tokens/s",
             "hit rate", "failed"),
        ]  # fmt: skip
        for name, t in d["targets"].items():
            label = name if name in kv_real.PEER_TARGETS else f"sluicegate {name}"
            rows.append(
                (
                    label,
                    fmt(t["ttft_p50_ms"]),
                    fmt(t["ttft_p90_ms"]),
                    fmt(t["ttft_p99_ms"]),
                    fmt(t["itl_p50_ms"]),
                    fmt(t["output_tokens_s"]),
                    fmt(t["hit_rate"]),
                    str(t["failed"]),
                )
            )
        lead = _lead(d)
        verdict = (
            f"Lead on TTFT p90: sluicegate {lead['ours']} over {lead['peer']}: "
            f"{lead['p90_x']:.2f}x ({'leads' if lead['leads'] else 'a peer leads'})."
            if lead
            else ""
        )
        out += [f"{dataset} prompts, {d['rounds']} rounds:", "", table(rows), "", verdict, ""]
    return out


def hop_lines(h: dict[str, Any]) -> list[str]:
    pr = h.get("per_request", {})
    ratio = h.get("cpu_vs_nginx", {})
    rows: list[tuple[str, ...]] = [
        ("target", "req/s (c=32)", "CPU ms/request", "CPU/request / nginx's",
         f"{BURST}-stream burst TTFT p99 ms", "added p99 over direct ms (median of rounds)"),
    ]  # fmt: skip
    burst = h.get("burst", {})
    for k in ("direct", "nginx", "sluicegate", *PEER_KINDS):
        if k not in pr:
            continue
        r = ratio.get(k)
        b = burst.get(k, {})
        added = b.get("added_p99_rounds_ms") or []
        errors = pr[k]["errors"] + b.get("errors", 0)
        rows.append(
            (
                k + (f" ({errors} errors)" if errors else ""),
                f"{pr[k]['rps']:.0f}",
                fmt(pr[k]["cpu_ms_per_req"]),
                f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})" if r else "-",
                fmt(b.get("ttft_p99_ms")),
                f"{statistics.median(added):+.1f}" if added else "-",
            )
        )
    return [
        f"**On the hop** (mock engines, {h['rounds']} alternating rounds of 3 s; the "
        f"{BURST}-stream burst on new connections, 64 tokens at 20 ms each). sluicegate with "
        f"every setting at its default; the peers at their default policy ({h['policy']}), "
        "logging at warning. CPU: the process tree's user + system time per request.",
        "",
        table(rows),
        "",
    ]


def section(res: dict[str, Any], real: dict[str, Any] | None, date: str) -> list[str]:
    """The page's section: the real engines' rows (from kv_real's figures) and the hop's."""
    lines = [
        "## sluicegate beside the peer routers (`--only peers`, issue 50)",
        "",
        f"`python -m bench.run --only peers`, {date}: "
        f"{', '.join(peers.PEERS.values())}, installed into the benchmark's own venv "
        "(bench/kit/peers.py); bench/scenarios/peers.py.",
        "",
    ]
    if real:
        lines += real_lines(real)
    if "per_request" in res.get("hop", {}):
        lines += hop_lines(res["hop"])
    return lines[:-1] if lines[-1] == "" else lines
