"""Response id -> the backend holding it, so Responses follow-ups reach the engine that has them.

vLLM keeps a stored response (and the conversation behind it) in the memory of the engine that
produced it: `previous_response_id`, `GET /v1/responses/{id}` and `.../cancel` must go there.
The proxy remembers each new response's id with its backend and public model name as soon as
the id passes (before the client can see it, so a follow-up through any replica finds it).

Each id is bound to its owner: a digest of the client key that made it (`owner_of`; never the key,
nor the hash the config holds), or ANONYMOUS when no client keys are configured. A lookup by
another owner finds a `Holder` the caller must treat as unknown (`Holder.owned_by`): 404, never
that engine. The first `remember` of an id wins: another key's, or the same id from another
engine (vLLM takes a client's `request_id`), does not replace it. The known size of the
conversation (the tokens its latest response used) is kept with it (`sized`), for the quota
estimate of a request that continues it.

`ResponseIds` is this process's map: an LRU of at most `response_ids.max_local` ids, each kept
`ttl` seconds after its last use by its owner, and at most `response_ids.max_per_key` ids an
owner made (past it the owner's oldest is forgotten). With `redis_url` set,
`SharedResponseIds` (`response_ids_shared.py`) writes every id to Redis too and asks Redis for
an id this map does not hold; the map is always written, and read first: an id never moves, so
a local hit is the answer. Both answer the same calls (`ResponseIdStore`).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

SEP = "\x1f"  # between a stored value's fields
ANONYMOUS = "-"  # the owner of every response when no client keys are configured


def owner_of(key_sha256: str) -> str:
    """A client key's owner tag: a digest of its configured sha256, so what Redis holds is
    neither the key nor the hash that identifies it in the config."""
    return hashlib.sha256(b"sluicegate-response-owner\x00" + key_sha256.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Holder:
    backend: str  # the backend's name
    model: str  # the public model name the response was made with
    owner: str = ANONYMOUS  # the key that made it (`owner_of`), ANONYMOUS without keys
    tokens: int = 0  # the conversation's known size (its latest usage), 0 until known

    def owned_by(self, owner: str) -> bool:
        return self.owner == owner

    def same_place(self, other: Holder) -> bool:
        return (self.backend, self.model, self.owner) == (other.backend, other.model, other.owner)

    def head(self) -> str:
        return f"{self.backend}{SEP}{self.model}{SEP}{self.owner}{SEP}"


class ResponseIdStore(Protocol):
    """This process's map (`ResponseIds`) or the one shared through Redis
    (`response_ids_shared.SharedResponseIds`)."""

    async def remember(self, response_id: str, holder: Holder) -> bool:
        """Bind a new response's id to `holder` (its backend, model and owner); False when the
        id is held already, by another owner or on another backend: that binding stays."""
        ...

    async def find(self, response_id: str, owner: str = ANONYMOUS) -> Holder | None:
        """Who holds the id; a use by its `owner` keeps it. A holder of another owner is
        returned as such (`owned_by` tells), to be answered as unknown."""
        ...

    def sized(self, response_id: str, owner: str, tokens: int) -> None:
        """The conversation behind `response_id` is `tokens` long (its latest usage): what a
        request continuing it adds to its estimate. Only the owner's binding is changed."""
        ...

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...


class ResponseIds:
    """This process's map: always written, and read first."""

    def __init__(
        self,
        ttl: float,
        max_local: int,
        clock: Callable[[], float] = time.monotonic,
        max_per_key: int = 10_000,
    ) -> None:
        self.ttl = ttl
        self.max_per_key = max_per_key
        self._max = max_local
        self._clock = clock
        self._local: OrderedDict[str, tuple[Holder, float]] = OrderedDict()
        # owner -> the ids it made that this process keeps, oldest first (the per-key cap)
        self._owned: dict[str, OrderedDict[str, None]] = {}

    def __len__(self) -> int:
        return len(self._local)

    def owned(self, owner: str) -> int:
        """Ids of `owner` this process keeps."""
        ids = self._owned.get(owner)
        return len(ids) if ids is not None else 0

    def keep(self, response_id: str, holder: Holder) -> None:
        local = self._local
        local[response_id] = (holder, self._clock() + self.ttl)
        local.move_to_end(response_id)
        mine = self._owned.get(holder.owner)
        if mine is None:
            mine = self._owned[holder.owner] = OrderedDict()
        mine[response_id] = None
        while len(mine) > self.max_per_key:
            self.forget(next(iter(mine)))
        while len(local) > self._max:
            self.forget(next(iter(local)))

    def forget(self, response_id: str) -> None:
        entry = self._local.pop(response_id, None)
        if entry is None:
            return
        owner = entry[0].owner
        mine = self._owned.get(owner)
        if mine is not None:
            mine.pop(response_id, None)
            if not mine:
                del self._owned[owner]

    def bound(self, response_id: str, holder: Holder) -> bool | None:
        """Whether `remember` may bind the id to `holder`, when this process holds it already
        (kept again if so); None when it does not."""
        entry = self._local.get(response_id)
        if entry is None or entry[1] <= self._clock():
            return None
        if not entry[0].same_place(holder):
            return False
        self.keep(response_id, entry[0])
        return True

    def held(self, response_id: str, owner: str) -> Holder | None:
        """The holder this process keeps (a use by its owner keeps it); None when none."""
        entry = self._local.get(response_id)
        if entry is None:
            return None
        holder, until = entry
        if until <= self._clock():
            self.forget(response_id)
            return None
        if holder.owned_by(owner):
            self.keep(response_id, holder)  # a use keeps it
        return holder

    def resize(self, response_id: str, owner: str, tokens: int) -> Holder | None:
        """The owner's binding with its conversation `tokens` long; None when it is not kept
        here for that owner (or `tokens` says nothing)."""
        entry = self._local.get(response_id)
        if entry is None or not entry[0].owned_by(owner) or tokens <= 0:
            return None
        holder = replace(entry[0], tokens=int(tokens))
        self._local[response_id] = (holder, entry[1])
        return holder

    async def remember(self, response_id: str, holder: Holder) -> bool:
        known = self.bound(response_id, holder)
        if known is not None:
            return known
        self.keep(response_id, holder)
        return True

    async def find(self, response_id: str, owner: str = ANONYMOUS) -> Holder | None:
        return self.held(response_id, owner)

    def sized(self, response_id: str, owner: str, tokens: int) -> None:
        self.resize(response_id, owner, tokens)

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass
