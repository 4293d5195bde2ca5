"""`balancer: latency`'s samples are taken at a stream's first token, not at its end: a short run
of slow answers (the real-engine peers run: every pick within 10 s, answers of seconds) learns
its first model one whole decode sooner. The TPOT joins the same sample when the stream ends."""

from __future__ import annotations

from typing import cast

from router.core.settings import LatencyConfig
from router.request.placement.latency_feed import LatencyFeed
from router.request.usage.parse import ResponseUsage

FEATURES = (100.0, 0.0, 0.0, 0.0, 1.0, 0.1)


class Usage:
    """The one reading `observe` takes of a stream's usage: its seconds per output token."""

    def time_per_output_token(self) -> float:
        return 0.02


def test_a_streams_first_token_is_a_sample_and_its_end_adds_the_tpot() -> None:
    feed = LatencyFeed(LatencyConfig(min_samples=4))
    flights = [feed.tokens.dispatched("e0", 100, 32, FEATURES) for _ in range(4)]
    for f in flights:
        f.streaming = True
        f.first_token()
    got = feed.learner.samples("e0")
    assert len(got) == 4 and all(s.tpot is None for s in got)
    assert feed.learner.refit().pooled is not None  # a model before any stream has ended
    for f in flights:
        f.end()
        assert feed.observe(f, cast(ResponseUsage, Usage())) is not None
    got = feed.learner.samples("e0")
    assert len(got) == 4 and all(s.tpot == 0.02 for s in got)  # the same samples, completed


def test_no_sample_from_a_whole_body_or_a_pick_without_features() -> None:
    feed = LatencyFeed(LatencyConfig(min_samples=4))
    whole = feed.tokens.dispatched("e0", 100, 32, FEATURES)  # not streamed: no first token
    whole.first_token()
    bare = feed.tokens.dispatched("e0", 100, 32, None)  # a continuation's: no features
    bare.streaming = True
    bare.first_token()
    assert feed.learner.samples("e0") == []
