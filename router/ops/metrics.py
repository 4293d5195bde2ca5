"""Prometheus metrics (`sluicegate_*`), fed once per request from its `RequestRecord`.

Nothing here runs per chunk: the proxy calls `observe(record)` when a request ends (time to
first content token and time per output token come from the record's `usage`, which the proxy
fills as the stream passes),
`attempt_failed()` when an attempt is retried, and the in-flight gauge moves through
`MeteredInflight` at acquire/release. With several uvicorn workers `sluicegate serve` sets
`PROMETHEUS_MULTIPROC_DIR` before any worker starts; each worker then writes its values to files
there and `/metrics`, whichever worker answers it, merges every worker's files.

Hooks for health (call on transitions, not per request): `health_changed(backend, healthy,
reason)`, `ejected(backend, reason, seconds)`. Redis fallback follows the store's `degraded` flag
(`MeteredInflight.check_fallback`, on each acquire and each scrape) or `redis_fallback(active)`.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from balancers.context import NO_CONTEXT, PickContext
from router.ops.live import Live

if TYPE_CHECKING:
    from balancers.base import Balancer
    from balancers.inflight.base import InflightStore, Lease, Readings
    from router.core.backend import Backend
    from router.core.engine import EngineReading
    from router.request.usage.record import RequestRecord

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# LLM latencies run from a cached 10 ms answer to minutes of a long reasoning stream.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
# Time to first token: a warm prefix cache answers in ms, a long prompt on a busy engine in tens
# of seconds.
TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10,
    20, 30, 60, 120,
)  # fmt: skip
# Time per output token: 1-100 ms is where decoding lives; seconds means something is wrong.
TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 0.75, 1, 2.5,
)  # fmt: skip

NO_BACKEND = "none"
# sluicegate_tokens_total: at most this many (key, model) pairs; later ones count as OTHER.
MAX_USAGE_SERIES = 1000
OTHER = "_other"


def multiprocess_dir() -> str | None:
    path = os.environ.get(MULTIPROC_ENV)
    return path if path and os.path.isdir(path) else None


def reap_dead_workers(path: str) -> list[int]:
    """Drop the live gauges (in flight, health) of workers that are gone, however they went
    (a crash or SIGKILL included), so they stop counting; their counters keep counting."""
    dead = []
    for name in os.listdir(path):
        match = _LIVE_FILE.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid in dead or _alive(pid):
            continue
        dead.append(pid)
        mark_process_dead(pid, path)
    return dead


_LIVE_FILE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True, slots=True)
class Row:
    """One metric: what `Metrics` calls it, its kind, name, help and labels; a histogram's
    buckets; a gauge's multiprocess mode (how workers' values merge)."""

    attr: str
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    mode: Literal["livesum", "livemin", "livemax"] | None = None

    def build(self, reg: CollectorRegistry) -> Counter | Gauge | Histogram:
        if self.kind is Histogram:
            assert self.buckets is not None, self.name
            return Histogram(self.name, self.doc, self.labels, buckets=self.buckets, registry=reg)
        if self.kind is Gauge:
            assert self.mode is not None, self.name
            return Gauge(
                self.name, self.doc, self.labels, multiprocess_mode=self.mode, registry=reg
            )
        return Counter(self.name, self.doc, self.labels, registry=reg)


# Every metric: one row each (attribute, kind, name, help, labels, buckets or multiprocess
# mode). `Metrics.__init__` builds them on its own registry; a test checks rows and attributes.
ROWS: tuple[Row, ...] = (
    Row(
        "requests",
        Counter,
        "sluicegate_requests_total",
        "Requests answered, by public model, the backend that answered last, and status.",
        ("model", "backend", "status"),
    ),
    Row(
        "duration",
        Histogram,
        "sluicegate_request_duration_seconds",
        "Whole request time, arrival to last byte (or disconnect), by status class.",
        ("model", "backend", "status_class"),
        buckets=LATENCY_BUCKETS,
    ),
    Row(
        "ttft",
        Histogram,
        "sluicegate_time_to_first_token_seconds",
        "Streams only: arrival to the first body byte from the backend (see "
        "sluicegate_ttft_seconds for the first content token); `path`: disaggregated "
        "(after a prefill engine) or direct.",
        ("model", "backend", "path"),
        buckets=LATENCY_BUCKETS,
    ),
    Row(
        "ttft_content",
        Histogram,
        "sluicegate_ttft_seconds",
        "Streams only: arrival to the first event carrying content the client receives "
        "(not the role-only first event); `path`: disaggregated (after a prefill engine) "
        "or direct.",
        ("model", "backend", "path"),
        buckets=TTFT_BUCKETS,
    ),
    Row(
        "tpot",
        Histogram,
        "sluicegate_tpot_seconds",
        "Streams only: time per output token after the first (one observation a request).",
        ("model", "backend"),
        buckets=TPOT_BUCKETS,
    ),
    Row(
        "bytes_out",
        Counter,
        "sluicegate_response_bytes_total",
        "Response body bytes relayed from backends to clients.",
        ("model", "backend"),
    ),
    Row(
        "disconnects",
        Counter,
        "sluicegate_client_disconnects_total",
        "Requests whose client left before the answer ended (upstream cancelled).",
        ("model", "backend"),
    ),
    Row(
        "retries",
        Counter,
        "sluicegate_retries_total",
        "Extra attempts made on another backend after a failure before the first byte.",
        ("model",),
    ),
    Row(
        "lora_loads",
        Counter,
        "sluicegate_lora_loads_total",
        "LoRA adapter loads and unloads the router asked engines for, by result: loaded, "
        "failed, unloaded, unload_failed (adapters come only from lora.sources).",
        ("backend", "adapter", "result"),
    ),
    Row(
        "attempts",
        Counter,
        "sluicegate_upstream_attempts_total",
        "Attempts sent to each backend (the denominator of its error rate).",
        ("backend",),
    ),
    Row(
        "upstream_errors",
        Counter,
        "sluicegate_upstream_errors_total",
        "Failed attempts by backend and kind: connect, timeout, status (5xx/429), mid_stream.",
        ("backend", "kind"),
    ),
    Row(
        "migrations",
        Counter,
        "sluicegate_migrations_total",
        "Generations whose engine died mid-answer, by outcome: ok (went on on another "
        "backend), failed (none took it), limit (max_migrations reached), budget (the retry "
        "budget refused it), refused (the request may not migrate).",
        ("model", "result"),
    ),
    Row(
        "fallbacks",
        Counter,
        "sluicegate_fallbacks_total",
        "Requests that went on to a fallback model (docs/fallbacks.md), by the model they "
        "left, the model they went to, and why: error, context_window, content_policy, "
        "mid_stream.",
        ("model", "to", "reason"),
    ),
    Row(
        "disaggregated",
        Counter,
        "sluicegate_disaggregated_requests_total",
        "Requests of models with prefill and decode backends, by what was done: "
        "disaggregated (a prefill engine first), short, cached (served whole: too little "
        "of the prompt to compute), no_prefill (none could take it), prefill_refused (it "
        "answered 4xx), client_params, failed (split, and no answer).",
        ("model", "result"),
    ),
    Row(
        "prefill_seconds",
        Histogram,
        "sluicegate_prefill_seconds",
        "Prefill leg of a disaggregated request: sent to the prefill engine until its "
        "answer (NIXL), or until its answer to the bootstrap copy (SGLang).",
        ("backend",),
        buckets=TTFT_BUCKETS,
    ),
    Row(
        "batch_jobs",
        Gauge,
        "sluicegate_batch_jobs",
        "Batch jobs not yet ended, by status, as Redis holds them (every replica's).",
        ("status",),
        mode="livemax",
    ),
    Row(
        "batch_lines",
        Counter,
        "sluicegate_batch_lines_total",
        "Batch lines this process ended, by outcome: `completed` (2xx), `failed`, `duplicate` "
        "(ran again after its lease ended; written and charged once), `retried` (handed back: "
        "429 or 503), `preempted` (cancelled for a waiting interactive request: wasted work, "
        "run again).",
        ("outcome",),
    ),
    Row(
        "batch_inflight",
        Gauge,
        "sluicegate_batch_inflight",
        "Batch lines in flight from this router (summed over live workers).",
        mode="livesum",
    ),
    Row(
        "batch_yields",
        Counter,
        "sluicegate_batch_yields_total",
        "Runner ticks that started no line of a running job because requests waited in "
        "admission's queue (batch work yielding to interactive work).",
    ),
    Row(
        "in_flight",
        Gauge,
        "sluicegate_backend_in_flight",
        "Requests in flight to each backend from this router (summed over live workers).",
        ("backend",),
        mode="livesum",
    ),
    Row(
        "healthy",
        Gauge,
        "sluicegate_backend_healthy",
        "1 when the backend takes traffic, 0 when ejected or failing probes "
        "(min over live workers).",
        ("backend",),
        mode="livemin",
    ),
    Row(
        "ejections",
        Counter,
        "sluicegate_backend_ejections_total",
        "Times a backend was taken out of rotation, by reason.",
        ("backend", "reason"),
    ),
    Row(
        "fallback",
        Gauge,
        "sluicegate_redis_fallback",
        "1 while the shared Redis store is unreachable and counts are kept in-process.",
        mode="livemax",
    ),
    Row(
        "routing_decisions",
        Counter,
        "sluicegate_routing_decisions_total",
        "Backends picked, by public model, balancer and reason (prefix, prefix_exact, "
        "prefix_approx, session, load, spill; each attempt counts once).",
        ("model", "balancer", "backend", "reason"),
    ),
    Row(
        "affinity_entries",
        Gauge,
        "sluicegate_affinity_index_entries",
        "(block, backend) pairs in the process's own prefix index (each worker keeps its "
        "own, also with Redis, where it is the fallback; summed).",
        mode="livesum",
    ),
    Row(
        "affinity_shared_entries",
        Gauge,
        "sluicegate_affinity_shared_entries",
        "(block, backend) pairs in the prefix index shared in Redis, for the backends this "
        "process last looked up or recorded.",
        mode="livemax",
    ),
    Row(
        "body_bytes_held",
        Gauge,
        "sluicegate_body_bytes_held",
        "Bytes of request bodies read and held by requests (max_held_body_bytes), each "
        "worker's as of its last /metrics answer, summed over live workers.",
        mode="livesum",
    ),
    Row(
        "affinity_fallbacks",
        Counter,
        "sluicegate_affinity_fallbacks_total",
        "Prefix lookups answered by the process's own index because the shared one (Redis) "
        "was down or slower than redis_timeout.",
    ),
    Row(
        "affinity_lookup_blocks",
        Counter,
        "sluicegate_affinity_lookup_blocks_total",
        "Prompt blocks looked up in the prefix index (cache_aware).",
    ),
    Row(
        "affinity_hit_blocks",
        Counter,
        "sluicegate_affinity_hit_blocks_total",
        "Looked-up prompt blocks that the picked backend held (hit rate: hit / lookup).",
    ),
    # KV-cache events (router/engine/kv_events.py): each worker subscribes on its own.
    Row(
        "kv_events_total",
        Counter,
        "sluicegate_kv_events_total",
        "KV-cache events received from each engine, by type (BlockStored, BlockRemoved, "
        "AllBlocksCleared, unknown).",
        ("backend", "type"),
    ),
    Row(
        "kv_index_blocks",
        Gauge,
        "sluicegate_kv_index_blocks",
        "Blocks the engine holds per its KV events, in this process's index.",
        ("backend",),
        mode="livemax",
    ),
    Row(
        "kv_event_lag",
        Gauge,
        "sluicegate_kv_event_lag_seconds",
        "Seconds between the engine building its last KV-event batch and this process "
        "receiving it (the engine's clock against ours).",
        ("backend",),
        mode="livemax",
    ),
    # Engine metrics as this process last read them (each worker scrapes on its own).
    Row(
        "engine_waiting",
        Gauge,
        "sluicegate_engine_waiting",
        "Requests waiting in the engine's queue, as last scraped.",
        ("backend",),
        mode="livemax",
    ),
    Row(
        "engine_running",
        Gauge,
        "sluicegate_engine_running",
        "Requests in the engine's running batch, as last scraped.",
        ("backend",),
        mode="livemax",
    ),
    Row(
        "engine_kv_usage",
        Gauge,
        "sluicegate_engine_kv_usage",
        "Share of the engine's KV cache in use (0..1), as last scraped.",
        ("backend",),
        mode="livemax",
    ),
    Row(
        "engine_scrape_age",
        Gauge,
        "sluicegate_engine_scrape_age_seconds",
        "Seconds since the engine's metrics were last read successfully.",
        ("backend",),
        mode="livemin",
    ),
    Row(
        "engine_inflight_tokens",
        Gauge,
        "sluicegate_engine_inflight_tokens",
        "This process's tokens in flight on the engine (`balancer: latency`): phase `prefill`, "
        "prompt tokens sent and not yet first-tokened (less the predicted cached part); "
        "`decode`, tokens still to come (max_tokens less those streamed).",
        ("backend", "phase"),
        mode="livesum",
    ),
    Row(
        "predicted_ttft",
        Histogram,
        "sluicegate_predicted_ttft_seconds",
        "TTFT `balancer: latency` predicted for the engine it picked, at each pick by a model.",
        ("model",),
        buckets=TTFT_BUCKETS,
    ),
    Row(
        "ttft_prediction_ratio",
        Histogram,
        "sluicegate_ttft_prediction_ratio",
        "Observed over predicted TTFT of streamed requests `balancer: latency` picked by a model.",
        (),
        buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0),
    ),
    Row(
        "slo_requests",
        Counter,
        "sluicegate_slo_requests_total",
        "Requests with a latency objective (x-slo-* headers or the key's), by kind (ttft, tpot), "
        "counted when observed.",
        ("kind",),
    ),
    Row(
        "slo_violations",
        Counter,
        "sluicegate_slo_violations_total",
        "Requests that missed their latency objective, by kind (ttft, tpot).",
        ("kind",),
    ),
    Row(
        "engine_scrape_errors",
        Counter,
        "sluicegate_engine_scrape_errors_total",
        "Failed scrapes of the engine's metrics (status, timeout, malformed or bad values).",
        ("backend",),
    ),
    Row(
        "discovery_backends",
        Gauge,
        "sluicegate_discovery_backends",
        "Backends discovered by each kind of source (kubernetes, inferencepool, dns), draining "
        "ones included.",
        ("source",),
        mode="livemax",
    ),
    Row(
        "discovery_events",
        Counter,
        "sluicegate_discovery_events_total",
        "Discovery events: added, removed, draining, ready, relist, expired (410), bookmark, "
        "watch_*, error, lookup_failed, models_failed, bad_port, bad_answer, bad_endpoint.",
        ("source", "event"),
    ),
    Row(
        "discovery_last_sync",
        Gauge,
        "sluicegate_discovery_last_sync_seconds",
        "Seconds since each kind of source last synced (list, watch event or answer); "
        "grows while the API server or DNS is unreachable. -1 before the first sync.",
        ("source",),
        mode="livemax",
    ),
    Row(
        "invalid_records",
        Counter,
        "sluicegate_registry_invalid_records_total",
        "Registry records (admin changes read back from the store) skipped as invalid.",
    ),
    Row(
        "log_dropped",
        Counter,
        "sluicegate_log_dropped_total",
        "Log lines dropped because the log writer fell behind (its queue was full).",
    ),
    # Scale from zero (router/request/admit/holding.py): declared models only.
    Row(
        "model_held",
        Gauge,
        "sluicegate_model_held_requests",
        "Requests held now because their declared model has no ready backend, by model.",
        ("model",),
        mode="livesum",
    ),
    Row(
        "model_demand",
        Gauge,
        "sluicegate_model_demand",
        "A declared model's demand: requests held, in flight and queued; with Redis summed over "
        "every replica (each worker shows the same sum), else this worker's, by model.",
        ("model",),
        mode="livemax",
    ),
    # Admission queue (router/request/admit/admission.py): only moves while requests queue.
    Row(
        "queue_depth_gauge",
        Gauge,
        "sluicegate_queue_depth",
        "Requests waiting in the admission queue for a backend slot, by model and priority.",
        ("model", "priority"),
        mode="livesum",
    ),
    Row(
        "queue_wait_seconds",
        Histogram,
        "sluicegate_queue_wait_seconds",
        "Time requests waited in the admission queue before a backend took them.",
        ("model", "priority"),
        buckets=LATENCY_BUCKETS,
    ),
    Row(
        "ratelimited_total",
        Counter,
        "sluicegate_ratelimited_total",
        "Requests refused with 429 by a client key's quota, by key name and limit "
        "(rpm, tpm, max_parallel).",
        ("key", "limit"),
    ),
    Row(
        "quota_degraded_gauge",
        Gauge,
        "sluicegate_quota_degraded",
        "1 while Redis is unreachable for quotas and each process enforces its share of "
        "every key's limits (limit / processes) on its own traffic.",
        mode="livemax",
    ),
    Row(
        "shed_total",
        Counter,
        "sluicegate_shed_total",
        "Requests refused by the admission queue: max_wait, deadline (the client's "
        "x-sluicegate-timeout), queue_full, or slo_unattainable (`balancer: latency`).",
        ("reason",),
    ),
    Row(
        "tokens_total",
        Counter,
        "sluicegate_tokens_total",
        "Tokens used by answered requests, by client key name, model and kind (prompt, "
        "completion, cached prompt tokens); estimated where the backend sent no usage.",
        ("key", "model", "kind"),
    ),
    Row(
        "usage_dropped",
        Counter,
        "sluicegate_usage_dropped_total",
        "Hourly usage buckets lost: over the in-memory cap, or kept past 8 days while Redis "
        "was unreachable.",
    ),
    Row(
        "background_runs",
        Counter,
        "sluicegate_background_runs_total",
        "Rounds of the background chores (heartbeats, registry sync, usage writer, scrapes, "
        "discovery, health_probes and health_tick, admission_deadlines and admission_recheck, "
        "kv_events_pump, kv_events_flush and kv_events_retry), by chore and result: ok, or "
        "error (an exception, logged once a streak).",
        ("task", "result"),
    ),
    # Hostile or broken input refused or cut (issue 22's hardening): counted, not logged
    # per request.
    Row(
        "loops_refused",
        Counter,
        "sluicegate_loops_refused_total",
        "Requests refused with 508 because they already carried this router's hop marker "
        "(a backend points back at the router) or passed too many routers.",
    ),
    Row(
        "tracing_headers_dropped",
        Counter,
        "sluicegate_tracing_headers_dropped_total",
        "Client traceparent / tracestate headers dropped for being over the W3C trace "
        "context limits (512 / 8192 characters); the request is served, in a new trace when "
        "its traceparent went.",
        ("header",),
    ),
)


class Metrics:
    """Every metric object, created once per app on a registry of its own (no module globals)."""

    requests: Counter
    duration: Histogram
    ttft: Histogram
    ttft_content: Histogram
    tpot: Histogram
    bytes_out: Counter
    disconnects: Counter
    retries: Counter
    lora_loads: Counter
    attempts: Counter
    upstream_errors: Counter
    migrations: Counter
    fallbacks: Counter
    disaggregated: Counter
    prefill_seconds: Histogram
    in_flight: Gauge
    healthy: Gauge
    ejections: Counter
    fallback: Gauge
    routing_decisions: Counter
    affinity_entries: Gauge
    affinity_shared_entries: Gauge
    body_bytes_held: Gauge
    affinity_fallbacks: Counter
    affinity_lookup_blocks: Counter
    affinity_hit_blocks: Counter
    kv_events_total: Counter
    kv_index_blocks: Gauge
    kv_event_lag: Gauge
    engine_waiting: Gauge
    engine_running: Gauge
    engine_kv_usage: Gauge
    engine_scrape_age: Gauge
    engine_scrape_errors: Counter
    engine_inflight_tokens: Gauge
    predicted_ttft: Histogram
    ttft_prediction_ratio: Histogram
    slo_requests: Counter
    slo_violations: Counter
    discovery_backends: Gauge
    discovery_events: Counter
    discovery_last_sync: Gauge
    invalid_records: Counter
    log_dropped: Counter
    model_held: Gauge
    model_demand: Gauge
    queue_depth_gauge: Gauge
    queue_wait_seconds: Histogram
    ratelimited_total: Counter
    quota_degraded_gauge: Gauge
    shed_total: Counter
    tokens_total: Counter
    usage_dropped: Counter
    background_runs: Counter
    loops_refused: Counter
    tracing_headers_dropped: Counter
    batch_jobs: Gauge
    batch_lines: Counter
    batch_inflight: Gauge
    batch_yields: Counter

    def __init__(self) -> None:
        reg = self.registry = CollectorRegistry(auto_describe=True)
        for row in ROWS:
            setattr(self, row.attr, row.build(reg))
        # The console's last two minutes (this process only), fed by the same calls as below.
        self.live = Live()
        self._multiproc = multiprocess_dir()
        self._kv_children: dict[tuple[str, str], Any] = {}
        self._token_backends: set[str] = set()  # backends with a token-load gauge set
        self._routed: dict[tuple[str, str, str, str], Any] = {}
        self._by_usage: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        # Label lookups take a lock and validate; resolve each combination once.
        self._by_request: dict[tuple[str, str, int], tuple[Any, ...]] = {}
        self._by_backend: dict[str, tuple[Any, Any]] = {}
        self._prefill_by: dict[str, Any] = {}
        self._split_by: dict[tuple[str, str, str, str], tuple[Any, Any, Any]] = {}

    # -- exposition ---------------------------------------------------------------------------

    def render(self) -> bytes:
        if self._multiproc is None:
            return generate_latest(self.registry)
        reap_dead_workers(self._multiproc)
        merged = CollectorRegistry()
        MultiProcessCollector(merged, self._multiproc)
        return generate_latest(merged)

    # -- per request (end of request; never per chunk) -----------------------------------------

    def observe(self, rec: RequestRecord) -> None:
        backend = rec.backend or NO_BACKEND
        status = rec.status or (499 if rec.disconnected else 500)
        key = (rec.model, backend, status)
        children = self._by_request.get(key)
        if children is None:
            labels = (rec.model, backend)
            children = self._by_request[key] = (
                self.requests.labels(rec.model, backend, str(status)),
                self.duration.labels(*labels, f"{status // 100}xx"),
                self.ttft.labels(*labels, "direct"),
                self.ttft_content.labels(*labels, "direct"),
                self.tpot.labels(*labels),
                self.bytes_out.labels(*labels),
                self.disconnects.labels(*labels),
                self.retries.labels(rec.model),
            )
        requests, duration, ttft, ttft_content, tpot, bytes_out, disconnects, retries = children
        if rec.pd is not None:
            ttft, ttft_content = self._split(rec, backend, status)
        requests.inc()
        duration.observe(time.perf_counter() - rec.started)
        if rec.stream and rec.ttfb_ms is not None:
            ttft.observe(rec.ttfb_ms / 1000)
        usage = rec.usage
        first: float | None = None
        if usage is not None and usage.first_token_at is not None:
            first = usage.first_token_at - rec.started
            ttft_content.observe(first)
            per_token = usage.time_per_output_token()
            if per_token is not None:
                tpot.observe(per_token)
        self.live.answered(backend, first)
        if rec.bytes_out:
            bytes_out.inc(rec.bytes_out)
        if rec.disconnected:
            disconnects.inc()
        if rec.attempts > 1:
            retries.inc(rec.attempts - 1)
        if rec.error in ("mid_stream", "timeout") and rec.backend:
            # Failures after the first byte; those before it went through attempt_failed().
            self.upstream_errors.labels(rec.backend, rec.error).inc()

    def background_run(self, task: str, ok: bool) -> None:
        self.background_runs.labels(task, "ok" if ok else "error").inc()

    def _split(self, rec: RequestRecord, backend: str, status: int) -> tuple[Any, Any]:
        """A split model's request: its decision counted; its TTFT children by path."""
        result = rec.pd or ""
        if result == "disaggregated" and not 200 <= status < 300:
            result = "failed"
        path = "disaggregated" if rec.prefill_backend is not None else "direct"
        key = (rec.model, backend, result, path)
        children = self._split_by.get(key)
        if children is None:
            if len(self._split_by) > 4096:  # models x backends x results: bounded anyway
                self._split_by.clear()
            children = self._split_by[key] = (
                self.disaggregated.labels(rec.model, result),
                self.ttft.labels(rec.model, backend, path),
                self.ttft_content.labels(rec.model, backend, path),
            )
        counted, ttft, ttft_content = children
        counted.inc()
        return ttft, ttft_content

    def prefilled(self, backend: str, seconds: float) -> None:
        child = self._prefill_by.get(backend)
        if child is None:
            child = self._prefill_by[backend] = self.prefill_seconds.labels(backend)
        child.observe(seconds)

    def loop_refused(self) -> None:
        self.loops_refused.inc()

    def tracing_header_dropped(self, header: str) -> None:
        self.tracing_headers_dropped.labels(header).inc()

    def scale_from_zero(self, held: dict[str, int], demand: dict[str, int]) -> None:
        """Each declared model's held requests and demand, as of this /metrics answer."""
        for model, n in held.items():
            self.model_held.labels(model).set(n)
        for model, n in demand.items():
            self.model_demand.labels(model).set(n)

    def queue_depth(self, model: str, priority: str, delta: int) -> None:
        self.queue_depth_gauge.labels(model, priority).inc(delta)
        self.live.queued(delta)

    def queue_wait(self, model: str, priority: str, seconds: float) -> None:
        self.queue_wait_seconds.labels(model, priority).observe(seconds)

    def shed(self, reason: str) -> None:
        self.shed_total.labels(reason).inc()

    def tokens(self, key: str, model: str, prompt: int, completion: int, cached: int) -> None:
        children = self._by_usage.get((key, model))
        if children is None:
            # Keys come from the config and models are validated against the registry, yet
            # both can grow at run time (a rotated key file, admin-added models): cap the series.
            room = len(self._by_usage) < MAX_USAGE_SERIES
            k, m = (key, model) if room else (OTHER, OTHER)
            children = (
                self.tokens_total.labels(k, m, "prompt"),
                self.tokens_total.labels(k, m, "completion"),
                self.tokens_total.labels(k, m, "cached"),
            )
            if room:
                self._by_usage[(key, model)] = children
        for child, n in zip(children, (prompt, completion, cached), strict=True):
            if n:
                child.inc(n)

    def ratelimited(self, key: str, limit: str) -> None:
        self.ratelimited_total.labels(key, limit).inc()

    def migrated(self, model: str, result: str) -> None:
        self.migrations.labels(model, result).inc()

    def fell_back(self, model: str, to: str, reason: str) -> None:
        self.fallbacks.labels(model, to, reason).inc()

    def attempt_failed(self, backend: str, kind: str) -> None:
        self.upstream_errors.labels(backend, kind).inc()

    def for_backend(self, name: str) -> tuple[Any, Any]:
        children = self._by_backend.get(name)
        if children is None:
            children = self._by_backend[name] = (
                self.in_flight.labels(name),
                self.attempts.labels(name),
            )
        return children

    def routed(self, model: str, balancer: str, backend: str, reason: str = "load") -> None:
        key = (model, balancer, backend, reason)
        child = self._routed.get(key)
        if child is None:
            child = self._routed[key] = self.routing_decisions.labels(*key)
        child.inc()
        self.live.routed(backend, reason)

    def affinity(self, lookup_blocks: int, hit_blocks: int, entries: int) -> None:
        """One cache-aware dispatch: blocks looked up, blocks the pick held, index size."""
        self.affinity_lookup_blocks.inc(lookup_blocks)
        if hit_blocks:
            self.affinity_hit_blocks.inc(hit_blocks)
        self.affinity_entries.set(entries)

    def engine_readings(self, readings: Mapping[str, EngineReading], now: float) -> None:
        """Move the engine gauges to the scraper's latest readings (called at each /metrics)."""
        for name, r in readings.items():
            self.engine_waiting.labels(name).set(r.waiting)
            self.engine_running.labels(name).set(r.running)
            self.engine_kv_usage.labels(name).set(r.kv_usage)
            age = now - r.scraped_at if r.scraped_at else float("inf")
            self.engine_scrape_age.labels(name).set(age)

    def kv_events(self, backend: str, kind: str, n: int) -> None:
        key = (backend, kind)
        child = self._kv_children.get(key)
        if child is None:
            if len(self._kv_children) > 4096:  # backends come and go
                self._kv_children.clear()
            child = self._kv_children[key] = self.kv_events_total.labels(backend, kind)
        child.inc(n)

    def kv_state(self, blocks: Mapping[str, int], lags: Mapping[str, float]) -> None:
        """Move the KV gauges to the subscriber's state (called at each /metrics)."""
        for name, n in blocks.items():
            self.kv_index_blocks.labels(name).set(n)
        for name, lag in lags.items():
            self.kv_event_lag.labels(name).set(lag)

    def lora_load(self, backend: str, adapter: str, result: str) -> None:
        self.lora_loads.labels(backend, adapter, result).inc()

    def token_load(self, prefill: Mapping[str, int], decode: Mapping[str, int]) -> None:
        """Move the token-load gauges (called at each /metrics); a backend with none is 0."""
        seen = self._token_backends
        for name in seen - prefill.keys() - decode.keys():
            self.engine_inflight_tokens.labels(name, "prefill").set(0)
            self.engine_inflight_tokens.labels(name, "decode").set(0)
        seen.clear()
        for name in {*prefill, *decode}:
            seen.add(name)
            self.engine_inflight_tokens.labels(name, "prefill").set(prefill.get(name, 0))
            self.engine_inflight_tokens.labels(name, "decode").set(decode.get(name, 0))

    def latency_observed(
        self,
        ttft: float,
        tpot: float | None,
        predicted: float | None,
        slo_ttft_ms: float | None,
        slo_tpot_ms: float | None,
    ) -> None:
        """A streamed request of `balancer: latency` reached its end: its SLOs, its prediction."""
        if predicted is not None and predicted > 0:
            self.ttft_prediction_ratio.observe(ttft / predicted)
        if slo_ttft_ms is not None:
            self.slo_requests.labels("ttft").inc()
            if ttft * 1000 > slo_ttft_ms:
                self.slo_violations.labels("ttft").inc()
        if slo_tpot_ms is not None and tpot is not None:
            self.slo_requests.labels("tpot").inc()
            if tpot * 1000 > slo_tpot_ms:
                self.slo_violations.labels("tpot").inc()

    def engine_scrape_failed(self, backend: str) -> None:
        self.engine_scrape_errors.labels(backend).inc()

    # -- state transitions (health, ejection, Redis) -------------------------------------------
    # The writers of that state log their own transitions; these only move the metrics.

    def health_changed(self, backend: str, healthy: bool, reason: str) -> None:
        """A backend became routable or not; turning unroutable counts as an ejection."""
        self.healthy.labels(backend).set(1 if healthy else 0)
        if not healthy:
            self.ejections.labels(backend, reason).inc()

    def ejected(self, backend: str, reason: str, seconds: float | None = None) -> None:
        """Passive ejection (outlier detection); health_changed(backend, True, ...) ends it."""
        self.healthy.labels(backend).set(0)
        self.ejections.labels(backend, reason).inc()

    def discovery_event(self, source: str, event: str, n: int = 1) -> None:
        self.discovery_events.labels(source, event).inc(n)

    def discovery_state(self, source: str, backends: int, age: float | None) -> None:
        self.discovery_backends.labels(source).set(backends)
        self.discovery_last_sync.labels(source).set(-1 if age is None else round(age, 3))

    def quota_degraded(self, active: bool) -> None:
        self.quota_degraded_gauge.set(1 if active else 0)

    def redis_fallback(self, active: bool) -> None:
        self.fallback.set(1 if active else 0)

    def backends_known(self, names: Sequence[str]) -> None:
        """Export every configured backend at 1 healthy / 0 in flight before any traffic."""
        for name in names:
            self.for_backend(name)
            self.healthy.labels(name).set(1)


class MeteredInflight:
    """An InflightStore that moves the in-flight gauge and attempt counter with each lease.

    Wraps any store (local or Redis) without changing it. The store itself is `inner`.
    """

    def __init__(self, store: InflightStore, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics
        self._degraded: bool | None = None

    def check_fallback(self) -> None:
        """Mirror a shared store's `degraded` flag (counting locally) into the fallback gauge."""
        degraded = self._store.degraded
        if degraded is not self._degraded:
            self._degraded = degraded
            self._metrics.redis_fallback(degraded)

    @property
    def kind(self) -> str:
        return self._store.kind

    @property
    def degraded(self) -> bool:
        return self._store.degraded

    async def start(self) -> None:
        await self._store.start()

    @property
    def inner(self) -> InflightStore:
        return self._store

    async def acquire(
        self,
        backends: Sequence[Backend],
        balancer: Balancer,
        ctx: PickContext = NO_CONTEXT,
        readings: Readings | None = None,
    ) -> Lease | None:
        lease = await self._store.acquire(backends, balancer, ctx, readings)
        self.check_fallback()
        if lease is not None:
            in_flight, attempts = self._metrics.for_backend(lease.backend)
            in_flight.inc()
            attempts.inc()
        return lease

    def release(self, lease: Lease) -> None:
        counted = not lease.released
        self._store.release(lease)
        if counted:
            self._metrics.for_backend(lease.backend)[0].dec()

    async def counts(self, names: Sequence[str]) -> dict[str, int]:
        return await self._store.counts(names)

    async def aclose(self) -> None:
        await self._store.aclose()
