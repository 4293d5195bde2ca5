"""`cache_aware`'s partition under KV pressure, pick by pick (issue 52, seen on 2 real vLLM
engines): a new group goes to its proposed home, with or without KV events, unless the home's
queue costs more than a copy elsewhere; the approximate index's forgotten blocks do not move a
prompt off its home."""

from __future__ import annotations

import random
from dataclasses import replace

from balancers.base import Candidate
from balancers.cache_aware import CacheAware, Hints, KvHints
from balancers.context import PickContext
from router.core.engine import EngineReading
from tests.support.picking import Bound

P, Q = 1.4e-3, 8e-3  # seconds per prefilled token and per running sequence (the CPU engines')


def reading(running: float, waiting: float = 0.0) -> EngineReading:
    return EngineReading(
        waiting, running, 0.2, 5120, 0.0, 1.0, 1, prefill_s_per_token=P, step_s_per_seq=Q
    )


def pick(cands: list[Candidate], hints: Hints) -> tuple[str, str]:
    chosen = Bound(CacheAware(random.Random(1)), PickContext(hints=hints)).pick(cands)
    assert chosen is not None
    return chosen.candidate.name, chosen.reason


def test_a_new_group_goes_to_its_proposed_home_though_the_other_cache_has_room() -> None:
    """The group placed just before this one still prefills on `a` (pending there) and `b`'s
    events show room: in seconds that sent the new group to `b`, off its proposed home, and
    under pressure one engine ended up home to 5 prefixes of 8. Nothing is cached anywhere, so
    the pick is the partition's: a copy off the proposed home costs a prefill more, as without
    events (`a`: 1 x (1 + 2 running) = 3 prefills; `b`: (1 + 1) x (1 + 1) = 4)."""
    names = frozenset({"a", "b"})
    cands = [Candidate("a", 1.0, 2, reading(2)), Candidate("b", 1.0, 1, reading(1))]
    kv = KvHints(1088, {}, names, {"a": 1088}, {"a": 1088, "b": 0}, {"a": 0.0})
    new = Hints(17, 256, {}, None, kv, home="a", home_blocks=17, home_new=True)
    assert pick(cands, new) == ("a", "home")
    # Without events, the same.
    assert pick(cands, Hints(17, 256, {}, home="a", home_blocks=17, home_new=True)) == (
        "a",
        "home",
    )
    # A home queuing more than the copy costs still yields (3 + 3 > 4): load, not a thrash.
    busy = [Candidate("a", 1.0, 5, reading(2, waiting=3)), Candidate("b", 1.0, 1, reading(1))]
    assert pick(busy, new) == ("b", "load")
    # Cached somewhere (a prefix filled behind the router's back): the truth, in seconds.
    hidden = KvHints(1088, {"b": 1024}, names, {}, {"a": 0, "b": 1024}, {})
    held = Hints(17, 256, {}, None, hidden, home="a", home_blocks=17, home_new=True)
    assert pick(cands, held) == ("b", "prefix_exact")


def test_the_home_keeps_a_prompt_the_index_forgot() -> None:
    """The approximate index guesses eviction by its own count (characters per token), which
    runs short of what a real engine keeps: a home it guesses holds half the prompt is still
    its home, and its queue is cheaper than a copy elsewhere that evicts another prefix (home:
    8 + 1/17 x (1 + 4) = 8.3; b: (1 + 16/17) x (1 + 4) = 9.7). Priced at the index's guess
    (9/17 uncached: 8 + 2.6 = 10.6) the prompt moved, and its copy evicted another prefix."""
    hints = Hints(17, 256, {"a": 8}, home="a", home_blocks=16)
    cands = [Candidate("a", 1.0, 12, reading(4, waiting=8)), Candidate("b", 1.0, 4, reading(4))]
    assert pick(cands, hints) == ("a", "prefix")
    # A queue past the copy's price moves it (10.3 > 9.7), counted as a spill.
    cands[0] = Candidate("a", 1.0, 14, reading(4, waiting=10))
    assert pick(cands, hints) == ("b", "spill")


def test_with_events_the_home_keeps_its_prompt_whatever_the_engines_learnt_per_token() -> None:
    """Two identical engines taught prefill rates 8x apart: a rate is a request's whole
    prefill time over the tokens it computed, so the home, whose prompts hit, computes few
    tokens per prefill and looks slow. In seconds (4 x 1,088 x 1.5 ms = 6.6 s on `a` against
    10 x 1,088 x 0.18 ms + its copy = 4.6 s on `b`) that moved a homed prompt to a busier
    engine, and its copy evicted another prefix there (issue 52: 2 real engines under
    pressure). Where the home decides, the trade is in prefills, with the events' exact
    holdings: `a` 4 + 64/1,088 x (1 + 1) = 4.1 against `b` 10 + (1 + 1,024/1,088) x (1 + 6)."""
    names = frozenset({"a", "b"})

    def rated(running: float, waiting: float, p: float) -> EngineReading:
        return EngineReading(
            waiting, running, 0.9, 5120, 0.0, 1.0, 1, prefill_s_per_token=p, step_s_per_seq=Q
        )

    cands = [
        Candidate("a", 1.0, 5, rated(1, 4, 1.5e-3)),
        Candidate("b", 1.0, 16, rated(6, 10, 1.8e-4)),
    ]
    kv = KvHints(1088, {"a": 1024}, names, {}, {"a": 5120, "b": 5120}, {})
    homed = Hints(17, 256, {"a": 16}, None, kv, home="a", home_blocks=16)
    assert pick(cands, homed) == ("a", "prefix_exact")
    # Evicted everywhere, it goes home all the same (1 x (1 + 1) + 4 against b's 10 + ...).
    gone = KvHints(1088, {}, names, {}, {"a": 5120, "b": 5120}, {})
    assert pick(cands, Hints(17, 256, {}, None, gone, home="a", home_blocks=16)) == ("a", "home")
    # Its queue past the copy's price still moves it to an engine that can start it now (KV
    # free), counted as a spill.
    cands[0] = Candidate("a", 1.0, 25, rated(1, 20, 1.5e-3))
    cands[1] = Candidate("b", 1.0, 2, replace(rated(1, 0, 1.8e-4), kv_usage=0.2))
    assert pick(cands, homed) == ("b", "spill")
    # A prefix filled behind the router's back (cached on b, nothing on its home) is the
    # events' truth, in seconds, as before.
    hidden = KvHints(1088, {"b": 1024}, names, {}, {"a": 5120, "b": 5120}, {})
    cands[0] = Candidate("a", 1.0, 1, rated(1, 0, P))
    cands[1] = Candidate("b", 1.0, 1, rated(1, 0, P))
    assert pick(cands, Hints(17, 256, {}, None, hidden, home="a", home_blocks=16)) == (
        "b",
        "prefix_exact",
    )


def test_at_equal_cost_the_home_wins() -> None:
    """A new group's proposed home running 3 against an engine running 1, nothing queued: the
    home costs 1 x (1 + 3) = 4 prefills, a copy elsewhere (1 + 1) x (1 + 1) = 4. Balance that
    saves nothing is no reason to leave the partition's choice; least_load's tie-break sent it
    off (2 real engines under pressure, with and without events)."""
    cands = [Candidate("a", 1.0, 3, reading(3)), Candidate("b", 1.0, 1, reading(1))]
    new = Hints(17, 256, {}, home="a", home_blocks=17, home_new=True)
    assert pick(cands, new) == ("a", "home")
    kv = KvHints(1088, {}, frozenset({"a", "b"}), {}, {"a": 5120, "b": 5120}, {})
    assert pick(cands, Hints(17, 256, {}, None, kv, home="a", home_blocks=17, home_new=True)) == (
        "a",
        "home",
    )
    # One more running on the home tips it (1 x 5 > 4): placed by load.
    cands[0] = Candidate("a", 1.0, 4, reading(4))
    assert pick(cands, new) == ("b", "load")


def test_a_homed_prompt_leaves_its_home_only_for_an_engine_that_starts_it_now() -> None:
    """The home queues 14, the other engine 1: by cost the copy wins (b: 1 + (1 + 16/17) x
    (1 + 2) = 6.8 prefills against a: 14 + 1/17 x (1 + 4) = 14.3). But behind b's queue the
    copy waits too, and it evicts another prefix there: on 2 real engines under pressure such
    moves were the spills that cost hit rate and multiplied TTFT (issue 52). The prompt stays
    home unless an engine can start it now; then the cost decides."""
    hints = Hints(17, 256, {"a": 16}, home="a", home_blocks=16)
    cands = [Candidate("a", 1.0, 18, reading(4, 14)), Candidate("b", 1.0, 3, reading(2, 1))]
    assert pick(cands, hints) == ("a", "prefix")
    # With KV events where the home decides, the same.
    names = frozenset({"a", "b"})
    kv = KvHints(1088, {"a": 1024}, names, {}, {"a": 5120, "b": 5120}, {})
    with_kv = Hints(17, 256, {"a": 16}, None, kv, home="a", home_blocks=16)
    assert pick(cands, with_kv) == ("a", "prefix_exact")
    # A new group's proposed home holds nothing yet: its queue past the copy's price places it
    # by load (a: 14 + 1 x 5 = 19; b: 1 + 2 x 3 = 7), as on random prompts (every one a new
    # group) least_load would.
    new = Hints(17, 256, {}, home="a", home_blocks=17, home_new=True)
    assert pick(cands, new) == ("b", "load")
    # An engine that can start it now (nothing waiting, KV free) takes it by cost.
    cands[1] = Candidate("b", 1.0, 2, reading(2))
    assert pick(cands, hints) == ("b", "spill")
    assert pick(cands, with_kv) == ("b", "spill")
    assert pick(cands, new) == ("b", "load")
    # No KV free for it on b (10 % of 5,120 tokens < 1,088): it would wait, so home.
    full = EngineReading(0, 2, 0.9, 5120, 0.0, 1.0, 1, prefill_s_per_token=P, step_s_per_seq=Q)
    cands[1] = Candidate("b", 1.0, 2, full)
    assert pick(cands, hints) == ("a", "prefix")
    # An engine that holds as much of it as the home is weighed by cost though it queues: a
    # hot prefix cached on both goes to the shorter queue (b: 1 + 1/17 x 3; a: 14 + ...).
    cands[1] = Candidate("b", 1.0, 3, reading(2, 1))
    both = Hints(17, 256, {"a": 16, "b": 16}, home="a", home_blocks=16)
    assert pick(cands, both) == ("b", "prefix")
