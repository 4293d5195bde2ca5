"""The KV-event feed's bounds against a publisher that floods it (issue 46): the index trim past
an engine's capacity stays linear, a message's size and a loop turn's work are bounded, held
batches are counted in bytes, the adapter names an engine reports are bounded, and timestamps
that are not finite never reach the admin API. Figures (stalls, memory) live in bench/kv.py."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from router.engine.kv_index import TokenIndex
from router.engine.kv_wire import Stored
from tests.harness import Cluster, Proc, backend, wait_for
from tests.kv_publisher import Publisher, stored

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


@pytest.fixture(scope="module")
def fed_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Publisher]]:
    """A router whose backend `a` (a mock) publishes KV events on an ipc path this test owns."""
    run = Path(tmp_path_factory.mktemp("kvb"))
    endpoint = f"ipc://{run}/a.sock"
    pub = Publisher(endpoint)
    c = Cluster()
    try:
        mock = c.mock("a")
        router = c.router(
            {
                "backends": [backend("a", mock, kv_events={"endpoint": endpoint, "topic": "kv"})],
                "health": {"interval": 60},
            },
            env={"SLUICEGATE_LOG_LEVEL": "warning"},
        )
        assert pub.sock.poll(10_000), "the router never subscribed"
        assert pub.sock.recv()[:1] == b"\x01"
        yield router, pub
    finally:
        c.close()
        pub.close()


def _kv_row(router: Proc) -> dict[str, Any]:
    r = httpx.get(router.url + "/admin/backends/a", timeout=5)
    assert r.status_code == 200, r.text
    return dict(r.json()["kv_events_state"])


@pytest.mark.parametrize("ts", [-math.inf, math.inf, math.nan])
def test_a_batch_stamped_with_no_finite_time_keeps_the_admin_api_answering(
    fed_router: tuple[Proc, Publisher], ts: float
) -> None:
    """A batch whose timestamp is -inf made the feed's lag infinite, and `GET /admin/backends`
    answered 500 (JSON has no infinity): such a time reads as none (0.0, long ago)."""
    router, pub = fed_router
    seq = pub.publish([stored([pub.seq + 1], None, [1, 2, 3, 4], BS)], ts=ts)
    wait_for(lambda: _kv_row(router)["publishers"][0]["seq"] == seq, "the batch applied")
    lag = _kv_row(router)["lag_seconds"]
    assert isinstance(lag, float) and math.isfinite(lag) and lag > 0
    r = httpx.get(router.url + "/admin/backends", timeout=5)
    assert r.status_code == 200 and r.json()[0]["kv_events_state"]["lag_seconds"] == lag
    assert httpx.get(router.url + "/metrics", timeout=5).status_code == 200
