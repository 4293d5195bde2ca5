"""Read the few families the router needs out of an engine's Prometheus text, fast.

A real engine's `/metrics` is hundreds of lines (histograms with a line per bucket); the router
needs five or six lines of it. `bytes.find` of "\n<family name>" jumps to those lines in C; the
rest of the text is never split, decoded or looked at.
(bench/scenarios/engine.py's `parse_cost` measures it against prometheus-client's parser.)
Values of series of one family are summed across their labels (`model_name`, `engine`,
data-parallel ranks); KV shares, being shares, are averaged.

Rejected, as `MetricsError` with a short reason: no wanted family at all, a value that is not a
number, NaN or infinite, negative, or absurd (a queue of a million, a KV share above 1), more than
MAX_SERIES series of one family or MAX_LINES lines starting with its name (a real engine has one
series per model and data-parallel rank: a page of 70,000 valid series took 78 ms of the event
loop per scrape; the caps bound the Python work per page to a few hundred lines, the rest of the
page is only scanned by `bytes.find`).

LoRA (`vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`): vLLM
sets a new series to the current time whenever the adapter sets change and never removes old ones,
so the series with the highest value is the current one; only its labels are parsed. That family
may hold many series on a long-running engine: it has its own cap (MAX_LORA_SERIES), past which
the LoRA part of the reading is dropped (`lora` None) instead of failing the whole scrape.

The KV capacity (`vllm:cache_config_info`, block_size x num_gpu_blocks) is only believed when
plausible (a block of 1..MAX_BLOCK_SIZE tokens, at most MAX_GPU_BLOCKS blocks; else it is taken
as unreported) and is capped at `max_kv_tokens` (`engine_metrics.max_kv_tokens`): it sizes the
backend's share of the prefix index, which an engine must not be able to grow without bound.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

VLLM = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv",  # the name before vLLM v0.10; same meaning
    "vllm:num_preemptions_total": "preemptions",
    "vllm:cache_config_info": "cache_config",
    # For the exchange rate between cached tokens and load (router/engine/calibrate.py).
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prompt_tokens_cached_total": "cached_tokens",
    "vllm:inter_token_latency_seconds_sum": "itl_s",
    "vllm:inter_token_latency_seconds_count": "itl_n",
    # The queue in prompt tokens (newer vLLM): balancers/latency.py's queued prefill.
    "vllm:num_tokens_waiting": "tokens_waiting",
    "vllm:approximate_uncached_tokens_waiting": "uncached_waiting",
}
COUNTERS = ("prefill_s", "prompt_tokens", "cached_tokens", "itl_s", "itl_n")
SGLANG = {
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv",
}
FAMILIES = {"vllm": VLLM, "sglang": SGLANG}

MAX_REQUESTS = 1_000_000.0  # more waiting or running than this is a broken exporter
MAX_KV_USAGE = 1.0001  # a share; rounding may overshoot 1 by a hair
MAX_SERIES = 256  # series of one family (models x data-parallel ranks)
MAX_LINES = 1024  # lines starting with a family's name (its own and longer names)
MAX_LORA_SERIES = 4096  # vllm:lora_requests_info: one series per adapter-set change
MAX_ADAPTERS = 1024  # names in one label
LORA_FAMILY = b"\nvllm:lora_requests_info"
MAX_BLOCK_SIZE = 65536  # tokens per KV block (vLLM: 16 by default; hybrid models a few hundred)
MAX_GPU_BLOCKS = 1 << 31
DEFAULT_MAX_KV_TOKENS = 8 * 1024 * 1024


class MetricsError(ValueError):
    """The text cannot be trusted; str() is a short reason shown as `scrape_error`."""


@dataclass(frozen=True, slots=True)
class Parsed:
    waiting: float
    running: float
    kv_usage: float
    kv_capacity_tokens: int | None
    preemptions: float | None
    block_size: int | None = None
    counters: dict[str, float] | None = None  # COUNTERS found (cumulative)
    # (max_lora, running adapters, waiting adapters) from the newest lora_requests_info series
    lora: tuple[int, frozenset[str], frozenset[str]] | None = None
    # Prompt tokens waiting: the uncached count when exported, else the whole (None: neither)
    tokens_waiting: float | None = None


_NEEDLES = {
    kind: tuple((b"\n" + name.encode(), field) for name, field in names.items())
    for kind, names in FAMILIES.items()
}
_LABEL = re.compile(rb'(\w+)="((?:[^"\\]|\\.)*)"')


def _lines(text: bytes, needle: bytes, max_series: int = MAX_SERIES) -> list[tuple[bytes, bytes]]:
    """(labels, value) of each sample line of one family: `bytes.find` skips the rest."""
    out: list[tuple[bytes, bytes]] = []
    n = len(needle)
    pos = text.find(needle)
    lines = 0
    max_lines = max(MAX_LINES, max_series)
    while pos >= 0:
        lines += 1
        if lines > max_lines or len(out) >= max_series:
            raise MetricsError(f"too many series of {needle[1:].decode(errors='replace')}")
        after = text[pos + n : pos + n + 1]
        end = text.find(b"\n", pos + n)
        if end < 0:
            end = len(text)
        if after == b"{":  # labels, then the value (and maybe a timestamp)
            close = text.rfind(b"}", pos + n, end)
            if close < 0:
                raise MetricsError("unterminated label set")
            labels, rest = text[pos + n : close + 1], text[close + 1 : end]
        elif after in (b" ", b"\t"):
            labels, rest = b"", text[pos + n : end]
        else:  # a longer name (`_bucket`, `_created`, ...)
            pos = text.find(needle, pos + n)
            continue
        parts = rest.split()
        if not parts:
            raise MetricsError("sample without a value")
        out.append((labels, parts[0]))
        pos = text.find(needle, end)
    return out


def _number(raw: bytes) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise MetricsError(f"not a number: {raw[:20]!r}") from None
    if math.isnan(v) or math.isinf(v):
        raise MetricsError("NaN or infinite value")
    if v < 0:
        raise MetricsError("negative value")
    return v


def _names(raw: bytes) -> frozenset[str]:
    if not raw:
        return frozenset()
    names = raw.decode("utf-8", "replace").split(",")
    if len(names) > MAX_ADAPTERS:
        raise MetricsError("too many LoRA adapters")
    return frozenset(n for n in names if n)


def parse_lora(text: bytes) -> tuple[int, frozenset[str], frozenset[str]] | None:
    """The newest `vllm:lora_requests_info` series (`text` starts with a newline); None when
    the engine runs without LoRA, or the family has more series than MAX_LORA_SERIES."""
    if text.find(LORA_FAMILY) < 0:
        return None
    try:
        lines = _lines(text, LORA_FAMILY, MAX_LORA_SERIES)
    except MetricsError:
        return None
    best: bytes | None = None
    newest = -1.0
    for labels, raw in lines:
        v = _number(raw)
        if v >= newest:
            newest, best = v, labels
    if best is None:
        return None
    found = dict(_LABEL.findall(best))
    try:
        max_lora = int(found.get(b"max_lora", b"0"))
    except ValueError:
        raise MetricsError("max_lora is not a number") from None
    if not 0 <= max_lora <= MAX_ADAPTERS:
        raise MetricsError("absurd max_lora")
    running = _names(found.get(b"running_lora_adapters", b""))
    # As written: vLLM 0.32 lists every adapter with requests under both (balancers/lora.py).
    waiting = _names(found.get(b"waiting_lora_adapters", b""))
    return max_lora, running, waiting


def parse(text: bytes, kind: str, max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS) -> Parsed:
    sums: dict[str, float] = {}
    kv_series = 0
    capacity: int | None = None
    block_size: int | None = None
    text = b"\n" + text  # so the first line is found like every other
    for needle, field in _NEEDLES[kind]:
        for labels, raw in _lines(text, needle):
            value = _number(raw)
            if field == "cache_config":
                found = dict(_LABEL.findall(labels))
                try:
                    blocks = int(found[b"num_gpu_blocks"])
                    size = int(found[b"block_size"])
                except (KeyError, ValueError):
                    continue  # vLLM prints num_gpu_blocks="None" before its profile run
                if blocks < 0 or size <= 0:
                    raise MetricsError("negative KV capacity")
                if size > MAX_BLOCK_SIZE or blocks > MAX_GPU_BLOCKS:
                    continue  # not an engine's: taken as unreported
                capacity = min(max_kv_tokens, (capacity or 0) + blocks * size)
                block_size = size
                continue
            if field == "kv":
                if value > MAX_KV_USAGE:
                    raise MetricsError("KV usage above 1")
                kv_series += 1
            sums[field] = sums.get(field, 0.0) + value
    if "waiting" not in sums and "running" not in sums:
        raise MetricsError("no engine metrics in the answer")
    waiting = sums.get("waiting", 0.0)
    running = sums.get("running", 0.0)
    if waiting > MAX_REQUESTS or running > MAX_REQUESTS:
        raise MetricsError("absurd request count")
    # A share, not a count: data-parallel ranks each report their own, so take the mean.
    kv = sums.get("kv", 0.0) / kv_series if kv_series else 0.0
    counters = {k: sums[k] for k in COUNTERS if k in sums}
    return Parsed(
        waiting,
        running,
        min(kv, 1.0),
        capacity,
        sums.get("preemptions"),
        block_size,
        counters or None,
        parse_lora(text) if kind == "vllm" else None,
        sums.get("uncached_waiting", sums.get("tokens_waiting")),
    )
