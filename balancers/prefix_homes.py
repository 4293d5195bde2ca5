"""Where each prompt prefix lives: its home backend, kept after every engine has evicted it.

The prefix index (balancers/prefix_index.py) forgets a prefix when its engine does, so under KV
pressure a prefix evicted everywhere looked new and was placed by load: each eviction moved a
prefix to another engine, which evicted another there (issue 52's thrash). The peers' trees
remember where a prefix went; so does this table. Keys are the same chained block hashes
(router/request/placement/prefix.py: hash i covers blocks 0..i); each maps to the backend the
first prompt with that block was sent to. A record never moves a home (a prompt spilled
elsewhere leaves its group's home where it was, and its own new blocks join that home); a
group is the run of blocks homed together.

`find()` answers the deepest homed block among the prompt's chain and its home; a prompt whose
homed run is under half its blocks (vllm-router's `cache_threshold`, 0.5) starts a group of its
own, so prompts that share only a short system header spread rather than follow it.
`place()` gives a new group the eligible backend home to the fewest blocks per unit of weight:
homes spread so the fleet's KV capacity holds as many prefixes as it can (the peers' "smallest
tree").

Per process; with Redis the table is shared (router/request/placement/affinity_store.py: the same
rule in the prefix index's script, so replicas send an evicted prefix to the same home) and this
one is kept warm beside it as the fallback.
Bounded: at most MAX_HOME_BLOCKS entries (~190 bytes each, ~25 MB at the cap), least recently
recorded first out. Cost: a lookup and a record walk the prompt's chain, about three dict
operations per block (128 for a 32k-character prompt): tens of microseconds, paid only by
`cache_aware` (74 us measured on a machine at load average 25; not measured idle).
No I/O, no clock: the request path records a dispatch, the balancer receives `find()`'s answer
as data (`Hints.home`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

MAX_HOME_BLOCKS = 1 << 17  # 33.5M characters of distinct prefixes at 256 a block
GROUP_SHARE = 0.5  # a homed run under this share of the prompt: the prompt starts a new group


class PrefixHomes:
    def __init__(self, max_blocks: int = MAX_HOME_BLOCKS) -> None:
        self._home: OrderedDict[bytes, tuple[str, bool]] = OrderedDict()  # (home, counted)
        self._count: dict[str, int] = {}  # backend -> blocks it is home to
        self._max = max_blocks

    def __len__(self) -> int:
        return len(self._home)

    def find(self, hashes: Sequence[bytes], names: Mapping[str, float]) -> tuple[str | None, int]:
        """The prompt's home among `names` (backend -> weight) and how many leading blocks are
        homed there; (None, 0) when its group is new or its home is not among `names`."""
        homes = self._home
        home, depth = None, 0
        for i, h in enumerate(hashes):
            owner = homes.get(h)
            if owner is None:
                break
            home, depth = owner[0], i + 1
        return settle(home, depth, len(hashes), names)

    def place(self, names: Mapping[str, float]) -> str | None:
        """A new group's home: the backend home to the fewest blocks per unit of weight."""
        return least_homed(self._count, names)

    def record(self, hashes: Sequence[bytes], backend: str) -> None:
        """`backend` was sent this prompt: the blocks with no home yet get it, or, the prompt
        being of a known group, the group's home. Only a new
        group's blocks count toward its home's share (`place()`): a group's own tails (each
        request's question) would otherwise make a busy home look full of groups."""
        if not hashes:
            return
        homes, count = self._home, self._count
        known = 0
        for h in hashes:
            if h not in homes:
                break
            known += 1
        if known == len(hashes):  # all homed already: only their recency moves
            for h in hashes:
                homes.move_to_end(h)
            return
        counted = known < GROUP_SHARE * len(hashes)
        # A known group's new blocks (a request's own tail) join its home, wherever it was sent.
        owner = backend if counted else homes[hashes[known - 1]][0]
        for h in hashes:
            if h in homes:
                homes.move_to_end(h)
                continue
            homes[h] = (owner, counted)
            if counted:
                count[owner] = count.get(owner, 0) + 1
        while len(homes) > self._max:
            gone, was_counted = homes.popitem(last=False)[1]
            if not was_counted:
                continue
            left = count[gone] - 1
            if left:
                count[gone] = left
            else:
                del count[gone]


def settle(
    home: str | None, depth: int, blocks: int, names: Mapping[str, float]
) -> tuple[str | None, int]:
    """`find()`'s answer from the deepest homed block (this table's, or the shared one's,
    router/request/placement/affinity_store.py): (None, 0) for a new group or a gone home."""
    if home is None or home not in names or depth < GROUP_SHARE * blocks:
        return None, 0
    return home, depth


def least_homed(count: Mapping[str, int], names: Mapping[str, float]) -> str | None:
    """The backend home to the fewest blocks per unit of weight (the first of equals)."""
    best, least = None, 0.0
    for name, weight in names.items():
        load = count.get(name, 0) / max(weight, 1e-9)
        if best is None or load < least:
            best, least = name, load
    return best
