"""Cost of cache-aware routing's per-request work (`python -m bench.prefix`, a few seconds).

CPU per request, for a 32k-character chat prompt (a long system prompt and a few turns):
hashing the prompt into its block chain (router/request/prefix.py), then the prefix index's
lookup over 8 backends and its update (balancers/prefix_index.py), and the whole routing step;
a session key's ring point and home, and building a ring of 8 (once per candidate set).
Targets (issue 11): hashing <= 0.3 ms, hash + lookup + update <= 0.5 ms.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from balancers.prefix_index import PrefixIndex
from balancers.session_ring import Ring, point
from router.request.prefix import prefix_hashes

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
    return {k: round(v, 4) for k, v in out.items()}


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
