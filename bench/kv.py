"""What precise prefix routing costs a router process (`python -m bench.kv`, ~20 s).

1. Ingestion: 20 engines publishing vLLM-format KV events at 500 events/s each (a separate
   process, real ZMQ PUB sockets on ipc paths), one router process subscribed (KvEvents on
   uvloop: decode, seq tracking, the token index). CPU of the router process over the window,
   its ZMQ I/O thread included, as a share of one core. Budget (issue 24): <= 10 %.
   Event mix per engine step (100 steps/s): 3 BlockStored of 1-2 blocks of 128 tokens, chained
   on the engine's previous blocks, and 2 BlockRemoved, capacity 4096 blocks per engine.
2. Tokenizing on the critical path: an 8k-token chat prompt through the router's tokenizer
   (router/request/tokens.py) cold (nothing cached) and warm (its system prompt seen before),
   CPU per prompt. Budget: <= 1 ms per 8k-token prompt.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import resource
import tempfile
import time
from pathlib import Path

import uvloop

ENGINES = 20
EVENTS_PER_S = 500
STEPS_PER_S = 100
SECONDS = 8.0
BS = 128


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _publish(run: str, seconds: float, start: float) -> None:
    from router.mock.kv_publish import KvPublisher, removed, stored

    pubs = [KvPublisher(f"ipc://{run}/e{i}.sock") for i in range(ENGINES)]
    rng = random.Random(0)
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
                tokens = [rng.randrange(50_000) for _ in range(n * BS)]
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


async def _ingest() -> dict[str, float]:
    from router.core.backend import Backend
    from router.core.settings import BackendConfig
    from router.engine.kv_events import KvEvents

    with tempfile.TemporaryDirectory(prefix="kvb") as run:
        start = time.time() + 1.5
        proc = mp.get_context("spawn").Process(target=_publish, args=(run, SECONDS, start))
        proc.start()
        await asyncio.sleep(1.0)  # the publishers bind
        kv = KvEvents(capacity=lambda _n: 4096)
        kv.sync(
            Backend.from_config(
                BackendConfig(
                    name=f"e{i}",
                    url="http://127.0.0.1:9",
                    models=["m"],
                    kv_events={"endpoint": f"ipc://{run}/e{i}.sock", "topic": "kv"},
                )
            )
            for i in range(ENGINES)
        )
        await kv.start()
        await asyncio.sleep(max(0.0, start + 0.5 - time.time()))
        c0, w0, b0 = _cpu(), time.monotonic(), kv.batches
        await asyncio.sleep(SECONDS - 0.7)
        c1, w1, b1 = _cpu(), time.monotonic(), kv.batches
        await kv.aclose()
        proc.join(10)
    batches = b1 - b0
    events = batches * 5
    return {
        "events_per_s": events / (w1 - w0),
        "core_share": (c1 - c0) / (w1 - w0),
        "us_per_event": (c1 - c0) / max(1, events) * 1e6,
    }


def _tokenizer() -> dict[str, float]:
    from router.request.tokens import RouterTokenizer
    from tests.tiny_tokenizer import write_tokenizer

    with tempfile.TemporaryDirectory() as d:
        tk = RouterTokenizer(str(write_tokenizer(Path(d), vocab=4000)))
    words = ["def", "return", "class", "import", "self", "value", "index", "block", "cache"]
    rng = random.Random(1)
    doc = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(2800))
    chat = {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": "hi"}]}
    n = len(tk.tokens(chat) or [])
    reps = 20
    c0 = _cpu()
    for _ in range(reps):
        tk._cache.clear()
        tk.tokens(chat)
    cold = (_cpu() - c0) / reps
    tk.tokens(chat)
    c0 = _cpu()
    for _ in range(reps):
        tk.tokens(chat)
    warm = (_cpu() - c0) / reps
    return {"tokens": n, "cold_ms": cold * 1e3, "warm_ms": warm * 1e3}


def main() -> None:
    ingest = uvloop.run(_ingest())
    print(
        f"ingestion: {ingest['events_per_s']:.0f} events/s from {ENGINES} engines: "
        f"{ingest['core_share'] * 100:.1f} % of one core ({ingest['us_per_event']:.1f} us/event)"
    )
    tok = _tokenizer()
    print(
        f"tokenizer: {tok['tokens']:.0f}-token chat prompt: cold {tok['cold_ms']:.2f} ms, "
        f"warm (system prompt seen) {tok['warm_ms']:.3f} ms CPU"
    )


if __name__ == "__main__":
    main()
