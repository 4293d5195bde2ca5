"""What an engine last reported about its load, as a frozen value balancers receive as data.

The scraper (`router/engine/`) builds one `EngineReading` per scraped backend and publishes them
together as one immutable mapping; a stale one keeps its last figures, marked `stale`.
"""

from __future__ import annotations

from dataclasses import dataclass

NO_ADAPTERS: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class EngineReading:
    waiting: float  # requests in the engine's queue (vllm:num_requests_waiting, summed)
    running: float  # requests in its running batch
    kv_usage: float  # KV cache in use, 0..1
    kv_capacity_tokens: int | None  # block_size x num_gpu_blocks, when the engine says
    preemptions: float | None  # cumulative, vLLM only
    scraped_at: float  # wall clock of the last good scrape (0: never)
    seq: int  # bumps with every good scrape: "dispatched since this reading" resets on it
    stale: bool = False  # no good scrape within `engine_metrics.stale_after`
    scrape_error: str | None = None  # why the last scrape failed, if it did
    block_size: int | None = None  # tokens per KV block (vllm:cache_config_info)
    # Learned from the engine's histograms (router/engine/calibrate.py); None: not enough yet.
    prefill_s_per_token: float | None = None  # prefill seconds per uncached prompt token
    step_s_per_seq: float | None = None  # decode step seconds per running sequence
    # LoRA (vllm:lora_requests_info, the newest series; only engines started with --enable-lora)
    max_lora: int | None = None  # adapters the engine runs at once (None: LoRA off/unreported)
    lora_running: frozenset[str] = NO_ADAPTERS  # adapters with requests in the running batch
    lora_waiting: frozenset[str] = NO_ADAPTERS  # adapters with requests only in the queue
    # Adapters the engine serves (its `/v1/models` entries whose `parent` is its base model),
    # refreshed every `lora.refresh` seconds; None: not asked yet, or not a vLLM engine.
    adapters: frozenset[str] | None = None
    # The context its base model takes (`max_model_len` in the same `/v1/models`), for the
    # context-window fallback's check before the call; None: not reported (yet).
    max_model_len: int | None = None
    # This process's own in-flight count on the backend when the scrape was sent (None: not
    # known, e.g. with counts shared through Redis). A balancer pairs the reading with it: our
    # requests that ended between the scrape and the pick are in the figures but no longer on
    # the engine (pairing when the reading is first seen counted them, and a follow-up turn
    # saw its own finished first turn queued on its holder).
    inflight_at: int | None = None
    # Prompt tokens in the engine's queue, not yet prefilled (vllm:num_tokens_waiting, or
    # vllm:approximate_uncached_tokens_waiting: its cached part left out) when it exports them.
    tokens_waiting: float | None = None

    def serves(self, adapter: str) -> bool:
        """The engine can run `adapter` without a load (listed, or seen running or waiting)."""
        return (
            (self.adapters is not None and adapter in self.adapters)
            or adapter in self.lora_running
            or adapter in self.lora_waiting
        )

    def public(self) -> dict[str, object]:
        return {
            "waiting": self.waiting,
            "running": self.running,
            "kv_usage": self.kv_usage,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "scraped_at": self.scraped_at or None,
            "stale": self.stale,
            "scrape_error": self.scrape_error,
            "block_size": self.block_size,
            "prefill_s_per_token": self.prefill_s_per_token,
            "step_s_per_seq": self.step_s_per_seq,
            "max_model_len": self.max_model_len,
            "tokens_waiting": self.tokens_waiting,
            "lora": None
            if self.max_lora is None and not self.adapters
            else {
                "max_lora": self.max_lora,
                "loaded": sorted(self.adapters or ()),
                "running": sorted(self.lora_running),
                "waiting": sorted(self.lora_waiting),
            },
        }


NEVER = EngineReading(0.0, 0.0, 0.0, None, None, 0.0, 0, stale=True, scrape_error=None)
