"""`priority`: the first candidate in config order, the next one when it is full or failed.

The router drops full backends (`max_inflight`) from the candidates and names failed ones in
`exclude`, so "first offered" is primary-then-overflow. Loads are not read, so a shared store
needs no extra round trip to fetch them (`needs_counts = False`).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any, ClassVar, Protocol


class _Candidate(Protocol):
    name: str
    weight: float
    inflight: int


class Priority:
    name: ClassVar[str] = "priority"
    needs_counts: ClassVar[bool] = False

    def pick(self, candidates: Sequence[_Candidate], exclude: Set[str] = frozenset()) -> Any:
        for c in candidates:
            if c.name not in exclude:
                return c
        return None
