"""`cache_aware` under real KV pressure: follow-up turns of a conversation find most of their
prompt in the engine's prefix cache (the engine's own `cached_tokens`); `round_robin` on the
same trace finds almost none.

The trace is sized from the engines' reported KV capacity (C blocks of B tokens): N (odd)
conversations of p blocks each, three turns, turn by turn. Round robin sends a conversation's
next turn to the other engine (N odd), and by the turn after, that engine has served the N-1
other conversations, (N-1) x p > C blocks, so least-recently-used eviction has taken it. Held
on one engine, half the conversations (and what they grow by) fit in C. Turns go in staggered
pairs (the second sent once the first is in flight at the router), which places first turns one
per engine and leaves round robin's order unchanged.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any

import openai

from router.tools.enginefleet.fleet import Fleet
from tests.support.harness import Cluster, Proc, in_flight
from tests.support.wait import wait_for
from tests_engine.support import Words, kv_capacity_blocks, router_metrics, start_router

TURNS = 3
MAX_TOKENS = 24  # the answer; with the next question, a turn grows by well under a block


def plan(fleet: Fleet) -> tuple[int, int, int]:
    """(conversations, tokens per first prompt, block size) for the fleet's KV capacity."""
    blocks, block_size = kv_capacity_blocks(fleet.engines[0])
    p = 4  # blocks per conversation: a long prompt, well under max_model_len
    n = math.ceil(blocks / p) + 1  # (n - 1) x p > blocks: round robin's reuse distance evicts
    n += 1 - n % 2  # odd
    # One engine's share in full blocks, grown by its turns (under a block): fits even when the
    # first turns split 2:1 rather than evenly (they should split evenly; see run_trace).
    held = math.ceil(2 * n / 3) * (p + 1)
    assert held < blocks, f"trace does not fit the cache_aware side: {held} >= {blocks}"
    return n, p * block_size + block_size // 2, block_size


def run_trace(
    router: Proc, model: str, firsts: list[str]
) -> tuple[list[tuple[int, int]], Counter[str]]:
    """(prompt_tokens, cached_tokens) of every follow-up turn; where the first turns went."""
    c = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)
    history: list[list[dict[str, Any]]] = [[{"role": "user", "content": f}] for f in firsts]
    followups: list[tuple[int, int]] = []
    placed: Counter[str] = Counter()
    lock = threading.Lock()

    def turn(i: int, t: int) -> None:
        raw = c.chat.completions.with_raw_response.create(
            model=model,
            messages=history[i],  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        out = raw.parse()
        assert out.usage is not None
        details = out.usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details else 0
        history[i] += [
            {"role": "assistant", "content": out.choices[0].message.content or ""},
            {"role": "user", "content": f"and then, turn {t + 1}?"},
        ]
        with lock:
            if t > 0:
                followups.append((out.usage.prompt_tokens, cached))
            else:
                placed[raw.headers["x-sluicegate-backend"]] += 1

    for t in range(TURNS):
        for i in range(0, len(firsts), 2):
            first = threading.Thread(target=turn, args=(i, t))
            first.start()
            alive = first.is_alive
            if i + 1 < len(firsts):
                # The second of the pair arrives while the first is counted in flight.
                wait_for(
                    lambda alive=alive: in_flight(router) >= 1 or not alive(),  # type: ignore[misc]
                    "first of a pair in flight",
                    30,
                    0.002,
                )
                second = threading.Thread(target=turn, args=(i + 1, t))
                second.start()
                second.join(120)
            first.join(120)
    assert len(followups) == len(firsts) * (TURNS - 1)
    return followups, placed


def share(followups: list[tuple[int, int]]) -> float:
    return sum(c for _, c in followups) / sum(p for p, _ in followups)


def test_cache_aware_keeps_follow_ups_cached_where_round_robin_loses_them(
    fleet: Fleet, procs: Cluster
) -> None:
    n, tokens, _ = plan(fleet)
    model = fleet.engines[0].model
    shares = {}
    for seed, balancer in enumerate(("cache_aware", "round_robin"), start=100):
        words = Words(fleet, seed)  # its own text: nothing cached from the other run
        firsts = [words.text(tokens) for _ in range(n)]
        router = start_router(procs, fleet, {"balancer": balancer})
        followups, placed = run_trace(router, model, firsts)
        shares[balancer] = share(followups)
        reasons = {
            k: v for k, v in router_metrics(router).items() if "routing_decisions" in k and v
        }
        print(f"\n{balancer}: first turns {dict(placed)}, decisions {reasons}")
        router.stop()
    print(f"{n} conversations of ~{tokens} tokens, cached share of follow-ups: {shares}")
    # Held: each follow-up finds its whole previous prompt's full blocks (all but the partial
    # last block and the new turn): well over half. Round robin: evicted before its return.
    assert shares["cache_aware"] >= 0.6, shares
    assert shares["round_robin"] <= 0.15, shares
