"""A consistent-hash ring of backend names, for session affinity (`cache_aware`).

Each backend owns VNODES points on a 64-bit ring (blake2b of `name#i`); a session key hashes to a
point and walks clockwise: the first backend met is the key's home, the next distinct ones are
where it overflows to (consistent hashing with bounded loads: the caller skips a backend above
the bound). Adding or removing one backend moves only the keys whose home it takes or leaves,
about 1/N of them. Pure and immutable; `cache_aware` keeps one per candidate set. Nothing to
share across replicas: the ring follows from the names alone, so every replica builds the same
one, and the load bound reads `Candidate.inflight`, which the Redis in-flight store shares.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator
from hashlib import blake2b

VNODES = 100


def point(text: str) -> int:
    return int.from_bytes(blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest())


class Ring:
    def __init__(self, names: Iterable[str]) -> None:
        pairs = sorted((point(f"{n}#{i}"), n) for n in set(names) for i in range(VNODES))
        self._points = [p for p, _ in pairs]
        self._names = [n for _, n in pairs]
        self.size = len(set(self._names))

    def walk(self, key_point: int) -> Iterator[str]:
        """Distinct backends clockwise from `key_point`: its home first."""
        n = len(self._points)
        if not n:
            return
        start = bisect_left(self._points, key_point)
        seen: set[str] = set()
        for i in range(n):
            name = self._names[(start + i) % n]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == self.size:
                    return
