"""What `balancer: latency` learns from: each request's observed TTFT and TPOT, fed back off the
balancer, and the models refitted from them as a runner chore.

The request path records one sample per streamed attempt at its first token (`first`, from the
token load): the features its pick saw and the TTFT that came of them; its TPOT is filled in at
the attempt's end (`observe`, from its lease). Taken at the end, the samples came one whole
decode late: a short run of slow answers ended before the first model (docs/balancers.md). A
non-streamed answer's first byte is its last, not a first token: it teaches nothing. `refit`
runs every `latency.refit_interval` seconds on the app's runner and clock, and swaps the frozen
`Models` the next picks read (balancers/latency_model.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from balancers.context import LatencyInputs
from balancers.latency_model import NO_MODELS, Learner, Models, Sample
from router.core.settings import LatencyConfig
from router.request.placement.token_load import TokenFlight, TokenLoad
from router.request.usage.parse import ResponseUsage


class RecentMin:
    """The smallest of the last `window` to 2 x `window` values seen (two buckets, rotated by
    count): the tightest TTFT SLO of the recent requests. O(1), no clock."""

    def __init__(self, window: int = 128) -> None:
        self._window = window
        self._now = math.inf
        self._before = math.inf
        self._n = 0

    def saw(self, value: float) -> float:
        """Count `value`; the recent minimum, it included."""
        if value < self._now:
            self._now = value
        self._n += 1
        if self._n >= self._window:
            self._before, self._now, self._n = self._now, math.inf, 0
        return min(self._now, self._before, value)


class LatencyFeed:
    def __init__(self, config: LatencyConfig) -> None:
        self.config = config
        self.learner = Learner(config.min_samples)
        self.models: Models = NO_MODELS
        self.tokens = TokenLoad()
        self.tokens.on_first = self.first
        self.slos = RecentMin()

    def inputs(
        self,
        prompt_tokens: int,
        pinned: str | None,
        break_ms: float,
        shed: bool,
        queued_s: float = 0.0,
        slo_ms: float | None = None,
    ) -> LatencyInputs:
        tokens = self.tokens
        tightest = math.inf
        if slo_ms is not None:
            tightest = self.slos.saw(slo_ms)
        return LatencyInputs(
            self.models,
            tokens.prefill,
            tokens.decode,
            prompt_tokens,
            pinned,
            break_ms / 1000,
            shed,
            queued_s,
            tightest,
        )

    def first(self, flight: TokenFlight) -> None:
        """`flight`'s stream brought its first token: a sample of its TTFT, its TPOT to come."""
        x = flight.features
        first = flight.first_at
        if x is None or len(x) != 6 or first is None:
            return
        sample = Sample((x[0], x[1], x[2], x[3], x[4], x[5]), first - flight.sent_at, None)
        self.learner.add(flight.backend, sample)
        flight.sample = sample

    def observe(
        self, flight: TokenFlight, usage: ResponseUsage | None
    ) -> tuple[float, float | None] | None:
        """`flight` ended having streamed its first token: its (TTFT, TPOT) in seconds, the
        TPOT also on the sample its first token made; None when it never streamed one."""
        first = flight.first_at
        if first is None:
            return None
        ttft = first - flight.sent_at
        tpot = usage.time_per_output_token() if usage is not None else None
        if flight.sample is not None:
            flight.sample.tpot = tpot
        return ttft, tpot

    def view(self, backend: str) -> dict[str, object]:
        """What `/admin/backends` shows: the token load, and the engine's model as last fitted
        (samples held, whether it has its own, its learnt prefill seconds per uncached token)."""
        fit = self.models.engines.get(backend)
        return {
            **self.tokens.view(backend),
            "samples": self.models.samples.get(backend, 0),
            "own_model": fit is not None,
            "prefill_s_per_token": fit.ttft[1] if fit is not None else None,
            # its TTFT line: intercept, then a slope per balancers/latency_model.FEATURES
            "ttft_line": [float(f"{w:.4g}") for w in fit.ttft] if fit is not None else None,
        }

    async def refit(self) -> None:
        self.models = self.learner.refit()

    def forget(self, keep: Iterable[str]) -> None:
        self.learner.forget(keep)
