"""Response id -> the backend holding it, so Responses follow-ups reach the engine that has them.

vLLM keeps a stored response (and the conversation behind it) in the memory of the engine that
produced it: `previous_response_id`, `GET /v1/responses/{id}` and `.../cancel` must go there.
The proxy remembers each new response's id with its backend and public model name as soon as
the id passes (before the client can see it, so a follow-up through any replica finds it).

- Local: an LRU of at most `response_ids.max_local` ids, each kept `ttl` seconds after its last
  use. Always written, and read first: an id never moves, so a local hit is the answer.
- Shared (`redis_url` set): `SET <redis_prefix>:resp:<id> <backend>\\x1f<model> EX ttl`, read
  with `GETEX ... EX ttl` (a use refreshes it). A call waits at most `redis_timeout` x 4 (a
  follow-up that finds nothing is refused, so this read is worth a little more patience than a
  count); on a failure the local map answers, and a write that failed is not retried.
Cost: one Redis round trip when a response is created, one per follow-up not made here; none
for any other endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.core.errors import STORE_FAILURES

log = logging.getLogger("sluicegate.responses")

_SEP = "\x1f"


@dataclass(frozen=True, slots=True)
class Holder:
    backend: str  # the backend's name
    model: str  # the public model name the response was made with


class ResponseIds:
    def __init__(
        self,
        ttl: float,
        max_local: int,
        client: Any = None,
        prefix: str = "sluicegate",
        clock: Callable[[], float] = time.monotonic,
        timeout: float | None = None,
        owns_client: bool = True,
    ) -> None:
        self._ttl = ttl
        # A bound on each call; None leaves it to the client's socket timeout. The app's shared
        # client has none (and is closed by the app: `owns_client` False).
        self._timeout = timeout
        self._owns_client = owns_client
        self._max = max_local
        self._client = client  # an asyncio Redis client, or None
        self._prefix = f"{prefix}:resp:"
        self._clock = clock
        self._local: OrderedDict[str, tuple[Holder, float]] = OrderedDict()
        self.failures = 0  # Redis calls that failed (then answered locally)

    @property
    def shared(self) -> bool:
        return self._client is not None

    def __len__(self) -> int:
        return len(self._local)

    def _keep(self, response_id: str, holder: Holder) -> None:
        local = self._local
        local[response_id] = (holder, self._clock() + self._ttl)
        local.move_to_end(response_id)
        while len(local) > self._max:
            local.popitem(last=False)

    async def remember(self, response_id: str, holder: Holder) -> None:
        self._keep(response_id, holder)
        if self._client is None:
            return
        try:
            async with asyncio.timeout(self._timeout):
                await self._client.set(
                    self._prefix + response_id,
                    f"{holder.backend}{_SEP}{holder.model}",
                    ex=max(1, round(self._ttl)),
                )
        except STORE_FAILURES as exc:
            self._failed("write", exc)

    async def find(self, response_id: str) -> Holder | None:
        entry = self._local.get(response_id)
        if entry is not None:
            holder, until = entry
            if until > self._clock():
                self._keep(response_id, holder)  # a use keeps it
                return holder
            del self._local[response_id]
        if self._client is None:
            return None
        try:
            async with asyncio.timeout(self._timeout):
                raw = await self._client.getex(
                    self._prefix + response_id, ex=max(1, round(self._ttl))
                )
        except STORE_FAILURES as exc:
            self._failed("read", exc)
            return None
        if raw is None:
            return None
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        backend, sep, model = text.partition(_SEP)
        if not sep or not backend:
            return None
        holder = Holder(backend, model)
        self._keep(response_id, holder)
        return holder

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        log.warning(
            "response id store unavailable; answering from this process",
            extra={"fields": {"call": what, "error": type(exc).__name__}},
        )

    async def aclose(self) -> None:
        if self._client is not None and self._owns_client:
            await self._client.aclose()
