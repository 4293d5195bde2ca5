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
3. One hostile publisher (issue 46; `--hostile` runs this alone, ~25 s): the index trim past an
   engine's capacity (per block, against filling it; it was quadratic), then a router process
   (KvEvents on uvloop) subscribed to a publisher process that floods it for FLOOD_S: batches
   just under the message bound (block size 16, then block size 1, the dearest per byte), one
   frame of 32 MiB (dropped), and a replay socket that never answers (so batches are held
   first, then applied). Figures: the longest event-loop stall (a 1 ms ticker; wall time, and
   the loop thread's CPU time within it), the router's RSS growth, batches received,
   connections dropped; and the memory 300,000 adapter names leave in the index.
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
from collections.abc import Callable
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
    from tests.support.tiny_tokenizer import write_tokenizer

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


FLOOD_S = 8.0  # seconds the hostile publisher floods (the replay gives up after 5)


def _flood(endpoint: str, replay: str, seconds: float, start: float) -> None:
    """The hostile publisher: big batches as fast as the subscriber takes them (ZMQ's queues
    block it), one oversized frame, and a replay socket that never answers."""
    import zmq

    from tests.support.kv_publisher import frames, stored

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 64)
    pub.bind(endpoint)
    silent = ctx.socket(zmq.ROUTER)
    silent.bind(replay)
    rng = random.Random(2)

    def batch(bs: int, blocks: int) -> list[bytes]:
        """Events of `blocks` blocks of `bs` tokens, as many as stay under the 1 MiB bound."""
        evs: list[Any] = []
        size = 0
        while size < 0.98 * 2**20 - 8 * bs * blocks:
            first = len(evs) * blocks + 1
            hashes: list[int | bytes] = list(range(first, first + blocks))
            tokens = [rng.randrange(128_000) for _ in range(bs * blocks)]
            evs.append(stored(hashes, None, tokens, bs))
            size += len(frames(0, evs[-1:])[2])
        return frames(0, evs, ts=time.time())

    # Just under the bound: block size 16 (64 blocks an event), and block size 1.
    kinds = [batch(16, 64), batch(1, 1024)]
    sizes = [len(k[2]) for k in kinds]
    while time.time() < start:
        time.sleep(0.01)
    t0 = time.monotonic()
    seq = 1  # the first message is already past 0: the router asks the (silent) replay
    big = False
    while time.monotonic() - t0 < seconds:
        if not big and time.monotonic() - t0 > seconds / 2:
            big = True
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), b"\x00" * (32 << 20)])
            seq += 1
        f = kinds[seq % 2]
        pub.send_multipart([f[0], seq.to_bytes(8, "big"), f[2]])
        seq += 1
        time.sleep(0.002)
    print(json.dumps({"message_bytes": sizes, "sent": seq}), flush=True)
    pub.close(0)
    silent.close(0)
    ctx.term()


async def _hostile_feed() -> dict[str, float]:
    from bench.kit.procstat import rss_mb
    from router.core.backend import Backend
    from router.core.settings import BackendConfig
    from router.engine.kv_events import KvEvents
    from router.ops.collector import tune_collector

    with tempfile.TemporaryDirectory(prefix="kvh") as run:
        endpoint, replay = f"ipc://{run}/h.sock", f"ipc://{run}/h-replay.sock"
        start = time.time() + 1.5
        proc = subprocess.Popen(  # noqa: ASYNC220 (started once, before the window)
            [
                sys.executable,
                "-m",
                "bench.scenarios.kv",
                "--flood",
                endpoint,
                replay,
                str(FLOOD_S),
                str(start),
            ],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        await asyncio.sleep(1.0)
        kv = KvEvents(capacity=lambda _n: 1 << 16)  # the index's own size apart
        cfg = {"endpoint": endpoint, "replay_endpoint": replay, "topic": "kv"}
        kv.sync(
            [
                Backend.from_config(
                    BackendConfig(name="h", url="http://127.0.0.1:9", models=["m"], kv_events=cfg)  # type: ignore[arg-type]
                )
            ]
        )
        await kv.start()
        tune_collector()
        before = rss_mb(os.getpid())
        peak = before
        # The longest gap between two ticks: in wall time (the machine's other load included)
        # and in this thread's CPU time (the loop's own work between them).
        longest = busiest = 0.0
        last, last_cpu = time.perf_counter(), time.thread_time()
        end = start + FLOOD_S + 1.0
        while time.time() < end:
            await asyncio.sleep(0.001)
            now, cpu = time.perf_counter(), time.thread_time()
            longest = max(longest, now - last)
            busiest = max(busiest, cpu - last_cpu)
            peak = max(peak, rss_mb(os.getpid()))
            last, last_cpu = time.perf_counter(), time.thread_time()
        applied = kv.batches
        dropped = kv.dropped
        await kv.aclose()
        out, _ = proc.communicate(timeout=30)
    sent = json.loads(out.decode().strip().splitlines()[-1])
    return {
        "message_bytes": max(sent["message_bytes"]),
        "batches_sent": sent["sent"],
        "batches_received": applied,
        "connections_dropped": dropped,
        "loop_stall_max_ms": longest * 1e3,
        "loop_busy_max_ms": busiest * 1e3,
        "rss_growth_mb": peak - before,
    }


def _trim() -> dict[str, float]:
    """The index past an engine's capacity: each block stored evicts the oldest."""
    import msgspec

    from router.engine.kv_index import TokenIndex
    from router.engine.kv_wire import Stored

    cap, per = 1 << 18, 64
    rng = random.Random(3)
    pool = [rng.randrange(50_000) for _ in range(1 << 16)]

    def ev(first: int) -> Stored:
        at = rng.randrange(len(pool) - per * 16)
        raw = msgspec.Raw(msgspec.msgpack.encode(pool[at : at + per * 16]))
        return Stored(list(range(first, first + per)), None, raw, 16, None, None, "GPU", 0)

    events = [ev(1 + i * per) for i in range(2 * cap // per)]
    idx = TokenIndex()
    c0 = time.thread_time()
    for e in events[: cap // per]:
        idx.apply("a", [e], cap)
    fill = time.thread_time() - c0
    longest = 0.0
    c0 = time.thread_time()
    for e in events[cap // per :]:
        t = time.perf_counter()
        idx.apply("a", [e], cap)
        longest = max(longest, time.perf_counter() - t)
    past = time.thread_time() - c0
    return {
        "trim_blocks": cap,
        "trim_fill_us_per_block": fill / cap * 1e6,
        "trim_past_cap_us_per_block": past / cap * 1e6,
        "trim_longest_batch_ms": longest * 1e3,
    }


def _adapter_names() -> dict[str, float]:
    """300,000 adapter names, one block each, into one engine's index (capacity 1,024)."""
    import tracemalloc

    import msgspec

    from router.engine.kv_index import TokenIndex
    from router.engine.kv_wire import Stored

    raw = msgspec.Raw(msgspec.msgpack.encode(list(range(16))))
    idx = TokenIndex()
    tracemalloc.start()
    for i in range(300_000):
        name = f"adapter-{i:08d}"
        idx.apply("a", [Stored([i + 1], None, raw, 16, name, [[name]], "GPU", 0)], 1024)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {"adapter_names_kept": len(idx._engines["a"].loras), "adapter_names_mb": held / 2**20}


def _feed() -> dict[str, float]:
    return uvloop.run(_hostile_feed())


def hostile() -> dict[str, Any]:
    """Section 3's figures, each in a fresh process of its own."""
    out: dict[str, Any] = {}
    for part in ("trim", "names", "feed"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.scenarios.kv",
                f"--hostile-{part}",
            ],  # bench/ not on the path
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
        )
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


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
    out.update(hostile())
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
    if sys.argv[1:2] == ["--flood"]:
        _flood(sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]))
        return
    if "--ingest-json" in sys.argv:
        print(json.dumps(uvloop.run(_ingest("--recv-only" in sys.argv))))
        return
    parts: dict[str, Callable[[], dict[str, float]]] = {
        "--hostile-trim": _trim,
        "--hostile-names": _adapter_names,
        "--hostile-feed": _feed,
    }
    if sys.argv[1:2] and sys.argv[1] in parts:
        print(json.dumps(parts[sys.argv[1]]()))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--baseline-src", help="also the ingestion of this checkout, and the ratio")
    ap.add_argument("--hostile", action="store_true", help="only section 3 (~25 s)")
    args = ap.parse_args()
    if args.hostile:
        print(json.dumps(hostile()))
        return
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
    print(
        f"hostile publisher: trim past the capacity {res['trim_past_cap_us_per_block']} us per "
        f"block (filling: {res['trim_fill_us_per_block']}); a flood of "
        f"{res['message_bytes']}-byte batches and a 32 MiB frame: longest loop stall "
        f"{res['loop_stall_max_ms']} ms ({res['loop_busy_max_ms']} ms of its CPU), RSS "
        f"+{res['rss_growth_mb']} MB, "
        f"{res['connections_dropped']} connection(s) dropped; 300,000 adapter names: "
        f"{res['adapter_names_kept']} kept, {res['adapter_names_mb']} MB"
    )


if __name__ == "__main__":
    main()
