"""A simulated vLLM scheduler for the mock upstream: what makes its load look like an engine's.

Models (one step loop per engine, continuous batching):
- a running batch capped at `max_num_seqs`, and a FIFO waiting queue in front of it;
- KV capacity in tokens, handed out in blocks of `block_size`: a running sequence holds the blocks
  for its prompt plus the tokens generated so far; a waiting sequence is admitted only if its
  prompt fits (no admission past capacity); when a growing batch runs out of blocks, the newest
  running sequence is preempted (recompute: back to the head of the queue, counted in
  `vllm:num_preemptions_total`);
- step time = `decode_ms` + `decode_ms_per_seq` x batch size, plus `prefill_ms_per_1k` per
  thousand prompt tokens prefilled in that step (so long prompts delay everyone in the batch);
  each running sequence gains one token per step; the first one ends its prefill step;
- hidden background load: `background` sequences that occupy slots and KV like any other but
  never pass through a router (each one finished is replaced at once; lengths vary 0.5x-1.5x);
- vLLM 0.32's metric names (`vllm:num_requests_running/waiting`,
  `vllm:num_requests_waiting_by_reason`, `vllm:engine_sleep_state`, `vllm:kv_cache_usage_perc`
  or the old `vllm:gpu_cache_usage_perc`, `vllm:num_preemptions_total`,
  `vllm:request_success_total{finished_reason}` (a client's abort is not counted, as in vLLM),
  `vllm:cache_config_info` with vLLM's whole label set) with the `model_name`/`engine` labels,
  counters with their `_created` samples, `vllm:request_prefill_time_seconds` (admission to
  first token) and `vllm:inter_token_latency_seconds` as the simulation times them (what the
  router's calibration learns from), plus more histogram families of the size a real
  engine exposes, or SGLang's (`sglang:num_queue_reqs`, `sglang:num_running_reqs`,
  `sglang:token_usage`);
- automatic prefix caching (vLLM's APC, on by default as in vLLM v1; `prefix_caching=False` turns
  it off): the prompt's full blocks of `block_size` tokens are hashed as a chain (each hash covers
  its predecessor, so a hit is always a true prefix); at admission the longest cached run of them
  is not prefilled again (never the whole prompt: its last token is always computed, as in vLLM);
  the cache is an LRU of block hashes bounded by the KV capacity (`num_gpu_blocks`), a prompt's
  blocks touched tail first so that eviction takes a prompt's tail before its head (vLLM frees a
  request's blocks in reverse order); the response's `usage.prompt_tokens_details.cached_tokens`
  and the token counters `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` report
  it;
- vLLM's token counters `vllm:prompt_tokens_total` (a request's prompt, counted once, when its
  first token is generated) and `vllm:generation_tokens_total` (every token generated, background
  load included).

- LoRA (`max_loras` > 0, as `--enable-lora --max-loras N`): adapters registered at start
  (`lora_modules`, name -> path) or loaded at run time (the upstream's `/v1/load_lora_adapter`,
  after `lora_load_ms`); a waiting request whose adapter is not among the running batch's is
  skipped (it keeps its place; others go ahead) while `max_loras` adapters run, as vLLM's
  scheduler does; an adapter that is not in one of the `max_loras` slots is moved in when its
  first request is admitted, which adds `lora_slot_ms` to that step and counts in `lora_loads`
  (what adapter-unaware routing multiplies); `vllm:lora_requests_info` as vLLM 0.32 exports it
  (a new series per label set, set to the current time, labels in sorted order; both adapter
  labels list every adapter with requests, waiting or running, since vLLM fills both from one
  dict).

Does not model: chunked-prefill token budgets, swapping, speculative decoding, priorities, tensor
parallelism, real tokenisation (a prompt is `len(text) // 4` tokens), or GPU noise. The prefix
cache is bounded by the whole KV capacity, not by what the running batch leaves free (in vLLM a
cached block is reclaimed when a running sequence needs it), and background sequences never hit
it. Timing comes from the asyncio clock, so a busy host stretches every step alike.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import random
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.tools.mock import kv_publish


@dataclass
class EngineConfig:
    max_num_seqs: int = 32
    kv_tokens: int = 65536  # KV capacity in tokens (num_gpu_blocks x block_size)
    block_size: int = 16
    prefill_ms_per_1k: float = 20.0
    decode_ms: float = 10.0
    decode_ms_per_seq: float = 0.5
    background: int = 0  # hidden sequences kept in the engine
    background_prompt: int = 1000
    background_tokens: int = 200
    kv_metric: str = "vllm:kv_cache_usage_perc"  # or the old "vllm:gpu_cache_usage_perc"
    flavor: str = "vllm"  # "vllm" | "sglang": which metric names /metrics uses
    prefix_caching: bool = True  # vLLM v1's default
    # KV-cache events (router/tools/mock/kv_publish.py): where to publish (bound), and the encoding.
    kv_events: str | None = None
    kv_events_encoding: str = "map"  # or "array" (vLLM before ~0.24)
    max_loras: int = 0  # LoRA slots (vLLM's --max-loras); 0: LoRA off
    lora_modules: dict[str, str] = field(default_factory=dict)  # adapters at start: name -> path
    lora_load_ms: float = 0.0  # a run-time load (POST /v1/load_lora_adapter) takes this long
    lora_slot_ms: float = 0.0  # moving an adapter into a slot adds this to its step
    kv_events_replay: str | None = None  # vLLM's replay_endpoint (bound)

    @property
    def num_gpu_blocks(self) -> int:
        return max(1, self.kv_tokens // self.block_size)


@dataclass(eq=False)
class Seq:
    prompt: int
    max_tokens: int
    background: bool = False
    generated: int = 0
    prefilled: bool = False
    done: bool = False
    gone: bool = False
    blocks: int = 0
    prefix: Sequence[int] = ()  # chained hashes of the prompt's full blocks
    tokens: Sequence[int] = ()  # the prompt's token ids (for KV events' token_ids)
    cached: int = 0  # prompt tokens found in the prefix cache at (the last) admission
    lora: str | None = None  # the adapter it runs under
    admitted: float = 0.0  # loop clock at (the last) admission: its prefill time starts
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Engine:
    """The scheduler state and its step loop; the HTTP side submits sequences and waits."""

    def __init__(self, config: EngineConfig, model: str = "mock-model") -> None:
        self.config = config
        self.model = model
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.used_blocks = 0
        self.preemptions = 0
        self.steps = 0
        self.prefix_cache: OrderedDict[int, None] = OrderedDict()  # block hash, LRU first
        self.prefix_queries = 0  # tokens looked up (vllm:prefix_cache_queries_total)
        self.prefix_hits = 0  # tokens found (vllm:prefix_cache_hits_total)
        self.prompt_tokens = 0  # vllm:prompt_tokens_total: each request's prompt, at its 1st token
        self.generation_tokens = 0  # vllm:generation_tokens_total
        # vllm:request_success_total{finished_reason="length"}; an abort is not counted (vLLM
        # 0.32 does not count a client's disconnect under "abort" either)
        self.finished_length = 0
        # What vLLM's histograms say and the router's calibration reads (router/engine/
        # calibrate.py): each request's prefill time (admission to first token) and each
        # inter-token gap, in seconds, as they happen in this simulation.
        self.prefill_time = Histogram()
        self.inter_token = Histogram()
        self.started = time.time()  # the counters' `_created` value
        self._rng = random.Random(0)  # same hidden load on every run
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.kv = (
            kv_publish.KvPublisher(
                config.kv_events,
                encoding=config.kv_events_encoding,
                replay_endpoint=config.kv_events_replay,
            )
            if config.kv_events
            else None
        )
        self._kv_batch: list[object] = []  # this step's events, published together
        self.adapters: dict[str, str] = dict(config.lora_modules)  # registered: name -> path
        self.slots: OrderedDict[str, None] = OrderedDict()  # adapters in a slot, LRU first
        self.lora_loads = 0  # adapters moved into a slot
        self._slot_ms = 0.0  # this step's slot loads
        self._lora_series: dict[tuple[str, str], float] = {}  # (running, waiting) -> set at

    # --- the HTTP side ---------------------------------------------------------------------

    def submit(
        self,
        prompt: int,
        max_tokens: int,
        background: bool = False,
        prefix: Sequence[int] = (),
        tokens: Sequence[int] = (),
        lora: str | None = None,
    ) -> Seq:
        """`prefix`: the prompt's chained block hashes (`block_hashes()`), for the prefix cache;
        `tokens`: its token ids, which KV events carry; `lora`: a registered adapter."""
        seq = Seq(
            max(1, prompt), max(1, max_tokens), background, prefix=prefix, tokens=tokens, lora=lora
        )
        self.waiting.append(seq)
        self._ensure_running()
        return seq

    def cancel(self, seq: Seq) -> None:
        """The client left: free its slot and blocks at the next step (vLLM aborts it)."""
        seq.gone = True
        self._kick.set()

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (vLLM's `reset_prefix_cache()`); the counters keep counting."""
        self.prefix_cache.clear()
        if self.kv is not None:
            self.kv.publish([kv_publish.cleared(self.kv.array)])

    def set_background(self, n: int) -> None:
        """Keep `n` hidden sequences in the engine: more are queued, extra ones end now."""
        self.config.background = max(0, n)
        live = [s for s in (*self.waiting, *reversed(self.running)) if s.background and not s.gone]
        for seq in live[: max(0, len(live) - self.config.background)]:
            seq.gone = True
        self._top_up_background()
        self._ensure_running()

    # --- the scheduler ---------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._kick.set()

    def _top_up_background(self) -> None:
        live = sum(1 for s in self.running if s.background and not s.gone) + sum(
            1 for s in self.waiting if s.background and not s.gone
        )
        for _ in range(self.config.background - live):
            # Lengths vary (0.5x to 1.5x), as real traffic does: hidden sequences that all end
            # in the same step would empty the batch at once, then refill it at once.
            tokens = int(self.config.background_tokens * (0.5 + self._rng.random()))
            self.waiting.append(Seq(self.config.background_prompt, max(1, tokens), True))

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    def _free(self, seq: Seq) -> None:
        self.used_blocks -= seq.blocks
        seq.blocks = 0

    async def _loop(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        while True:
            self._drop_gone()
            if not self.running and not self.waiting:
                self._kick.clear()
                await self._kick.wait()
                continue
            prefill_tokens = self._admit()
            if self._kv_batch and self.kv is not None:
                self.kv.publish(self._kv_batch)
                self._kv_batch = []
            self._grow()
            step_ms = (
                cfg.decode_ms
                + cfg.decode_ms_per_seq * len(self.running)
                + cfg.prefill_ms_per_1k * prefill_tokens / 1000
                + self._slot_ms
            )
            self._slot_ms = 0.0
            t0 = loop.time()
            await asyncio.sleep(step_ms / 1000)
            now = loop.time()
            self.steps += 1
            finished = False
            for seq in self.running:
                if seq.gone:
                    continue
                if seq.generated == 0 or not seq.prefilled:
                    self.prefill_time.observe(now - seq.admitted)
                else:
                    self.inter_token.observe(now - t0)
                if seq.generated == 0:
                    self.prompt_tokens += seq.prompt
                seq.prefilled = True
                seq.generated += 1
                self.generation_tokens += 1
                if seq.generated >= seq.max_tokens:
                    seq.done = True
                    finished = True
                seq.wake.set()
            if finished:
                keep = []
                for seq in self.running:
                    if seq.done:
                        self._free(seq)
                    else:
                        keep.append(seq)
                self.running = keep
                self._top_up_background()

    def _drop_gone(self) -> None:
        if any(s.gone for s in self.running):
            for s in self.running:
                if s.gone:
                    self._free(s)
            self.running = [s for s in self.running if not s.gone]
        if any(s.gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if not s.gone)

    def _admit(self) -> int:
        """FIFO admission while a slot and the prompt's blocks are free; returns tokens to
        prefill in this step (a preempted sequence recomputes its prompt and output)."""
        cfg = self.config
        prefill = 0
        lora = cfg.max_loras > 0
        active = {s.lora for s in self.running if s.lora} if lora else set()
        skipped: list[Seq] = []
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora and seq.lora not in active and len(active) >= cfg.max_loras:
                skipped.append(self.waiting.popleft())  # every slot runs another adapter
                continue
            need = self._blocks_for(seq.prompt + seq.generated + 1)
            if self.used_blocks + need > cfg.num_gpu_blocks:
                break  # head-of-line: vLLM's FIFO does not skip ahead
            self.waiting.popleft()
            if seq.lora:
                active.add(seq.lora)
                self._slot_in(seq.lora, active)
            seq.admitted = asyncio.get_running_loop().time()
            seq.prefilled = False  # (again, after a preemption: it recomputes)
            seq.blocks = need
            self.used_blocks += need
            if cfg.prefix_caching and not seq.background:
                seq.cached = self._lookup_prefix(seq)
            prefill += seq.prompt + seq.generated - seq.cached
            self.running.append(seq)
        self.waiting.extendleft(reversed(skipped))
        return prefill

    def _slot_in(self, name: str, active: set[str]) -> None:
        if name in self.slots:
            self.slots.move_to_end(name)
            return
        self.slots[name] = None
        self.lora_loads += 1
        self._slot_ms += self.config.lora_slot_ms
        while len(self.slots) > self.config.max_loras:
            idle = next((n for n in self.slots if n not in active), None)
            if idle is None:
                break
            del self.slots[idle]

    def unload(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.slots.pop(name, None)

    def lora_text(self) -> str:
        """`vllm:lora_requests_info` as vLLM 0.32 writes it (module docstring)."""
        with_requests: dict[str, None] = {}
        for s in (*self.running, *self.waiting):
            if s.lora and not s.gone:
                with_requests[s.lora] = None
        names = ",".join(with_requests)
        series = self._lora_series
        series[(names, names)] = time.time()
        if len(series) > 256:  # vLLM keeps every one; a mock must not grow
            del series[min(series, key=lambda k: series[k])]
        lines = "".join(
            f'vllm:lora_requests_info{{max_lora="{self.config.max_loras}",'
            f'running_lora_adapters="{r}",waiting_lora_adapters="{w}"}} {t}\n'
            for (r, w), t in series.items()
        )
        return (
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n"
            "# TYPE vllm:lora_requests_info gauge\n" + lines
        )

    def _lookup_prefix(self, seq: Seq) -> int:
        """Prompt tokens already cached (a true prefix, whole blocks, never the last token);
        the prompt's blocks then join the cache as its most recent entries."""
        cfg = self.config
        cache = self.prefix_cache
        hit = 0
        for h in seq.prefix:
            if h not in cache:
                break
            hit += 1
        cached = min(hit * cfg.block_size, (seq.prompt - 1) // cfg.block_size * cfg.block_size)
        self.prefix_queries += seq.prompt
        self.prefix_hits += cached
        kv = self.kv
        new = [i for i, h in enumerate(seq.prefix) if h not in cache] if kv is not None else []
        for h in reversed(seq.prefix):  # tail first: the head is evicted last
            cache[h] = None
            cache.move_to_end(h)
        gone = []
        while len(cache) > cfg.num_gpu_blocks:
            gone.append(cache.popitem(last=False)[0])
        if kv is not None:
            self._kv_events(seq, new, gone, kv.array)
        return cached

    def _kv_events(self, seq: Seq, new: list[int], gone: list[int], array: bool) -> None:
        """What vLLM would publish: each run of newly cached blocks as one BlockStored (its
        parent the block before), each evicted block as a BlockRemoved of its own."""
        bs = self.config.block_size
        batch = self._kv_batch
        if gone:
            batch.extend(kv_publish.removed_each(gone, array))
        run: list[int] = []
        for i in [*new, -1]:
            if run and (i != run[-1] + 1):
                first = run[0]
                parent = seq.prefix[first - 1] if first else None
                hashes = [seq.prefix[j] for j in run]
                tokens = seq.tokens[first * bs : (run[-1] + 1) * bs]
                if len(tokens) == len(hashes) * bs:
                    batch.append(kv_publish.stored(hashes, parent, tokens, bs, array))
                run = []
            if i >= 0:
                run.append(i)

    def _grow(self) -> None:
        """Each running sequence's next token may need one more block; preempt the newest
        ones while the blocks are not there."""
        total = self.config.num_gpu_blocks
        for seq in self.running:
            need = self._blocks_for(seq.prompt + seq.generated + 1)
            if need > seq.blocks:
                self.used_blocks += need - seq.blocks
                seq.blocks = need
        while self.used_blocks > total and len(self.running) > 1:
            victim = self.running.pop()
            self._free(victim)
            self.waiting.appendleft(victim)
            self.preemptions += 1

    # --- what /metrics shows ---------------------------------------------------------------

    def kv_usage(self) -> float:
        return min(1.0, self.used_blocks / self.config.num_gpu_blocks)

    def metrics_text(self) -> bytes:
        cfg = self.config
        if cfg.flavor == "sglang":
            lab = f'{{model_name="{self.model}"}}'
            return (
                "# HELP sglang:num_running_reqs The number of running requests.\n"
                "# TYPE sglang:num_running_reqs gauge\n"
                f"sglang:num_running_reqs{lab} {float(len(self.running))}\n"
                "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n"
                "# TYPE sglang:num_queue_reqs gauge\n"
                f"sglang:num_queue_reqs{lab} {float(len(self.waiting))}\n"
                "# HELP sglang:token_usage The token usage.\n"
                "# TYPE sglang:token_usage gauge\n"
                f"sglang:token_usage{lab} {self.kv_usage()}\n" + _filler("sglang", lab)
            ).encode()
        lab = f'{{engine="0",model_name="{self.model}"}}'
        inner = lab[1:-1]
        waiting = float(len(self.waiting))
        parts = [
            _gauge("num_requests_running", _HELP_RUNNING, lab, float(len(self.running))),
            _gauge("num_requests_waiting", _HELP_WAITING, lab, waiting),
            "# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.\n"
            "# TYPE vllm:num_requests_waiting_by_reason gauge\n"
            f'vllm:num_requests_waiting_by_reason{{{inner},reason="capacity"}} {waiting}\n'
            f'vllm:num_requests_waiting_by_reason{{{inner},reason="deferred"}} 0.0\n',
            "# HELP vllm:engine_sleep_state Engine sleep state\n"
            "# TYPE vllm:engine_sleep_state gauge\n"
            f'vllm:engine_sleep_state{{{inner},sleep_state="awake"}} 1.0\n'
            f'vllm:engine_sleep_state{{{inner},sleep_state="weights_offloaded"}} 0.0\n'
            f'vllm:engine_sleep_state{{{inner},sleep_state="discard_all"}} 0.0\n',
            f"# HELP {cfg.kv_metric} KV-cache usage. 1 means 100 percent usage.\n"
            f"# TYPE {cfg.kv_metric} gauge\n"
            f"{cfg.kv_metric}{lab} {self.kv_usage()}\n",
        ]
        counters = (
            ("prefix_cache_queries", _HELP_QUERIES, self.prefix_queries),
            ("prefix_cache_hits", _HELP_HITS, self.prefix_hits),
            (
                "num_preemptions",
                "Cumulative number of preemption from the engine.",
                self.preemptions,
            ),
            ("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            ("prompt_tokens_cached", _HELP_CACHED, self.prefix_hits),
            ("generation_tokens", "Number of generation tokens processed.", self.generation_tokens),
        )
        for name, help_, value in counters:
            parts.append(_counter(name, help_, lab, float(value), self.started))
        parts.append(
            "# HELP vllm:request_success_total Count of successfully processed requests.\n"
            "# TYPE vllm:request_success_total counter\n"
            + "".join(
                f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                f'model_name="{self.model}"}} {float(count)}\n'
                for reason, count in zip(_FINISHED, (0, self.finished_length, 0, 0, 0), strict=True)
            )
        )
        parts.append(
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{{{_cache_labels(cfg)}}} 1.0\n"
        )
        if cfg.max_loras > 0:
            parts.append(self.lora_text())
        parts.append(self.prefill_time.text("vllm:request_prefill_time_seconds", inner))
        parts.append(self.inter_token.text("vllm:inter_token_latency_seconds", inner))
        parts.append(_filler("vllm", lab))
        return "".join(parts).encode()


_HELP_RUNNING = "Number of requests in model execution batches."
_HELP_WAITING = "Number of requests waiting to be processed."
_HELP_QUERIES = "Prefix cache queries, in terms of number of queried tokens."
_HELP_HITS = "Prefix cache hits, in terms of number of cached tokens."
_HELP_CACHED = "Number of cached prompt tokens (local + external)."
_FINISHED = ("stop", "length", "abort", "error", "repetition")


def _gauge(name: str, help_: str, lab: str, value: float) -> str:
    return f"# HELP vllm:{name} {help_}\n# TYPE vllm:{name} gauge\nvllm:{name}{lab} {value}\n"


def _counter(name: str, help_: str, lab: str, value: float, created: float) -> str:
    """A counter as prometheus-client writes vLLM's: `_total`, then a `_created` gauge."""
    return (
        f"# HELP vllm:{name}_total {help_}\n# TYPE vllm:{name}_total counter\n"
        f"vllm:{name}_total{lab} {value}\n"
        f"# HELP vllm:{name}_created {help_}\n# TYPE vllm:{name}_created gauge\n"
        f"vllm:{name}_created{lab} {created}\n"
    )


def _cache_labels(cfg: EngineConfig) -> str:
    """vLLM 0.32's CacheConfig labels, in its (sorted) order; the router reads `block_size` and
    `num_gpu_blocks`."""
    labels = {
        "_block_size_resolved": "True",
        "block_size": str(cfg.block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(cfg.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(cfg.prefix_caching),
        "engine": "0",
        "gpu_memory_utilization": "0.92",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": "1.0",
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(cfg.num_gpu_blocks * cfg.block_size),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(cfg.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "False",
    }
    return ",".join(f'{k}="{v}"' for k, v in labels.items())


def block_hashes(text: str, block_chars: int) -> tuple[int, ...]:
    """Chained hashes of `text`'s full blocks of `block_chars` characters: block i's hash covers
    blocks 0..i, so equal hashes mean an equal prefix (a partial tail block is not cached)."""
    out = []
    h = 0
    for i in range(0, len(text) - block_chars + 1, block_chars):
        h = hash((h, text[i : i + block_chars]))
        out.append(h)
    return tuple(out)


_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
_HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "request_params_n",
    "request_max_num_generation_tokens",
)
_FILLER: dict[tuple[str, str], str] = {}
_LIVE = ("request_prefill_time_seconds", "inter_token_latency_seconds")  # not filler


class Histogram:
    """A Prometheus histogram of seconds over _BUCKETS, as prometheus-client writes it."""

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(_BUCKETS, value)] += 1
        self.sum += value

    def text(self, name: str, inner: str) -> str:
        help_ = name.split(":", 1)[1].replace("_", " ")
        lines = [f"# HELP {name} Histogram of {help_}.", f"# TYPE {name} histogram"]
        total = 0
        for le, n in zip((*_BUCKETS, "+Inf"), self.counts, strict=True):
            total += n
            lines.append(f'{name}_bucket{{{inner},le="{le}"}} {float(total)}')
        lines.append(f"{name}_count{{{inner}}} {float(total)}")
        lines.append(f"{name}_sum{{{inner}}} {self.sum}")
        return "\n".join(lines) + "\n"


def _filler(prefix: str, lab: str) -> str:
    """Histogram families like a real engine's (~200 lines): what a scraper must skip over."""
    key = (prefix, lab)
    text = _FILLER.get(key)
    if text is None:
        inner = lab[1:-1]
        lines = []
        for name in _HISTOGRAMS:
            if prefix == "vllm" and name in _LIVE:
                continue  # the engine's own (Engine.metrics_text)
            full = f"{prefix}:{name}"
            lines.append(f"# HELP {full} Histogram of {name.replace('_', ' ')}.")
            lines.append(f"# TYPE {full} histogram")
            for i, le in enumerate(_BUCKETS):
                lines.append(f'{full}_bucket{{{inner},le="{le}"}} {float(i * 7)}')
            lines.append(f'{full}_bucket{{{inner},le="+Inf"}} {float(len(_BUCKETS) * 7)}')
            lines.append(f"{full}_count{lab} {float(len(_BUCKETS) * 7)}")
            lines.append(f"{full}_sum{lab} 12.5")
        text = _FILLER[key] = "\n".join(lines) + "\n"
    return text
