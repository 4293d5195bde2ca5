"""`cache_aware`'s partition under KV pressure, pick by pick (issue 52, seen on 2 real vLLM
engines): a new group goes to its proposed home, with or without KV events, unless the home's
queue costs more than a copy elsewhere; the approximate index's forgotten blocks do not move a
prompt off its home."""

from __future__ import annotations

import random

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
