"""Bytes of request bodies held against a bound, in one process: what the admission queue's
bodies (`admission.max_queue_bytes`) and every body read and held (`max_held_body_bytes`) are
counted in. An integer add and compare per take, an integer subtraction per give: cheap enough
for every request. The event loop is the only writer, so no lock is needed."""

from __future__ import annotations


class ByteBudget:
    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def fits(self, size: int) -> bool:
        return self.held + size <= self.limit

    def take(self, size: int) -> bool:
        """Hold `size` more bytes if they fit; False (nothing held) if not."""
        held = self.held + size
        if held > self.limit:
            return False
        self.held = held
        return True

    def add(self, size: int) -> None:
        """Hold `size` more bytes whether they fit or not (the caller sheds to make room)."""
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size
