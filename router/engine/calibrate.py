"""What a cached token is worth on one engine, learned from its own histograms.

Between two scrapes of vLLM's `/metrics`:
- prefill seconds per computed prompt token = Δ request_prefill_time_seconds_sum /
  Δ(prompt_tokens_total - prompt_tokens_cached_total), over the scrapes since the last rate,
  once at least MIN_TOKENS were computed: a window stays open until then. Per pair of scrapes
  (0.1-0.25 s apart) an engine whose prompts mostly hit its cache computed too few tokens, or
  counted a request's tokens and its prefill time in different windows, and never taught a
  rate (2 real engines, `--only kv_real`: nearly every request a hit, the default stood in
  for a rate 1.6-4x it);
- decode-step seconds per running sequence = the mean inter-token latency (Δ sum / Δ count of
  inter_token_latency_seconds, at least MIN_STEPS tokens) over the mean of num_requests_running
  at the two scrapes (at least 1). It counts the step's fixed part too, so it errs toward
  "a running request is expensive", which is right where decode contention dominates.
Each is an exponentially weighted mean (ALPHA) of the windows that qualify; None until one has.
A counter that goes backwards (the engine restarted) starts the learning window over.
`cache_aware` falls back to its documented defaults while these are None.
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.3
MIN_TOKENS = 512.0
MIN_STEPS = 8.0


@dataclass
class Calibration:
    prefill_s_per_token: float | None = None
    step_s_per_seq: float | None = None
    _last: dict[str, float] | None = None
    _since: dict[str, float] | None = None  # the counters where the open prefill window began
    _running: float = 0.0

    def update(self, counters: dict[str, float] | None, running: float) -> None:
        if not counters:
            return
        last, self._last = self._last, dict(counters)
        prev_running, self._running = self._running, running
        if last is None or any(counters.get(k, 0.0) < v for k, v in last.items()):
            self._since = dict(counters)  # a first scrape, or a restart: a window begins
            return
        since = self._since or last  # set with the first scrape

        def delta(key: str, base: dict[str, float] = last) -> float:
            return counters.get(key, 0.0) - base.get(key, 0.0)

        computed = delta("prompt_tokens", since) - delta("cached_tokens", since)
        if computed >= MIN_TOKENS:
            if delta("prefill_s", since) > 0:
                self.prefill_s_per_token = _ewma(
                    self.prefill_s_per_token, delta("prefill_s", since) / computed
                )
                self._since = dict(counters)
        steps = delta("itl_n")
        if steps >= MIN_STEPS and delta("itl_s") > 0:
            per_seq = delta("itl_s") / steps / max(1.0, (running + prev_running) / 2)
            self.step_s_per_seq = _ewma(self.step_s_per_seq, per_seq)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)
