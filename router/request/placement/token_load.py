"""The router's own token load per engine: prompt tokens sent and not yet first-tokened, decode
tokens still to come, for `balancer: latency` (its `LatencyInputs`) and `/admin/backends`.

A `TokenFlight` is one attempt's share, taken when its lease is (`dispatched`), from the prompt's
length (its token ids, or the body's bytes / 4, the estimate `cache_aware` uses) less the cached
part the pick predicted, and the completion budget (`max_tokens`, or admission's default). The
prompt leaves the prefill count at the first chunk (`first_token`); the decode count falls as
the usage reader counts streamed tokens (`streamed`, once per batch of 16 chunks: O(1) per
chunk, nothing parsed beyond what the pump already reads); whatever is left goes at the end
(`end`, from the attempt's lease, whichever way it ended). Counted only for balancers that
declare `needs_tokens`: other requests pay an attribute test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from balancers.latency_model import Sample


class TokenLoad:
    """Per backend: `prefill` (prompt tokens not yet first-tokened), `decode` (tokens left)."""

    def __init__(self) -> None:
        self.prefill: dict[str, int] = {}
        self.decode: dict[str, int] = {}
        # Told a streamed flight's first token (the latency feed's sample is taken then).
        self.on_first: Callable[[TokenFlight], None] | None = None

    def dispatched(
        self,
        backend: str,
        prompt: int,
        max_tokens: int,
        features: tuple[float, ...] | None = None,
        predicted: float | None = None,
    ) -> TokenFlight:
        prompt = max(0, prompt)
        max_tokens = max(0, max_tokens)
        self.prefill[backend] = self.prefill.get(backend, 0) + prompt
        self.decode[backend] = self.decode.get(backend, 0) + max_tokens
        return TokenFlight(self, backend, prompt, max_tokens, features, predicted)

    def view(self, backend: str) -> dict[str, int]:
        return {"prefill": self.prefill.get(backend, 0), "decode": self.decode.get(backend, 0)}

    def _drop(self, table: dict[str, int], backend: str, n: int) -> None:
        left = table.get(backend, 0) - n
        if left > 0:
            table[backend] = left
        else:
            table.pop(backend, None)  # nothing kept for a backend with nothing in flight


class TokenFlight:
    """One attempt's tokens on its backend, until `end`."""

    __slots__ = (
        "backend",
        "decode",
        "features",
        "first_at",
        "load",
        "predicted",
        "prompt",
        "sample",
        "sent_at",
        "streaming",
    )

    def __init__(
        self,
        load: TokenLoad,
        backend: str,
        prompt: int,
        decode: int,
        features: tuple[float, ...] | None,
        predicted: float | None,
    ) -> None:
        self.load = load
        self.backend = backend
        self.prompt = prompt
        self.decode = decode
        self.features = features
        self.predicted = predicted
        self.sent_at = time.perf_counter()
        self.first_at: float | None = None
        self.streaming = False  # its answer is a stream: its first chunk is a first token
        self.sample: Sample | None = None  # the learning sample its first token made

    def first_token(self) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
            if self.prompt:
                self.load._drop(self.load.prefill, self.backend, self.prompt)
                self.prompt = 0
            told = self.load.on_first
            if told is not None and self.streaming:
                told(self)

    def streamed(self, n: int) -> None:
        d = n if n < self.decode else self.decode
        if d > 0:
            self.decode -= d
            self.load._drop(self.load.decode, self.backend, d)

    def end(self) -> None:
        load = self.load
        if self.prompt:
            load._drop(load.prefill, self.backend, self.prompt)
            self.prompt = 0
        if self.decode:
            load._drop(load.decode, self.backend, self.decode)
            self.decode = 0
