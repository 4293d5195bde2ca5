"""Cost of cache-aware routing's per-request work (`python -m bench.oneoff.prefix`, a few seconds).

CPU per request, for a 32k-character chat prompt (a long system prompt and a few turns):
hashing the prompt into its block chain (router/request/placement/prefix.py), then the prefix
index's lookup over 8 backends and its update (balancers/prefix_index.py), and the whole routing
step; a session key's ring point and home, and building a ring of 8 (once per candidate set).
Then the whole per-request affinity step as the proxy runs it (`Affinity`: hash, lookup, bind,
record), local against shared in a redis-server started here
(router/request/placement/affinity_store.py): router CPU per request and its ratio to the local
path, wall time per request, Redis's own CPU per request, scripts and round trips per request
(sequential and 32 at a time), and Redis's memory per (block, backend) entry.
Targets (issue 11): hashing <= 0.3 ms, hash + lookup + update <= 0.5 ms (also shared).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from types import MappingProxyType

import redis as redis_py

from balancers.cache_aware import CacheAware
from balancers.prefix_index import PrefixIndex
from balancers.session_ring import Ring, point
from bench.kit.procstat import cpu_seconds
from router.core.backend import Backend
from router.core.settings import AffinityConfig
from router.request.placement.affinity import Affinity
from router.request.placement.affinity_store import SharedPrefixIndex
from router.request.placement.prefix import prefix_hashes
from tests.support.harness import Cluster

BLOCK = 256
LIMIT = 128 * 1024


def _payload(chars: int, ascii_only: bool = True) -> dict[str, object]:
    word = "lorem ipsum " if ascii_only else "lörem ïpsum "
    system = (word * (chars // len(word) + 1))[: chars - 2000]
    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " * 40}
        for i in range(6)
    ]
    return {"model": "m", "messages": [{"role": "system", "content": system}, *turns]}


def _cpu_ms(fn: Callable[[], object], n: int) -> float:
    fn()
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) * 1000 / n


def main() -> dict[str, float]:
    out: dict[str, float] = {}
    ascii_payload = _payload(32 * 1024)
    out["hash_32k_ascii_ms"] = _cpu_ms(lambda: prefix_hashes(ascii_payload, BLOCK, LIMIT), 2000)
    utf8_payload = _payload(32 * 1024, ascii_only=False)
    out["hash_32k_utf8_ms"] = _cpu_ms(lambda: prefix_hashes(utf8_payload, BLOCK, LIMIT), 1000)
    huge = _payload(4 * 1024 * 1024)
    out["hash_4M_capped_128k_ms"] = _cpu_ms(lambda: prefix_hashes(huge, BLOCK, LIMIT), 50)

    names = [f"b{i}" for i in range(8)]
    index = PrefixIndex()
    hashes = prefix_hashes(ascii_payload, BLOCK, LIMIT)
    # A warm index: many other prompts, this one held by two backends.
    for j in range(200):
        other = prefix_hashes(_payload(8 * 1024 + j * 256), BLOCK, LIMIT)
        index.record(other, names[j % 8], 2048)
    index.record(hashes, "b1", 2048)
    index.record(hashes, "b5", 2048)
    out["lookup_8_backends_ms"] = _cpu_ms(lambda: index.match(hashes, names), 5000)
    out["update_ms"] = _cpu_ms(lambda: index.record(hashes, "b3", 2048), 5000)

    def route() -> None:
        h = prefix_hashes(ascii_payload, BLOCK, LIMIT)
        index.match(h, names)
        index.record(h, "b3", 2048)

    out["hash_lookup_update_ms"] = _cpu_ms(route, 2000)
    ring = Ring(names)
    out["session_point_and_walk_ms"] = _cpu_ms(lambda: next(ring.walk(point("user-42"))), 20000)
    out["session_ring_build_8_ms"] = _cpu_ms(lambda: Ring(names), 200)
    out.update(shared_path())
    return {k: round(v, 4) for k, v in out.items()}


async def _requests(affinity: Affinity, payloads: list[dict[str, object]], tasks: int) -> None:
    """The proxy's affinity steps for each payload, `tasks` requests at a time."""
    bal = CacheAware()
    backends = [
        Backend(f"b{i}", "http://127.0.0.1:1", "vllm", MappingProxyType({"m": "m"}))
        for i in range(8)
    ]
    queue = list(reversed(payloads))

    async def worker(w: int) -> None:
        while queue:
            payload = queue.pop()
            request = affinity.prepare(bal, [], payload)
            assert request is not None
            if affinity.shared is not None:
                request = await affinity.look_up(request, backends)
            affinity.hints(request, backends)
            affinity.dispatched(request.hashes, backends[w % 8].name, None)

    await asyncio.gather(*(worker(w) for w in range(tasks)))


def shared_path(n: int = 2000) -> dict[str, float]:
    out: dict[str, float] = {}
    config = AffinityConfig()
    # Conversations: 32k-character prompts, each sent a few times (most lookups hit).
    payloads = [_payload(32 * 1024 - (j % 50) * 256) for j in range(n)]
    c = Cluster()
    try:
        redis = c.redis()

        async def run(tasks: int) -> None:
            local = Affinity(config)
            shared = SharedPrefixIndex(redis.url, timeout=1.0)
            remote = Affinity(config, shared=shared)
            await shared.start()
            await _requests(local, payloads[:200], tasks)  # warm both
            await _requests(remote, payloads[:200], tasks)
            label = "seq" if tasks == 1 else f"c{tasks}"
            for name, affinity in (("local", local), ("shared", remote)):
                scripts, trips = shared.scripts, shared.round_trips
                redis_cpu = cpu_seconds(redis.pid)
                t0, w0 = time.process_time(), time.perf_counter()
                await _requests(affinity, payloads, tasks)
                cpu = (time.process_time() - t0) * 1000 / n
                out[f"{name}_{label}_cpu_ms"] = cpu
                out[f"{name}_{label}_wall_ms"] = (time.perf_counter() - w0) * 1000 / n
                if affinity is remote:
                    out[f"shared_{label}_redis_cpu_ms"] = (
                        (cpu_seconds(redis.pid) - redis_cpu) * 1000 / n
                    )
                    out[f"shared_{label}_scripts_per_request"] = (shared.scripts - scripts) / n
                    out[f"shared_{label}_round_trips_per_request"] = (
                        shared.round_trips - trips
                    ) / n
                    out[f"shared_{label}_fallbacks"] = shared.fallbacks
            out[f"shared_over_local_{label}_cpu"] = (
                out[f"shared_{label}_cpu_ms"] / out[f"local_{label}_cpu_ms"]
            )
            out["shared_entries"] = shared.entries
            with redis_py.Redis.from_url(redis.url) as r:  # Redis memory per (block, backend)
                keys = list(r.scan_iter(shared.key("*")))
                used = sum(int(r.memory_usage(k, samples=0) or 0) for k in keys)
                out["shared_redis_bytes_per_entry"] = used / max(1, shared.entries)
                r.delete(*keys)
            await shared.aclose()

        asyncio.run(run(1))
        asyncio.run(run(32))
    finally:
        c.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
