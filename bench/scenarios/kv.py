"""What precise prefix routing costs a router process (`python -m bench.scenarios.kv`, ~20 s).

1. Ingestion: 20 engines publishing vLLM-format KV events at 500 events/s each (a separate
   process, real ZMQ PUB sockets on ipc paths), one router process subscribed (KvEvents on
   uvloop: decode, seq tracking, the token index). CPU of the router process over the window,
   its ZMQ I/O thread included, as a share of one core. Budget (issue 24): <= 10 %.
   Event mix per engine step (100 steps/s): 3 BlockStored of 1-2 blocks of 128 tokens, chained
   on the engine's previous blocks, and 2 BlockRemoved, capacity 4096 blocks per engine. Also
   the floor under the same load: a subscriber that reads every socket and decodes nothing.
2. Tokenizing on the critical path: an 8k-token chat prompt through the router's tokenizer
   (router/request/placement/tokens.py) cold (nothing cached) and warm (its system prompt seen
   before), CPU per prompt, next to the `tokenizers` library's own encode of the same text (the
   floor), the event loop thread's share (the rest runs in a worker thread), and the longest stall
   of the event loop meanwhile. Budget: <= 1 ms per 8k-token prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

ROOT = Path(__file__).resolve().parents[2]

ENGINES = 20
EVENTS_PER_S = 500
STEPS_PER_S = 100
SECONDS = 8.0
BS = 128


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _publish(run: str, seconds: float, start: float) -> None:
    from router.tools.mock.kv_publish import KvPublisher, removed, stored

    pubs = [KvPublisher(f"ipc://{run}/e{i}.sock") for i in range(ENGINES)]
    rng = random.Random(0)
    # Token ids are slices of one pool: a few hundred randrange calls per batch made this
    # process use most of a core, which on 2 shared cores slowed the router it loads.
    pool = [rng.randrange(50_000) for _ in range(1 << 16)]
    while time.time() < start:
        time.sleep(0.01)
    chains: list[list[int]] = [[] for _ in range(ENGINES)]
    next_hash = 1
    step = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        for i, pub in enumerate(pubs):
            events = []
            chain = chains[i]
            for _ in range(3):
                n = rng.choice((1, 2))
                hashes = list(range(next_hash, next_hash + n))
                next_hash += n
                parent = chain[-1] if chain and rng.random() < 0.7 else None
                at = rng.randrange(len(pool) - n * BS)
                tokens = pool[at : at + n * BS]
                events.append(stored(hashes, parent, tokens, BS, False))
                chain.extend(hashes)
            for _ in range(2):
                if chain:
                    events.append(removed([chain.pop(0)], False))
            pub.publish(events)
        step += 1
        delay = t0 + step / STEPS_PER_S - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    time.sleep(0.3)
    for p in pubs:
        p.close()


async def _ingest(recv_only: bool = False) -> dict[str, float]:
    from router.core.backend import Backend
    from router.core.settings import BackendConfig
    from router.engine.kv_events import KvEvents
    from router.ops.collector import tune_collector
    from router.ops.metrics import Metrics

    if recv_only:  # the floor: the same sockets read, every message dropped undecoded
        KvEvents._message = lambda self, feed, frames: None  # type: ignore[method-assign]

    with tempfile.TemporaryDirectory(prefix="kvb") as run:
        start = time.time() + 1.5
        # The load: a process of its own, always this checkout's publisher (a baseline's
        # router is measured against the same load).
        proc = subprocess.Popen(  # noqa: ASYNC220 (started once, before the window)
            [sys.executable, __file__, "--publish", run, str(SECONDS), str(start)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.DEVNULL,
        )
        await asyncio.sleep(1.0)  # the publishers bind
        # As the router runs it: every batch's counts go to its Prometheus counters too.
        kv = KvEvents(capacity=lambda _n: 4096, on_events=Metrics().kv_events)
        kv.sync(
            Backend.from_config(
                BackendConfig.model_validate(
                    {
                        "name": f"e{i}",
                        "url": "http://127.0.0.1:9",
                        "models": ["m"],
                        "kv_events": {"endpoint": f"ipc://{run}/e{i}.sock", "topic": "kv"},
                    }
                )
            )
            for i in range(ENGINES)
        )
        await kv.start()
        tune_collector()  # as the router does once it is built (router/ops/collector.py)
        await asyncio.sleep(max(0.0, start + 0.5 - time.time()))
        c0, w0, b0 = _cpu(), time.monotonic(), kv.batches
        await asyncio.sleep(SECONDS - 0.7)
        c1, w1, b1 = _cpu(), time.monotonic(), kv.batches
        await kv.aclose()
        proc.wait(10)
    batches = b1 - b0
    if recv_only:
        batches = round((w1 - w0) * STEPS_PER_S * ENGINES)  # what was published meanwhile
    events = batches * 5
    return {
        "events_per_s": events / (w1 - w0),
        "core_share": (c1 - c0) / (w1 - w0),
        "us_per_event": (c1 - c0) / max(1, events) * 1e6,
    }


def _tokenizer() -> dict[str, float]:
    from router.core.settings import AffinityConfig
    from router.request.placement.tokens import RouterTokenizer, request_tokens
    from tests.tiny_tokenizer import write_tokenizer

    with tempfile.TemporaryDirectory() as d:
        tk = RouterTokenizer(str(write_tokenizer(Path(d), vocab=4000)))
    words = ["def", "return", "class", "import", "self", "value", "index", "block", "cache"]
    rng = random.Random(1)
    doc = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(2800))
    chat = {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": "hi"}]}
    n = len(tk.tokens(chat) or [])
    reps = 20

    def per_call(fn: Any) -> float:
        c0 = _cpu()
        for _ in range(reps):
            fn()
        return (_cpu() - c0) / reps

    def cold() -> None:
        tk._cache.clear()
        tk.tokens(chat)

    text = tk.render(chat) or ""
    out = {
        "tokens": n,
        "cold_ms": per_call(cold) * 1e3,
        "warm_ms": per_call(lambda: tk.tokens(chat)) * 1e3,
        "render_ms": per_call(lambda: tk.render(chat)) * 1e3,
        # The library's floor: one encode of the same rendered text, ids as a Python list.
        "library_ms": per_call(lambda: tk.tokenizer.encode(text, add_special_tokens=False).ids)
        * 1e3,
    }

    # A prompt of about as many tokens whose text shares all but its tail with one seen
    # before (a document asked about again, a conversation's next turn, a repeated prefix):
    # the shared chunks come from the cache, only the tail is encoded.
    prose = " ".join(rng.choice(words) for _ in range(7000))
    seen = tk.tokens({"prompt": prose + " first question"}) or []
    asked = iter(range(10**6))
    out["shared_prefix_tokens"] = len(seen)
    out["shared_prefix_ms"] = (
        per_call(lambda: tk.tokens({"prompt": f"{prose} question number {next(asked)}"})) * 1e3
    )
    out["shared_prefix_library_ms"] = (
        per_call(lambda: tk.tokenizer.encode(f"{prose} question number {next(asked)}").ids) * 1e3
    )

    # What the event loop's own thread spends on a cold 8k-token prompt (the rest runs in a
    # worker thread, `tokenize_inline_chars`): the request still waits for it.
    inline = AffinityConfig().tokenize_inline_chars

    async def on_loop() -> float:
        t0 = time.thread_time()
        for _ in range(reps):
            tk._cache.clear()
            await request_tokens(tk, chat, inline, 1 << 24)
        return (time.thread_time() - t0) / reps

    out["loop_thread_ms"] = asyncio.run(on_loop()) * 1e3

    # The prompt's block keys, which the KV-event index is asked for
    # (router/request/placement/affinity.py), also on the critical path: at vLLM's CPU block size
    # and at the GPU default.
    from router.engine.kv_index import chain_keys

    ids = tk.tokens(chat) or []
    for bs in (128, 16):
        out[f"keys_bs{bs}_ms"] = per_call(lambda bs=bs: chain_keys(ids, bs)) * 1e3

    # The longest the event loop went without running (a 0.5 ms ticker) while cold 8k-token
    # chat and completion prompts were tokenized, against the same ticker idle.
    async def stall(busy: bool) -> float:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.0005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.02)
        gaps.clear()
        for i in range(reps):
            tk._cache.clear()
            if busy:
                await request_tokens(tk, chat if i % 2 else {"prompt": doc}, inline, 1 << 24)
            else:
                await asyncio.sleep(0.01)
        done.set()
        await ticker
        return max(gaps)

    out["loop_stall_ms"] = asyncio.run(stall(True)) * 1e3
    out["loop_stall_idle_ms"] = asyncio.run(stall(False)) * 1e3
    return out


def run(quick: bool = False, baseline_src: str | None = None) -> dict[str, Any]:
    """Both costs, as `--only kv` reports them; with `baseline_src` (another checkout) its
    ingestion too, measured the same way in the same run, and the ratio."""
    del quick  # already short
    ingest = _ingest_in(ROOT)
    floor = _ingest_in(ROOT, recv_only=True)
    out: dict[str, Any] = {
        "ingest_events_per_s": round(ingest["events_per_s"]),
        "ingest_core_share": round(ingest["core_share"], 4),
        "ingest_us_per_event": round(ingest["us_per_event"], 2),
        "recv_only_core_share": round(floor["core_share"], 4),
    }
    if baseline_src:
        base = _ingest_in(Path(baseline_src))
        out["baseline_core_share"] = round(base["core_share"], 4)
        out["baseline_us_per_event"] = round(base["us_per_event"], 2)
        out["core_share_vs_baseline"] = round(ingest["core_share"] / base["core_share"], 3)
    tok = _tokenizer()
    out.update(
        tokenizer_tokens=tok["tokens"],
        tokenizer_cold_ms=round(tok["cold_ms"], 3),
        tokenizer_warm_ms=round(tok["warm_ms"], 4),
        tokenizer_render_ms=round(tok["render_ms"], 3),
        tokenizer_library_ms=round(tok["library_ms"], 3),
        tokenizer_loop_thread_ms=round(tok["loop_thread_ms"], 3),
        tokenizer_loop_stall_ms=round(tok["loop_stall_ms"], 2),
        keys_bs128_ms=round(tok["keys_bs128_ms"], 3),
        keys_bs16_ms=round(tok["keys_bs16_ms"], 3),
        tokenizer_loop_stall_idle_ms=round(tok["loop_stall_idle_ms"], 2),
        tokenizer_shared_prefix_tokens=tok["shared_prefix_tokens"],
        tokenizer_shared_prefix_ms=round(tok["shared_prefix_ms"], 3),
        tokenizer_shared_prefix_library_ms=round(tok["shared_prefix_library_ms"], 3),
    )
    return out


def _ingest_in(src: Path, recv_only: bool = False) -> dict[str, float]:
    """The ingestion in a fresh process whose `router` package comes from `src` (this file's
    harness either way): nothing else in the process, and a baseline checkout runs the same."""
    argv = ["kv", "--ingest-json", *(["--recv-only"] if recv_only else [])]
    code = (
        f"import sys, runpy; sys.path.insert(0, {str(src)!r}); sys.argv = {argv!r}; "
        f"runpy.run_path({__file__!r}, run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        stdin=subprocess.DEVNULL,
        cwd=src,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    if sys.argv[1:2] == ["--publish"]:
        _publish(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
        return
    if "--ingest-json" in sys.argv:
        print(json.dumps(uvloop.run(_ingest("--recv-only" in sys.argv))))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline-src", help="also the ingestion of this checkout, and the ratio")
    args = ap.parse_args()
    res = run(baseline_src=args.baseline_src)
    print(
        f"ingestion: {res['ingest_events_per_s']} events/s from {ENGINES} engines: "
        f"{res['ingest_core_share'] * 100:.1f} % of one core "
        f"({res['ingest_us_per_event']} us/event); of which reading the sockets alone (ZMQ's "
        f"I/O thread included, nothing decoded) {res['recv_only_core_share'] * 100:.1f} %"
    )
    if "baseline_core_share" in res:
        print(
            f"baseline: {res['baseline_core_share'] * 100:.1f} % of one core "
            f"({res['baseline_us_per_event']} us/event); this / baseline "
            f"{res['core_share_vs_baseline']}"
        )
    print(
        f"tokenizer: {res['tokenizer_tokens']}-token chat prompt: cold "
        f"{res['tokenizer_cold_ms']:.2f} ms, warm (system prompt seen) "
        f"{res['tokenizer_warm_ms']:.3f} ms CPU; of a cold one: template "
        f"{res['tokenizer_render_ms']:.2f} ms, the tokenizers library's encode of the same "
        f"text alone {res['tokenizer_library_ms']:.2f} ms, on the event loop's thread "
        f"{res['tokenizer_loop_thread_ms']:.3f} ms; longest event-loop stall meanwhile "
        f"{res['tokenizer_loop_stall_ms']:.1f} ms (idle: {res['tokenizer_loop_stall_idle_ms']:.1f})"
    )
    print(
        f"tokenizer: {res['tokenizer_shared_prefix_tokens']}-token completion prompt sharing "
        f"all but its tail with one seen before: {res['tokenizer_shared_prefix_ms']:.3f} ms CPU "
        f"(the library's encode of it: {res['tokenizer_shared_prefix_library_ms']:.2f} ms)"
    )
    print(
        f"block keys of that prompt: {res['keys_bs128_ms']:.3f} ms at block size 128, "
        f"{res['keys_bs16_ms']:.3f} ms at 16"
    )


if __name__ == "__main__":
    main()
