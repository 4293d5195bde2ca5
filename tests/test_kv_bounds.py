"""The KV-event feed's bounds against a publisher that floods it (issue 46): the index trim past
an engine's capacity stays linear, a message's size and a loop turn's work are bounded, held
batches are counted in bytes, the adapter names an engine reports are bounded, and timestamps
that are not finite never reach the admin API. Figures (stalls, memory) live in bench/kv.py."""

from __future__ import annotations

import time

import msgspec

from router.engine.kv_index import TokenIndex
from router.engine.kv_wire import Stored

BS = 4


def _one_block(h: int) -> Stored:
    tokens = msgspec.Raw(msgspec.msgpack.encode([h, h + 1, h + 2, h + 3]))
    return Stored([h], None, tokens, BS, None, None, "GPU", 0)


def test_trimming_past_the_capacity_costs_what_filling_it_did() -> None:
    """An engine that keeps storing past its capacity (an honest one after missed removals):
    each block stored past it evicts the oldest, and N of those cost about what the first N
    stores did. Before, each eviction scanned the slots earlier evictions had emptied at the
    front of a dict: quadratic (1.3 M blocks froze a router for a minute). The bound is 8x
    the same process's own cost of filling (CPU time of this thread: another process's load
    does not count); the quadratic trim took 18x at this size, and more with every block."""
    cap = 200_000
    idx = TokenIndex()
    events = [_one_block(h) for h in range(1, 2 * cap + 1)]
    t0 = time.thread_time()
    for ev in events[:cap]:
        idx.stored("a", ev, cap)
    fill = time.thread_time() - t0
    bound = 8 * fill
    t1 = time.thread_time()
    done = 0
    for ev in events[cap:]:
        idx.stored("a", ev, cap)
        done += 1
        if done % 1000 == 0 and time.thread_time() - t1 > bound:
            break  # already quadratic: no need to wait for the rest
    past = time.thread_time() - t1
    assert done == cap and past <= bound, f"{done} blocks past the capacity took {past / fill:.1f}x"
    assert idx.blocks("a") == cap
    held = idx._engines["a"].by_hash
    assert idx.match([held[2 * cap]], ["a"]) == {"a": 1}  # the newest kept, the oldest gone
    assert (1 in held, cap in held, cap + 1 in held) == (False, False, True)
