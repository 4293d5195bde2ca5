"""A client that leaves mid-stream through the router stops the engine's work as fast as one
that leaves the engine directly: `vllm:num_requests_running` back to 0, and about as few tokens
generated after the close.

"After the close" is the engine's generated tokens minus the chunks the client read: it
includes what sat in socket buffers when the client left, which the router's extra hop may add
to, so the bounds compare against the same figure measured directly, in the same test.
"""

from __future__ import annotations

import statistics
import time

import openai

from router.enginefleet.fleet import Engine, Fleet
from tests.harness import Cluster, in_flight
from tests_engine.support import metrics, start_router, wait_for, wait_idle

READ_CHUNKS = 20
MAX_TOKENS = 1800  # far more than is read: generation must stop because the client left
TRIALS = 3
POLL_S = 0.005


def leave_mid_stream(base_url: str, engine: Engine) -> tuple[float, float]:
    """(seconds from the close to nothing running, tokens generated beyond those read)."""
    c = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    wait_idle([engine])
    before = metrics(engine)["vllm:generation_tokens_total"]
    stream = c.completions.create(
        model=engine.model,
        prompt="keep going",
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    read = 0
    for _ in stream:
        read += 1
        if read == READ_CHUNKS:
            break
    closed = time.monotonic()
    stream.close()
    wait_for(
        "the engine stops the abandoned request",
        lambda: metrics(engine)["vllm:num_requests_running"] == 0,
        timeout_s=10.0,
        step_s=POLL_S,
    )
    took = time.monotonic() - closed
    time.sleep(0.2)  # the last step's tokens land in the counter
    generated = metrics(engine)["vllm:generation_tokens_total"] - before
    # Not cancelled, it would have run to MAX_TOKENS. How soon it stopped is judged on the
    # medians below: one trial on a starved machine may lag (seen once: 665 tokens, load 36).
    assert generated < MAX_TOKENS, "generation went on to the end after the client left"
    return took, generated - read


def test_disconnect_through_the_router_stops_the_engine_like_a_direct_one(
    fleet: Fleet, procs: Cluster
) -> None:
    engine = fleet.engines[0]
    router = start_router(procs, fleet, engines=[engine])
    direct = [leave_mid_stream(engine.url, engine) for _ in range(TRIALS)]
    routed = [leave_mid_stream(router.url, engine) for _ in range(TRIALS)]
    print(f"\ndirect (s, tokens after close): {direct}\nrouted: {routed}")
    assert in_flight(router) == 0
    d_time = statistics.median(t for t, _ in direct)
    r_time = statistics.median(t for t, _ in routed)
    d_tokens = statistics.median(n for _, n in direct)
    r_tokens = statistics.median(n for _, n in routed)
    # The router's hop may add its own detection of the close and one more buffer: allowed
    # the direct figure again, plus what the engine generates in that time at the rate seen.
    rate = max(1.0, d_tokens / max(d_time, POLL_S))
    assert r_time <= 2 * max(t for t, _ in direct) + 10 * POLL_S, (direct, routed)
    assert r_tokens <= 2 * d_tokens + rate * d_time + READ_CHUNKS / 2, (direct, routed)
    assert d_time < 1.0 and r_time < 1.0
