"""The homes table: a prefix group keeps its home after every engine evicted it, a spill does not
move it, a prompt sharing only a short header starts a group of its own, new groups spread by
homed blocks per weight, and the table is bounded."""

from __future__ import annotations

from balancers.prefix_homes import PrefixHomes
from router.request.placement.prefix import block_hashes

BOTH = {"a": 1.0, "b": 1.0}


def chain(customer: str, blocks: int, tail: str = "") -> list[bytes]:
    text = (f"Context of {customer}. " * 200)[: blocks * 64 - len(tail)] + tail
    return block_hashes(text, 64)


def test_a_group_keeps_its_home_and_a_spill_does_not_move_it() -> None:
    homes = PrefixHomes()
    first = chain("acme", 16, "question one")
    homes.record(first, "a")
    later = chain("acme", 16, "question two")  # same 15 blocks, its own last one
    assert homes.find(later, BOTH) == ("a", 15)
    homes.record(later, "b")  # spilled once
    assert homes.find(later, BOTH)[0] == "a"
    # Its home gone (not a candidate): placed as new.
    assert homes.find(later, {"b": 1.0}) == (None, 0)


def test_a_short_shared_header_starts_a_group_of_its_own() -> None:
    homes = PrefixHomes()
    header = "You are a helpful assistant. " * 5  # 145 characters: 2 blocks
    homes.record(block_hashes(header + "x" * 1000, 64), "a")
    other = block_hashes(header + "y" * 1000, 64)
    assert homes.find(other, BOTH) == (None, 0)


def test_new_groups_spread_by_homed_blocks_per_weight_and_tails_do_not_count() -> None:
    homes = PrefixHomes()
    homes.record([], "b")  # a session-only request has no blocks
    assert homes.place(BOTH) == "a"
    homes.record(chain("one", 16), "a")
    assert homes.place(BOTH) == "b"
    homes.record(chain("two", 16), "b")
    for i in range(20):  # a's group is busy: its requests' own last blocks are no new group
        homes.record(chain("one", 16, f"q{i}"), "a")
    assert homes.place(BOTH) in ("a", "b")
    homes.record(chain("three", 16), homes.place(BOTH) or "")
    assert homes.place(BOTH) != homes.find(chain("three", 16), BOTH)[0]
    assert homes.place({"a": 1.0, "b": 3.0}) == "b"  # by weight


def test_the_table_is_bounded() -> None:
    homes = PrefixHomes(max_blocks=40)
    for k in range(10):
        homes.record(chain(f"c{k}", 16), "a" if k % 2 else "b")
    assert len(homes) == 40
    assert homes.find(chain("c9", 16), BOTH) == ("a", 16)
    assert homes.find(chain("c0", 16), BOTH) == (None, 0)  # the least recent went
