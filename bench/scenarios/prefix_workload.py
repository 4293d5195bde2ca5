"""Cache-aware routing on multi-turn chat (`python -m bench.run --only prefix`, ~4 minutes).

Alone: `python -m bench.scenarios.prefix_workload [--quick] [--variants=chat:least_inflight,...]
[--engine=--prefill-ms-per-1k=30,--max-num-seqs=8]` (another engine calibration) prints JSON.

Workload *chat*: many customers, each with its own long system prompt (2k-5k tokens), each
holding a few conversations, one after another, that grow turn by turn (every turn resends the
system prompt and all earlier user and assistant messages). A fixed number of conversations run
at once (closed loop: a turn is sent a short pause, `think_s`, after the last answer ended), each
turn through one of two router replicas drawn at random (seeded): a follow-up often reaches a
replica that did not route the turn before, and only a shared index knows where it lives.
4 mock vLLM engines (router/tools/mock/engine.py, automatic prefix caching) whose prefill costs 60
ms per 1k uncached tokens (GPU-class: prefill dominates TTFT for a long prompt) and whose KV
capacities together hold about the working set (every system prompt plus the live
conversations), each about a quarter of it. Before each variant is measured, every customer's
system prompt is sent once through that variant's own routing (warm-up, not counted): the run
measures a fleet in steady state, not every customer's first prefill at once.
Variants, same plan and seed, each on emptied engine caches (`reset_prefix_cache`, as vLLM's)
and an emptied Redis: `least_inflight` and `least_load` (2 replicas, counts shared in Redis),
`cache_aware` with two separate indexes (no Redis), `cache_aware` with Redis (`redis_url` set:
the replicas share one index), `cache_aware` on a single replica (the reference hit rate for a
shared index), and `cache_aware` with Redis and `load_factor: 2` (not a target: what the
default load bound costs at this load).
Workload *fresh*: every request a new random prompt (nothing to share): `cache_aware` against
`least_load`, alternating in 2 rounds, percentiles over both (FRESH_ROUNDS says why).
Measured per variant: TTFT (request sent to the first content token, client side) p50/p90/p99,
completion tokens per second over the run, the engines' prefix hit rate (deltas of their
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`), the routers' decisions by
reason. All processes on 127.0.0.1, each request and each variant bounded in time.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench.kit.chat import Turn, random_text, routing_reasons, send_turn
from bench.kit.page import table
from bench.kit.stats import pct
from tests.support.harness import Cluster, Proc

ENGINES = 4
ENGINE = [
    "--engine",
    "--max-num-seqs",
    "16",
    "--decode-ms",
    "15",
    "--decode-ms-per-seq",
    "0.5",
    "--prefill-ms-per-1k",
    "60",
]
REQUEST_TIMEOUT = 60.0
VARIANT_DEADLINE = 240.0
PNG = "bench-prefix.png"


@dataclass(frozen=True)
class Shape:
    customers: int = 32
    conversations: int = 2  # per customer, one after another (after a warm-up turn)
    turns: int = 5
    concurrency: int = 32  # conversations in flight at once
    # Mean pause before each turn (exponential). Short for a human, long enough that ~10 other
    # requests are routed between two turns of a conversation: a closed loop without it would
    # hand a conversation's freed slot straight back to it, a stickiness no real fleet has.
    think_s: float = 0.5
    system_tokens: tuple[int, int] = (2000, 5000)
    user_tokens: tuple[int, int] = (30, 120)
    out_tokens: int = 32
    fresh_requests: int = 160  # the no-shared-prefix workload, per round
    seed: int = 11

    @property
    def kv_tokens(self) -> int:
        """Per engine: a quarter of the working set (every system prompt at its mean length
        plus the live conversations' turns), so the 4 caches hold about all of it."""
        system = sum(self.system_tokens) / 2 * self.customers
        live = self.concurrency * self.turns * (sum(self.user_tokens) / 2 + self.out_tokens)
        return int((system + live) / ENGINES)


FULL = Shape()
QUICK = replace(FULL, customers=16, conversations=1, turns=4, concurrency=16, fresh_requests=32)


@dataclass(frozen=True)
class Conversation:
    customer: int
    users: tuple[str, ...]  # one user message per turn
    replicas: tuple[int, ...]  # which replica each turn goes through (of 2)
    thinks: tuple[float, ...]  # seconds before each turn


@dataclass(frozen=True)
class Plan:
    systems: tuple[str, ...]  # per customer
    conversations: tuple[Conversation, ...]  # in the order workers take them
    fresh: tuple[tuple[str, int, float], ...]  # no shared prefix: (prompt, replica, think)


def plan(shape: Shape) -> Plan:
    rng = random.Random(shape.seed)
    systems = tuple(
        f"You are the assistant of customer {c}. "
        + random_text(rng, rng.randint(*shape.system_tokens))
        for c in range(shape.customers)
    )
    convs: list[Conversation] = []
    for _ in range(shape.conversations):
        order = list(range(shape.customers))
        rng.shuffle(order)
        for c in order:
            convs.append(
                Conversation(
                    c,
                    tuple(
                        random_text(rng, rng.randint(*shape.user_tokens))
                        for _ in range(shape.turns)
                    ),
                    tuple(rng.randrange(2) for _ in range(shape.turns)),
                    tuple(rng.expovariate(1 / shape.think_s) for _ in range(shape.turns)),
                )
            )
    lo, hi = shape.system_tokens
    fresh = tuple(
        (
            random_text(rng, rng.randint(lo, hi)),
            rng.randrange(2),
            rng.expovariate(1 / shape.think_s),
        )
        for _ in range(shape.fresh_requests)
    )
    return Plan(systems, tuple(convs), fresh)


# ---------------------------------------------------------------------------- the client side


@dataclass
class Tally:
    turns: list[tuple[int, Turn]]  # (turn number, what it measured)
    errors: int = 0


async def _drive(
    urls: Sequence[str],
    shape: Shape,
    jobs: Sequence[Callable[[list[httpx.AsyncClient], Tally], Any]],
) -> tuple[Tally, float]:
    """Run `jobs` with `shape.concurrency` workers; wall time from the first send to the end."""
    limits = httpx.Limits(max_connections=shape.concurrency * 2, max_keepalive_connections=64)
    clients = [httpx.AsyncClient(base_url=u, timeout=REQUEST_TIMEOUT, limits=limits) for u in urls]
    tally = Tally([])
    queue = list(reversed(jobs))

    async def worker() -> None:
        while queue:
            job = queue.pop()
            await job(clients, tally)

    t0 = time.monotonic()
    try:
        await asyncio.wait_for(
            asyncio.gather(*(worker() for _ in range(shape.concurrency))), VARIANT_DEADLINE
        )
    finally:
        for cl in clients:
            await cl.aclose()
    return tally, time.monotonic() - t0


def chat_jobs(p: Plan, shape: Shape, replicas: int) -> list[Callable[..., Any]]:
    def job(conv: Conversation) -> Callable[..., Any]:
        async def run(clients: list[httpx.AsyncClient], tally: Tally) -> None:
            messages = [{"role": "system", "content": p.systems[conv.customer]}]
            for k, (user, rep, think) in enumerate(
                zip(conv.users, conv.replicas, conv.thinks, strict=True)
            ):
                await asyncio.sleep(think)
                messages.append({"role": "user", "content": user})
                try:
                    t = await send_turn(clients[rep % replicas], messages, shape.out_tokens)
                except (httpx.HTTPError, ValueError):
                    t = None
                if t is None:
                    tally.errors += 1
                    return  # the conversation cannot go on without its answer
                tally.turns.append((k, t))
                messages.append({"role": "assistant", "content": t.content})

        return run

    return [job(c) for c in p.conversations]


def warm_jobs(p: Plan, shape: Shape, replicas: int) -> list[Callable[..., Any]]:
    """Each customer's system prompt once (with a greeting), through the variant's own routing,
    spread over 2 s: the run then measures a fleet in steady state, not every customer's first
    prefill landing at once."""
    rng = random.Random(shape.seed + 1)
    greet = tuple(
        Conversation(c, ("Hello.",), (rng.randrange(2),), (rng.random() * 2,))
        for c in range(shape.customers)
    )
    return chat_jobs(Plan(p.systems, greet, ()), replace(shape, turns=1), replicas)


def fresh_jobs(p: Plan, shape: Shape, replicas: int) -> list[Callable[..., Any]]:
    def job(prompt: str, rep: int, think: float) -> Callable[..., Any]:
        async def run(clients: list[httpx.AsyncClient], tally: Tally) -> None:
            await asyncio.sleep(think)
            try:
                t = await send_turn(
                    clients[rep % replicas], [{"role": "user", "content": prompt}], shape.out_tokens
                )
            except (httpx.HTTPError, ValueError):
                t = None
            if t is None:
                tally.errors += 1
            else:
                tally.turns.append((0, t))

        return run

    return [job(prompt, rep, think) for prompt, rep, think in p.fresh]


# ---------------------------------------------------------------------------- one variant


def _counters(url: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of each named Prometheus family (with its labels) on one /metrics page."""
    out = dict.fromkeys(names, 0.0)
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("#"):
            continue
        for n in names:
            if line.startswith(n) and line[len(n)] in " {":
                out[n] += float(line.rsplit(" ", 1)[1])
    return out


HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
IDX_HIT, IDX_LOOKUP = (
    "sluicegate_affinity_hit_blocks_total",
    "sluicegate_affinity_lookup_blocks_total",
)


@dataclass
class Fleet:
    """The engines and the redis-server, started once and reset before each variant."""

    mocks: list[Proc]
    store: Proc


def calibrated(overrides: dict[str, str]) -> list[str]:
    """ENGINE with some of its `--flag value` pairs replaced (the robustness check: the policy
    must not depend on one engine calibration), e.g. {"--prefill-ms-per-1k": "30"}."""
    out = list(ENGINE)
    for flag, value in overrides.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def fleet(c: Cluster, shape: Shape, engine: Sequence[str] = ENGINE) -> Fleet:
    with ThreadPoolExecutor(ENGINES) as pool:  # start together: each takes seconds to import
        mocks = list(
            pool.map(
                lambda i: c.mock(
                    f"e{i}", engine_args=[*engine, "--kv-tokens", str(shape.kv_tokens)]
                ),
                range(ENGINES),
            )
        )
    return Fleet(mocks, c.redis())


def variant(
    c: Cluster,
    f: Fleet,
    shape: Shape,
    jobs: list[Callable[..., Any]],
    balancer: str,
    replicas: int,
    redis: bool,
    warm: list[Callable[..., Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    import redis as redis_py

    for m in f.mocks:  # cold caches: every variant starts from the same state
        httpx.post(m.url + "/control", json={"reset_prefix_cache": True}, timeout=5)
    with redis_py.Redis.from_url(f.store.url) as r:  # no index or lease left by the last one
        r.flushall()
    cfg = {
        "backends": [
            {"name": f"e{i}", "url": m.url, "models": {"m": "mock-model"}}
            for i, m in enumerate(f.mocks)
        ],
        "balancer": balancer,
        "expose_backend_header": True,
        "health": {"interval": 60},
        **(extra or {}),
    }
    env = {"SLUICEGATE_LOG_LEVEL": "warning"}
    if redis:
        env["SLUICEGATE_REDIS_URL"] = f.store.url
    with ThreadPoolExecutor(replicas) as pool:
        routers: list[Proc] = list(pool.map(lambda _: c.router(cfg, env=env), range(replicas)))
    time.sleep(1.0)  # first engine readings (KV capacity for the index) before traffic
    if warm:
        asyncio.run(_drive([r.url for r in routers], replace(shape, concurrency=len(warm)), warm))
        time.sleep(0.5)  # the last leases released, fresh readings
    before = [_counters(m.url, (HITS, QUERIES)) for m in f.mocks]
    routed = [(routing_reasons(r.url), _counters(r.url, (IDX_HIT, IDX_LOOKUP))) for r in routers]
    tally, wall = asyncio.run(_drive([r.url for r in routers], shape, jobs))
    after = [_counters(m.url, (HITS, QUERIES)) for m in f.mocks]
    hits = sum(a[HITS] - b[HITS] for a, b in zip(after, before, strict=True))
    queries = sum(a[QUERIES] - b[QUERIES] for a, b in zip(after, before, strict=True))
    reasons: dict[str, float] = {}
    index = {IDX_HIT: 0.0, IDX_LOOKUP: 0.0}
    for r, (reasons0, index0) in zip(routers, routed, strict=True):
        for k, v in routing_reasons(r.url).items():
            reasons[k] = reasons.get(k, 0.0) + v - reasons0.get(k, 0.0)
        for k, v in _counters(r.url, (IDX_HIT, IDX_LOOKUP)).items():
            index[k] += v - index0[k]
    for p in routers:
        p.stop()
    ttfts = [t.ttft for _, t in tally.turns]
    # A request that found less than half its prompt cached paid (most of) a full prefill.
    missed = [t.ttft for _, t in tally.turns if 2 * t.cached < t.prompt]
    found = [t.ttft for _, t in tally.turns if 2 * t.cached >= t.prompt]
    share: dict[str, int] = {}
    for _, t in tally.turns:
        share[t.backend] = share.get(t.backend, 0) + 1
    done = len(tally.turns)
    return {
        "replicas": replicas,
        "redis": redis,
        "requests": done,
        "errors": tally.errors,
        "seconds": round(wall, 2),
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1000, 1),
        "ttft_p90_ms": round(pct(ttfts, 0.9) * 1000, 1),
        "ttft_p99_ms": round(pct(ttfts, 0.99) * 1000, 1),
        "full_prefill_share": round(len(missed) / max(1, len(ttfts)), 3),
        "ttft_p90_ms_cached": round(pct(found, 0.9) * 1000, 1) if found else None,
        "ttft_p90_ms_full_prefill": round(pct(missed, 0.9) * 1000, 1) if missed else None,
        "tokens_s": round(sum(t.tokens for _, t in tally.turns) / wall, 1),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "prefix_hits": hits,
        "prefix_queries": queries,
        "tokens": sum(t.tokens for _, t in tally.turns),
        "client_cached_share": round(sum(t.cached for _, t in tally.turns) / queries, 4)
        if queries
        else 0.0,
        "index_hit_rate": round(index[IDX_HIT] / index[IDX_LOOKUP], 4)
        if index[IDX_LOOKUP]
        else None,
        "reasons": {k: int(v) for k, v in sorted(reasons.items())},
        "share": {k: round(v / max(1, done), 3) for k, v in sorted(share.items())},
        "ttfts": ttfts,
    }


Variant = tuple[str, str, int, bool, dict[str, Any]]  # label, balancer, replicas, redis, config
CHAT_VARIANTS: tuple[Variant, ...] = (
    ("least_inflight", "least_inflight", 2, True, {}),
    ("least_load", "least_load", 2, True, {}),
    ("cache_aware_separate", "cache_aware", 2, False, {}),
    ("cache_aware_redis", "cache_aware", 2, True, {}),
    ("cache_aware_single", "cache_aware", 1, False, {}),
    # Not a target: what the default count bound (1.25) still costs at this load.
    ("cache_aware_redis_lf2", "cache_aware", 2, True, {"affinity": {"load_factor": 2.0}}),
)
FRESH_VARIANTS: tuple[Variant, ...] = (
    ("least_load", "least_load", 2, True, {}),
    ("cache_aware", "cache_aware", 2, True, {}),
)
# All-miss traffic queues at random: one round's p90 moves by 10-20 % between two runs of the
# same balancer. The two alternate in rounds and their percentiles pool every round's requests;
# least_load's round 2 / round 1 is the noise floor printed beside the target.
FRESH_ROUNDS = 2


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result over several rounds of the same variant: percentiles of all their requests."""
    ttfts = [x for r in runs for x in r["ttfts"]]
    seconds = sum(r["seconds"] for r in runs)
    queries = sum(r["prefix_queries"] for r in runs)
    reasons: dict[str, int] = {}
    for r in runs:
        for k, v in r["reasons"].items():
            reasons[k] = reasons.get(k, 0) + v
    return {
        **runs[0],
        "requests": sum(r["requests"] for r in runs),
        "errors": sum(r["errors"] for r in runs),
        "seconds": round(seconds, 2),
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1000, 1),
        "ttft_p90_ms": round(pct(ttfts, 0.9) * 1000, 1),
        "ttft_p99_ms": round(pct(ttfts, 0.99) * 1000, 1),
        "tokens_s": round(sum(r["tokens"] for r in runs) / seconds, 1) if seconds else 0.0,
        "hit_rate": round(sum(r["prefix_hits"] for r in runs) / queries, 4) if queries else 0.0,
        "reasons": reasons,
        "rounds_ttft_p90_ms": [r["ttft_p90_ms"] for r in runs],
        "ttfts": ttfts,
    }


def run(
    c: Cluster, quick: bool = False, only: Sequence[str] = (), engine: Sequence[str] = ENGINE
) -> dict[str, Any]:
    """Every variant (or those named in `only`, as `chat:label` / `fresh:label`), on engines
    calibrated as `engine` (default ENGINE)."""
    shape = QUICK if quick else FULL
    p = plan(shape)
    res: dict[str, Any] = {
        "shape": {
            "customers": shape.customers,
            "conversations_per_customer": shape.conversations,
            "turns": shape.turns,
            "concurrency": shape.concurrency,
            "think_s": shape.think_s,
            "system_tokens": list(shape.system_tokens),
            "user_tokens": list(shape.user_tokens),
            "out_tokens": shape.out_tokens,
            "kv_tokens_per_engine": shape.kv_tokens,
            "fresh_requests": shape.fresh_requests,
            "fresh_rounds": FRESH_ROUNDS,
            "engine": " ".join(engine[1:]),
        },
        "chat": {},
        "fresh": {},
    }
    f = fleet(c, shape, engine)
    for label, balancer, replicas, redis, extra in CHAT_VARIANTS:
        if only and f"chat:{label}" not in only:
            continue
        jobs, warm = chat_jobs(p, shape, replicas), warm_jobs(p, shape, replicas)
        r = variant(c, f, shape, jobs, balancer, replicas, redis, warm, extra)
        res["chat"][label] = r
        print("prefix chat", label, _brief(r), flush=True)
    rounds: dict[str, list[dict[str, Any]]] = {}
    for n in range(FRESH_ROUNDS):
        for label, balancer, replicas, redis, extra in FRESH_VARIANTS:
            if only and f"fresh:{label}" not in only:
                continue
            jobs = fresh_jobs(p, shape, replicas)
            r = variant(c, f, shape, jobs, balancer, replicas, redis, None, extra)
            rounds.setdefault(label, []).append(r)
            print("prefix fresh", label, f"round {n + 1}", _brief(r), flush=True)
    for label, runs in rounds.items():
        res["fresh"][label] = pooled(runs)
    for proc in (*f.mocks, f.store):
        proc.stop()
    return res


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "ttfts"}


# ---------------------------------------------------------------------------- the report


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def targets(res: dict[str, Any]) -> list[tuple[str, str, Any, bool | None]]:
    """Issue 11's targets beside this run's ratios."""
    rows: list[tuple[str, str, Any, bool | None]] = []
    ch, fr = res.get("chat", {}), res.get("fresh", {})
    base, shared = ch.get("least_inflight"), ch.get("cache_aware_redis")
    if base and shared:
        hit = _ratio(shared["hit_rate"], base["hit_rate"])
        rows.append(
            (
                "prefix: hit rate, cache_aware (Redis) / least_inflight",
                ">= 2",
                hit,
                hit is not None and hit >= 2,
            )
        )
        p90 = _ratio(shared["ttft_p90_ms"], base["ttft_p90_ms"])
        rows.append(
            (
                "prefix: TTFT p90, cache_aware (Redis) / least_inflight",
                "<= 0.33",
                p90,
                p90 is not None and p90 <= 0.33,
            )
        )
        tps = _ratio(shared["tokens_s"], base["tokens_s"])
        rows.append(
            (
                "prefix: tokens/s, cache_aware (Redis) / least_inflight",
                ">= 1.3",
                tps,
                tps is not None and tps >= 1.3,
            )
        )
    single = ch.get("cache_aware_single")
    if single and shared:
        r = _ratio(shared["hit_rate"], single["hit_rate"])
        rows.append(
            (
                "prefix: hit rate, 2 replicas with Redis / single replica",
                ">= 0.9",
                r,
                r is not None and r >= 0.9,
            )
        )
    if single and "cache_aware_separate" in ch:
        r = _ratio(ch["cache_aware_separate"]["hit_rate"], single["hit_rate"])
        rows.append(
            ("prefix: hit rate, 2 separate indexes / single replica", "(the loss)", r, None)
        )
    if "cache_aware" in fr and "least_load" in fr:
        r = _ratio(fr["cache_aware"]["ttft_p90_ms"], fr["least_load"]["ttft_p90_ms"])
        p90s = fr["least_load"].get("rounds_ttft_p90_ms") or []
        aa = _ratio(p90s[-1], p90s[0]) if len(p90s) > 1 else None
        rows.append(
            (
                "no shared prefix: TTFT p90, cache_aware / least_load "
                f"(A/A, least_load round 2 / round 1: {aa})",
                "0.95-1.05",
                r,
                r is not None and 0.95 <= r <= 1.05,
            )
        )
    return rows


def split_samples(res: dict[str, Any]) -> dict[str, list[float]]:
    """Take the raw TTFT lists out of the results (for the plot, not the JSON)."""
    out = {}
    for part in ("chat", "fresh"):
        for label, r in res.get(part, {}).items():
            if "ttfts" in r:
                out[f"{part}:{label}"] = r.pop("ttfts")
    return out


def plot(res: dict[str, Any], samples: dict[str, list[float]], path: Path) -> bool:
    """Bars per chat variant (hit rate, TTFT p50/p90, tokens/s) and the TTFT CDFs; False
    without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    chat = res.get("chat", {})
    if not chat:
        return False
    labels = list(chat)
    short = [x.replace("cache_aware_", "ca_").replace("least_", "l_") for x in labels]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.8))
    axes[0].bar(short, [chat[x]["hit_rate"] for x in labels], color="tab:green")
    axes[0].set_title("engine prefix hit rate")
    axes[0].set_ylim(0, 1)
    w = 0.4
    xs = range(len(labels))
    axes[1].bar([i - w / 2 for i in xs], [chat[x]["ttft_p50_ms"] for x in labels], w, label="p50")
    axes[1].bar([i + w / 2 for i in xs], [chat[x]["ttft_p90_ms"] for x in labels], w, label="p90")
    axes[1].set_xticks(list(xs), short)
    axes[1].set_title("TTFT (ms)")
    axes[1].legend(fontsize=8)
    axes[2].bar(short, [chat[x]["tokens_s"] for x in labels], color="tab:purple")
    axes[2].set_title("completion tokens/s")
    for label in labels:
        v = sorted(x * 1000 for x in samples.get(f"chat:{label}", []))
        if v:
            axes[3].plot(v, [i / len(v) for i in range(len(v))], label=short[labels.index(label)])
    axes[3].set_xscale("log")
    axes[3].set_title("TTFT CDF (ms, log)")
    axes[3].legend(fontsize=7)
    for ax in axes[:3]:
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _bars(res: dict[str, Any]) -> list[str]:
    """A text bar chart of the hit rates and TTFT p90, for when matplotlib is absent."""
    chat = res.get("chat", {})
    if not chat:
        return []
    top = max(r["ttft_p90_ms"] for r in chat.values()) or 1.0
    out = ["```text", "engine prefix hit rate            | TTFT p90"]
    for label, r in chat.items():
        out.append(
            f"{label:22} {'#' * round(r['hit_rate'] * 20):20} {r['hit_rate']:.2f} | "
            f"{'#' * round(r['ttft_p90_ms'] / top * 20):20} {r['ttft_p90_ms']:.0f} ms"
        )
    return [*out, "```"]


def section(res: dict[str, Any], png: str | None, date: str = "") -> list[str]:
    """The cache-aware routing part of docs/benchmarks.md."""
    s = res.get("shape", {})
    out = [
        "## Cache-aware routing (`--only prefix`)",
        "",
        f"One run{', ' + date if date else ''}. *chat*: {s.get('customers')} customers, each "
        f"with its own system prompt of {s.get('system_tokens')} tokens, "
        f"{s.get('conversations_per_customer')} conversations each (one after another) of "
        f"{s.get('turns')} turns ({s.get('user_tokens')}-token user messages, "
        f"{s.get('out_tokens')}-token answers, all resent each turn); "
        f"{s.get('concurrency')} conversations at once, each turn {s.get('think_s')} s "
        "(mean, exponential) after the last answer, through one of 2 router replicas drawn at "
        f"random. 4 mock engines (`{s.get('engine')}`, "
        f"{s.get('kv_tokens_per_engine')} KV tokens each: the four together hold about every "
        "system prompt plus the live conversations). Every variant replays the same plan on "
        "emptied engine caches and an emptied Redis, after a warm-up that sends each system "
        "prompt once through the variant's own routing (not counted). Hit rate: the engines' own "
        "`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total` over the run; TTFT: "
        "request sent to the first content token, client side; tokens/s: completion tokens over "
        "the run's wall time. *fresh*: every request a new random prompt of the same lengths "
        f"({s.get('fresh_requests')} a round), `least_load` and `cache_aware` alternating in "
        f"{s.get('fresh_rounds')} rounds, percentiles over all rounds' requests.",
        "",
    ]
    header = (
        "variant",
        "hit rate",
        "TTFT p50 ms",
        "p90 ms",
        "p99 ms",
        "tokens/s",
        "full prefill",
        "done",
        "errors",
        "decisions",
    )
    for part in ("chat", "fresh"):
        runs = res.get(part)
        if not runs:
            continue
        rows = [header]
        for label, r in runs.items():
            reasons = ", ".join(f"{k} {v}" for k, v in r.get("reasons", {}).items())
            rows.append(
                (
                    label,
                    f"{r['hit_rate']:.3f}",
                    str(r["ttft_p50_ms"]),
                    str(r["ttft_p90_ms"]),
                    str(r["ttft_p99_ms"]),
                    str(r["tokens_s"]),
                    f"{r['full_prefill_share']:.2f}",
                    str(r["requests"]),
                    str(r["errors"]),
                    reasons,
                )
            )
        out += [f"**{part}**", "", table(rows), ""]
    rows2: list[tuple[str, ...]] = [("target", "goal", "measured", "met")]
    rows2 += [
        (a, b, str(v), "-" if ok is None else ("yes" if ok else "no"))
        for a, b, v, ok in targets(res)
    ]
    out += [table(rows2), ""]
    out += [f"![{png}]({png})", ""] if png else [*_bars(res), ""]
    return [*out, *READING]


READING = [
    "How to read it: *full prefill* is the share of requests that found less than half their",
    "prompt cached (usage `cached_tokens`); on this engine model each one holds its engine's",
    "whole batch for its prefill (no chunked prefill), so it sets the TTFT tail of everyone",
    "co-scheduled with it. Under `cache_aware` such requests come from three decisions:",
    "`spill` (a holder past the load bound: `load_factor` x the mean of sluicegate's in-flight",
    "counts and 2 above the least loaded, while its engine queues or has no room in its KV for",
    "the prompt; the `load_factor: 2` row shows what the count part still costs), `load` (no",
    "engine known to hold the prompt: evicted by capacity, or the holder's queue outweighed the",
    "cached share of the prompt: the cost counts prefills, a queued request as one), and, with",
    "separate indexes, a",
    "replica routing by what only it has seen (its index believes an engine holds blocks that",
    "the other replica's traffic evicted, and each replica settles a customer on its own engine,",
    "so prompts are cached twice). *fresh*: every request there is a full prefill and queues",
    "build and drain at random, so one round's p90 moves by 10-20 % between two rounds of the",
    "same balancer (the A/A ratio beside the target); `cache_aware` routes all of it by load",
    "(its decisions column), i.e. as `least_load` does.",
    "",
]


if __name__ == "__main__":
    import sys

    import uvloop

    uvloop.install()
    cluster = Cluster()
    try:
        names = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--variants=")]
        # Another engine calibration: --engine=--prefill-ms-per-1k=30,--max-num-seqs=8
        pairs = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--engine=")]
        engine = calibrated(dict(kv.split("=", 1) for kv in pairs[0].split(",")) if pairs else {})
        result = run(cluster, "--quick" in sys.argv, names[0].split(",") if names else (), engine)
    finally:
        cluster.close()
    split_samples(result)
    print(json.dumps(result, indent=2))
