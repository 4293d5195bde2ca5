"""Settings: environment (SLUICEGATE_*) over a YAML file over defaults.

    backends:
      - name: vllm-a
        url: http://vllm-a.models.svc:8000
        models: [meta-llama/Llama-3.1-8B-Instruct]     # or {public-name: backend-model-id}
    timeouts: {connect: 5, read: 120, write: 5, pool: 10}

`load_settings(path)` raises `ConfigError` with one line naming the file and the field.
"""

from __future__ import annotations

import contextvars
import fnmatch
import ipaddress
import os
import re
import ssl
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from router.core.engine import EngineReading
from router.core.tls import TlsError, context
from router.core.validation import check_header_name, check_header_value, check_url

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"


class ConfigError(Exception):
    """A configuration that cannot start the router; str() is the one-line message."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Timeouts(_Strict):
    connect: float = Field(5.0, gt=0)
    read: float = Field(120.0, gt=0)
    write: float = Field(5.0, gt=0)
    pool: float = Field(10.0, gt=0)


class PoolLimits(_Strict):
    """Per-backend connection pool size (one pool per backend)."""

    max_connections: int = Field(512, ge=1)
    max_keepalive: int = Field(128, ge=0)
    keepalive_expiry: float = Field(30.0, ge=0)


class ServerConfig(_Strict):
    """Client connections (per worker process)."""

    header_timeout: float = Field(10.0, gt=0)  # a request head must be complete within this
    # A request body must be complete this many seconds after its head, or 408 and close.
    body_timeout: float = Field(30.0, gt=0, le=3600)
    # An idle kept-alive connection is closed after this. Longer than the official SDKs' own
    # idle expiry (httpx's 5 s), so the client drops an idle connection first: at 5 s both ends
    # closed it at once, and a request sent on it as the router closed it failed with
    # "Connection error" (seen on a loaded machine). nginx keeps 75 s.
    keepalive_timeout: float = Field(75.0, gt=0)
    max_connections: int = Field(10_000, ge=1)  # past this, new connections get 503 and close


class HealthConfig(_Strict):
    interval: float = Field(5.0, gt=0)
    # While a backend is out of rotation (ejected or failing probes), probe it this often so a
    # restarted one is back within seconds (Envoy's unhealthy_interval).
    unhealthy_interval: float = Field(1.0, gt=0)
    timeout: float = Field(2.0, gt=0)
    unhealthy_threshold: int = Field(3, ge=1)
    healthy_threshold: int = Field(2, ge=1)
    path: str | None = None
    enabled: bool = True
    # The whole process's probe budget (global `health:` only; ignored per backend): probes
    # start at most this often across all backends, so a large discovered fleet costs a flat
    # amount and each backend's interval stretches instead (2,000 backends: every 10 s).
    max_probes_per_second: float = Field(200.0, gt=0, le=100_000)


class OutlierConfig(_Strict):
    consecutive_failures: int = Field(5, ge=1)
    base_ejection: float = Field(30.0, gt=0)
    max_ejection: float = Field(300.0, gt=0)
    max_ejection_percent: float = Field(50.0, ge=0, le=100)


class RetryConfig(_Strict):
    attempts: int = Field(3, ge=1, le=10)
    budget_percent: float = Field(20.0, ge=0, le=100)
    min_retries: int = Field(3, ge=0)
    deadline: float = Field(30.0, gt=0)


class MigrationRule(_Strict):
    """Whether a generation whose engine dies mid-stream goes on on another backend
    (router/request/migration/policy.py). `enabled` unset: on, except from or to `kind: openai`
    backends (a client may expect a provider's output to come from that provider alone)."""

    enabled: bool | None = None
    max_migrations: int = Field(2, ge=1, le=10)


class MigrationConfig(MigrationRule):
    """The global rule, and per public model name a rule that replaces it for that model."""

    models: dict[str, MigrationRule] = Field(default_factory=dict)

    def rule(self, model: str) -> MigrationRule:
        return self.models.get(model, self)


class DisaggregationConfig(_Strict):
    """How a model with prefill and decode backends splits a request
    (router/request/placement/pd.py):
    `nixl`: vLLM's NixlConnector handoff (prefill first, then decode with its
    `kv_transfer_params`); `sglang`: SGLang's bootstrap (both at once, one `bootstrap_room`)."""

    # `nixl`: vLLM's NixlConnector handoff; `sglang`: SGLang's bootstrap.
    connector: Literal["nixl", "sglang"] = "nixl"
    # A prompt is split only when at least this many of its tokens are not already cached on
    # the decode engine chosen for it; shorter ones are served whole there.
    min_uncached_tokens: int = Field(512, ge=0, le=1 << 24)
    # Client keys (by `name`) whose own `kv_transfer_params` (and SGLang's `bootstrap_host`,
    # `bootstrap_port`, `bootstrap_room`) reach the engines as sent. Every other client's are
    # removed: a decode engine connects to the host they name and asks it for KV blocks.
    trusted_keys: list[str] = Field(default_factory=list, max_length=1000)


class TracingConfig(_Strict):
    """OpenTelemetry export; off unless an endpoint is set here or in OTEL_EXPORTER_OTLP_*.
    Unset keys fall back to OTEL_SERVICE_NAME / OTEL_TRACES_SAMPLER_ARG, then the defaults
    (`sluicegate`, 1.0)."""

    otlp_endpoint: str | None = None  # OTLP/HTTP base (http://collector:4318) or .../v1/traces
    sample_ratio: float | None = Field(None, ge=0, le=1)
    service_name: str | None = Field(None, min_length=1, max_length=200)

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_endpoint(cls, v: str | None) -> str | None:
        parsed = urlsplit(v) if v is not None else None
        if parsed is not None and (parsed.scheme not in ("http", "https") or not parsed.hostname):
            raise ValueError("must be an http:// or https:// URL with a host")
        return v


class KvEventsConfig(_Strict):
    """Where a vLLM engine publishes its KV-cache events (router/engine/kv_events.py).

    `endpoint` is the engine's own `--kv-events-config` endpoint, and vLLM's own rule decides:
    where vLLM binds (a `*` or `::` wildcard, `tcp://*:P`, or `ipc://...`) the router connects
    (to the backend's host in place of the wildcard, or the same ipc path); where vLLM connects
    (any host named, `tcp://0.0.0.0:P` included) the router binds it. `bind` overrides that
    choice, also for endpoints learned from the engine: without `endpoint` the router asks the
    engine's `GET /kv_event_sources` (one publisher per data-parallel rank), and retries until
    it answers.
    """

    endpoint: str | None = Field(None, pattern=r"^(tcp://\S+:\d{1,5}|ipc://\S+)$")
    topic: str = Field("", max_length=256)
    replay_endpoint: str | None = Field(None, pattern=r"^(tcp://\S+:\d{1,5}|ipc://\S+)$")
    bind: bool | None = None


class TlsConfig(_Strict):
    """How the router's connections to an https backend are secured: traffic, health probes
    and engine scrapes alike (router/core/tls.py). The files are read when the backend is
    built (startup, an admin call, a discovery template); a file that cannot be read or parsed
    fails that with the field named."""

    # PEM file of the CA(s) that signed the backend's certificate; it replaces the system trust
    # store for this backend (null: the system store).
    ca_file: str | None = Field(None, min_length=1)
    # PEM client certificate for backends that require one (mTLS); may hold the key too.
    cert_file: str | None = Field(None, min_length=1)
    # PEM private key of `cert_file`, when it is a file of its own (not encrypted).
    key_file: str | None = Field(None, min_length=1)
    # false: the backend's certificate is not checked at all (encryption without
    # authentication: for tests and trusted networks only).
    verify: bool = True
    # The name sent as SNI and checked against the certificate instead of the URL's host (a
    # backend addressed by IP, or a certificate issued to its service name).
    server_name: str | None = Field(
        None,
        max_length=253,
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$",
    )

    @model_validator(mode="after")
    def _loads(self) -> TlsConfig:
        if self.key_file is not None and self.cert_file is None:
            raise ValueError("key_file: needs cert_file")
        if not self.verify and self.ca_file is not None:
            raise ValueError("ca_file: has no effect with verify: false (drop one)")
        try:
            self.context()
        except TlsError as exc:
            raise ValueError(str(exc)) from None
        return self

    def context(self) -> ssl.SSLContext:
        """The shared `ssl.SSLContext` of this policy; raises TlsError (router/core/tls.py)."""
        return context(self.ca_file, self.cert_file, self.key_file, self.verify)


class BackendConfig(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    url: str
    kind: Literal["vllm", "sglang", "openai", "anthropic"] = "vllm"
    # Where the engine's Prometheus text is (vllm, sglang); null or "": not scraped (Helm drops a
    # null from values, so "" is the way to say "off" there). Never scraped for openai.
    metrics_path: str | None = Field("/metrics", pattern=r"^/[^\s?#]*$")
    models: dict[str, str]
    api_key_env: str | None = None
    api_key: SecretStr | None = None
    key_header: str = "Authorization"
    headers: dict[str, str] = Field(default_factory=dict)
    query: dict[str, str] = Field(default_factory=dict)
    weight: float = Field(1.0, gt=0, le=1000)
    max_inflight: int | None = Field(None, ge=1)
    health: HealthConfig | None = None
    outlier: OutlierConfig | None = None
    kv_events: KvEventsConfig | None = None  # vLLM only: precise prefix-cache routing
    tls: TlsConfig | None = None  # https backends: CA, client certificate, verify, SNI name
    # Prefill/decode disaggregation (docs/disaggregation.md): a `prefill` engine only prefills
    # the long prompts of its model's requests, a `decode` engine takes them after the handoff
    # and serves short ones whole, `both` does either.
    role: Literal["prefill", "decode", "both"] = "both"
    # SGLang's bootstrap server on a prefill engine (`--disaggregation-bootstrap-port`).
    bootstrap_port: int = Field(8998, ge=1, le=65535)

    @field_validator("models", mode="before")
    @classmethod
    def _models_list_or_map(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            return {str(m): str(m) for m in v}
        return v

    @field_validator("models")
    @classmethod
    def _models_not_empty(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("must name at least one model")
        for public, target in v.items():
            if not public or not target:
                raise ValueError("model names must be non-empty")
        return v

    @field_validator("metrics_path", mode="before")
    @classmethod
    def _empty_path_is_off(cls, v: Any) -> Any:
        return None if v == "" else v

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return check_url(v).rstrip("/")

    @field_validator("headers")
    @classmethod
    def _wire_headers(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            check_header_name(name)
            try:
                check_header_value(value)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return v

    @field_validator("api_key_env")
    @classmethod
    def _env_key_on_the_wire(cls, v: str | None) -> str | None:
        # Checked where it is read: at startup, on an admin call, and on every replica that
        # builds the backend from a shared record.
        if v and (key := os.environ.get(v)):
            check_header_value(key)
        return v

    @field_validator("key_header")
    @classmethod
    def _key_header_token(cls, v: str) -> str:
        return check_header_name(v)

    @field_validator("api_key")
    @classmethod
    def _key_on_the_wire(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            check_header_value(v.get_secret_value())
        return v

    @model_validator(mode="after")
    def _key_source(self) -> BackendConfig:
        if self.api_key is not None and self.api_key_env:
            raise ValueError("give api_key or api_key_env, not both")
        return self

    def resolved_key(self) -> str | None:
        """The backend's key: the value given, or the named variable's value at startup.
        Raises ValueError when the variable holds what a header cannot carry."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env:
            # Read at run time, so checked here too: a variable can differ between replicas.
            key = os.environ.get(self.api_key_env) or None
            return check_header_value(key) if key is not None else None
        return None


class EngineMetricsConfig(_Strict):
    """Scraping of each engine's /metrics for `least_load` (seconds)."""

    interval: float = Field(0.25, ge=0.01, le=60)
    timeout: float = Field(1.0, gt=0, le=60)
    stale_after: float = Field(1.0, gt=0, le=3600)
    # The most KV capacity an engine's report is believed up to (tokens, 8 Mi): it sizes the
    # engine's share of the prefix index (router/engine/parse.py).
    max_kv_tokens: int = Field(8 * 1024 * 1024, ge=1, le=1 << 34)
    # A page past this is refused unread (a vLLM's is ~56 KB): every byte is read each interval.
    max_page_bytes: int = Field(1024 * 1024, ge=4096, le=64 * 1024 * 1024)
    # The scrape budget: at most this many scrapes a second across all engines, taken in turn;
    # past `max_scrapes_per_second * interval` engines each one's reading refreshes less often
    # (and counts as stale only after three of its turns), so background cost stays flat.
    max_scrapes_per_second: float = Field(1000.0, gt=0, le=100_000)


class LoraConfig(_Strict):
    """LoRA adapters (router/engine/lora_loads.py): the adapters each engine serves are read from
    its `/v1/models` every `refresh` seconds; with `load_on_demand`, an adapter in `sources`
    (adapter name -> the path the engine loads it from) that no healthy engine serves is loaded
    on the engine with the most room (vLLM's `/v1/load_lora_adapter`, which needs
    `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` on the engine), and what the router loaded is
    unloaded after `idle_unload` seconds unused."""

    # Load an adapter of `sources` that no healthy engine serves on the engine with the most room.
    load_on_demand: bool = False
    sources: dict[str, str] = Field(default_factory=dict)  # adapter name -> path on the engine
    # Seconds without a request in flight after which an adapter the router loaded is unloaded.
    idle_unload: float = Field(600.0, gt=0, le=7 * 86400)
    refresh: float = Field(5.0, ge=0.05, le=3600)  # seconds between reads of /v1/models
    # The public model the `sources` adapters were trained for (None: any engine with LoRA on).
    base_model: str | None = None
    load_timeout: float = Field(60.0, gt=0, le=3600)  # one load, and a request's wait for it
    # After a failed load, that engine is not tried again for that adapter for this long.
    failure_cooldown: float = Field(30.0, ge=0, le=3600)

    @field_validator("sources")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        for name, path in v.items():
            if not re.match(r"^[\x21-\x7e]{1,256}$", name):
                raise ValueError(f"adapter name {name!r} must be 1-256 visible ASCII characters")
            if not path:
                raise ValueError(f"adapter {name!r}: the path is empty")
        if len(v) > 1024:
            raise ValueError("at most 1024 adapters")
        return v


class TokenizerConfig(_Strict):
    """How the router gets a request's token ids for the KV-event index
    (router/request/placement/tokens.py):
    `router`: `tokenizer.json` + the chat template of `tokenizer_config.json` in `path` (a local
    directory, or a hub id already in the local cache); `engine`: the backend's own `/tokenize`,
    once per chat until its earlier messages are known (router/request/placement/token_memo.py)."""

    via: Literal["router", "engine"] = "router"
    path: str | None = None

    @model_validator(mode="after")
    def _path_for_router(self) -> TokenizerConfig:
        if self.via == "router" and not self.path:
            raise ValueError("via: router needs `path` (the model's tokenizer directory)")
        return self


class ResponseIdsConfig(_Strict):
    """Where stored Responses live: response id -> the backend that holds it (the engine keeps
    the response and its conversation in its own memory). With Redis the map is shared by every
    replica; without it, each process keeps its own."""

    ttl: float = Field(86400.0, ge=1, le=30 * 86400)  # seconds after its last use an id is kept
    max_local: int = Field(100_000, ge=1, le=10_000_000)  # ids this process keeps itself
    # Stored responses one client key keeps (all of them, with no client keys configured); past
    # it the key's oldest id is forgotten, here and in Redis (one Redis key each otherwise).
    max_per_key: int = Field(10_000, ge=1, le=10_000_000)


class AffinityConfig(_Strict):
    """Cache-aware routing (`balancer: cache_aware`): the prompt's prefix index and its bounds."""

    block_chars: int = Field(256, ge=16, le=65536)  # characters per hashed block (~64 tokens)
    max_prefix_chars: int = Field(128 * 1024, ge=0, le=16 * 1024 * 1024)  # hash at most this
    # Per backend KV capacity when its engine does not report vllm:cache_config_info.
    capacity_tokens: int = Field(131072, ge=1, le=1 << 31)
    # A session's home above this times the mean load (counting the new request) is passed over
    # for the next on the ring; a prefix holder above it, once its engine queues, for the least
    # loaded backend, which then joins the holders.
    load_factor: float = Field(1.25, ge=1.0, le=100.0)
    # Session affinity: the first of these headers present names the session (then the body's
    # prompt_cache_key, then user).
    # Coding agents' own: Claude Code's, Codex's, OpenCode's, then the generic one.
    session_headers: list[str] = Field(
        default_factory=lambda: [
            "x-claude-code-session-id",
            "session-id",
            "x-session-affinity",
            "x-session-id",
        ],
        max_length=16,
    )
    # `balancer: latency`: an echoed x-session-token's engine is kept unless its predicted TTFT
    # is worse than the best by more than this (milliseconds).
    session_break_ms: float = Field(200.0, ge=0, le=3_600_000)
    # The HMAC key of x-session-token (router/request/placement/session_token.py); replicas that
    # share it read each other's tokens. Unset: a random key per process.
    session_token_key: SecretStr | None = None
    # With Redis: seconds after its last use a block leaves the shared index (and a backend's
    # key after its last record), so a gone fleet leaves nothing. Capacity, not this, bounds it.
    ttl: float = Field(3600.0, ge=1, le=7 * 86400)
    # Public model name -> how to tokenize its prompts, for backends with `kv_events`; a model
    # routed cache_aware whose backends publish events gets `via: engine` when not named here.
    tokenizers: dict[str, TokenizerConfig] = Field(default_factory=dict)
    # A prompt longer than this (characters) is tokenized in a worker thread, off the event loop.
    tokenize_inline_chars: int = Field(8192, ge=0, le=1 << 24)
    # Seconds at most a dispatch counts as pending on its backend when no KV event and no answer
    # followed it.
    pending_ttl: float = Field(2.0, gt=0, le=60)

    @field_validator("session_headers")
    @classmethod
    def _header_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}", name):
                raise ValueError(f"{name!r} is not a header name")
        return [name.lower() for name in v]


class LatencyConfig(_Strict):
    """`balancer: latency`'s learning (balancers/latency_model.py, router/request/placement/
    latency_feed.py): how often the models are refitted and how many samples make one."""

    refit_interval: float = Field(2.0, gt=0, le=3600)  # seconds between refits
    # Samples an engine needs for its own model (and the pool for the pooled one).
    min_samples: int = Field(24, ge=4, le=100_000)


class SaturationConfig(_Strict):
    """When an engine's own readings say it is full, even under its `max_inflight`."""

    waiting: float = Field(8, gt=0)  # requests in the engine's queue
    kv_usage: float = Field(0.95, gt=0, le=1)  # share of the KV cache in use


class AdmissionConfig(_Strict):
    """The admission queue (router/request/admit/admission.py); absent: a full fleet answers 503."""

    max_wait: float = Field(30.0, gt=0, le=3600)  # seconds a request may wait for a slot
    max_queue: int = Field(10000, ge=1, le=1_000_000)  # requests waiting, all models together
    # Bytes of request bodies waiting (per worker): past it the lowest entries are shed, as for
    # max_queue (a body bigger than all of it is refused rather than queued).
    max_queue_bytes: int = Field(256 * 1024 * 1024, ge=1024, le=1 << 40)
    saturation: SaturationConfig = SaturationConfig()
    # Token estimate of a request whose body gives neither max_tokens nor max_completion_tokens.
    default_max_tokens: int = Field(256, ge=1, le=1_000_000)
    # The longest sequence an engine holds (its --max-model-len): the prompt and completion
    # parts of an estimate are each clamped to it, also for quotas without admission.
    max_model_len: int = Field(131072, ge=16, le=1 << 24)
    # Seconds between re-checks while something waits: catches slots freed by other replicas
    # and workers (a local release or a new engine reading wakes the queue at once).
    recheck: float = Field(0.5, gt=0, le=60)


class ScaleFromZeroConfig(_Strict):
    """Models known while no backend serves them: their requests are held until a first backend
    is ready (router/request/admit/holding.py), and their demand drives KEDA (router/scaling/;
    docs/scale-from-zero.md). A discovery source's explicit `models:` are declared too."""

    # Public model names known even while no backend serves them (a pool scaled to zero).
    models: list[str] = Field(default_factory=list, max_length=10_000)
    # Longest a request waits for a first ready backend (seconds); the request's own
    # `x-sluicegate-timeout` may shorten it. Past it: 503 `no_backend` with Retry-After.
    hold_timeout_s: float = Field(120.0, gt=0, le=3600)
    # Requests held at once per model, in this process; past it: 503 at once with Retry-After.
    max_held: int = Field(1000, ge=1, le=1_000_000)
    # Port of the KEDA external scaler (gRPC, externalscaler.proto); 0: off.
    scaler_port: int = Field(0, ge=0, le=65535)
    # The demand one replica of a model's pool should take: GetMetricSpec's target.
    target_per_replica: int = Field(16, ge=1, le=1_000_000)
    # Seconds between `: waiting for a backend` comments on a held stream (its response head is
    # sent with the first), so that proxies and clients do not time it out.
    keepalive_s: float = Field(15.0, gt=0, le=600)

    @field_validator("models")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name or len(name) > 256:
                raise ValueError(f"{name[:40]!r}: a model name of 1-256 characters")
        return v


class BatchConfig(_Strict):
    """The Batch API (`/v1/files`, `/v1/batches`, docs/batch.md): jobs in Redis (required),
    files under `storage_dir`, lines run in the fleet's idle capacity in the `sheddable` band."""

    # Where uploaded files, job outputs and line offsets live: a volume every replica mounts
    # (a ReadWriteMany PVC on Kubernetes) so any replica can resume or finish any job.
    storage_dir: str = Field(min_length=1)
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1024, le=1 << 40)  # one upload
    max_lines: int = Field(50_000, ge=1, le=10_000_000)  # requests in one job's file
    max_jobs_per_key: int = Field(100, ge=1, le=100_000)  # jobs of one key not yet finished
    max_files_per_key: int = Field(1000, ge=1, le=1_000_000)  # files one key keeps
    # Seconds a replica's claim on a line lasts unless renewed (each tick): a line held by a
    # replica that died is taken again this long after its last renewal.
    lease_ttl: float = Field(60.0, gt=0, le=86400)
    tick: float = Field(0.25, ge=0.01, le=60)  # seconds between the runner's looks at the fleet
    per_engine: int = Field(4, ge=1, le=1024)  # lines in flight per engine that shows room
    max_inflight: int = Field(64, ge=1, le=100_000)  # lines in flight on this replica, at most
    # An engine has room for batch work with fewer than this many requests waiting...
    room_waiting: float = Field(1, gt=0)
    room_kv_usage: float = Field(0.8, gt=0, le=1)  # ...and less than this share of KV in use
    # Share of a key's tpm batch lines may use of what its interactive traffic left unused.
    tpm_share: float = Field(1.0, gt=0, le=1)
    # While interactive requests wait in admission's queue, each tick cancels as many of this
    # replica's youngest batch lines in flight; they are handed back and run again later.
    preempt: bool = False

    def room_in(self, reading: EngineReading | None) -> bool:
        """An engine may take batch work: its fresh reading shows fewer than `room_waiting`
        waiting and under `room_kv_usage` of its KV in use (no fresh reading counts as room:
        an engine that publishes none is judged by its in-flight limit alone)."""
        return (
            reading is None
            or reading.stale
            or (reading.waiting < self.room_waiting and reading.kv_usage < self.room_kv_usage)
        )


# Never backends unless an operator says so: cloud metadata services (AWS, GCP, Azure, OpenStack
# and others at 169.254.169.254; AWS over IPv6; Alibaba Cloud), link-local, and "this host" /
# unspecified addresses (0.0.0.0 reaches the router's own host and slips past an allow-list).
DEFAULT_DENIED_NETWORKS = (
    "169.254.0.0/16",
    "fe80::/10",
    "fd00:ec2::254/128",
    "100.100.100.200/32",
    "0.0.0.0/8",
    "::/128",
)


class AdminConfig(_Strict):
    """What backends added at run time (the admin API, discovery) may be: router/core/netpolicy.py.
    The YAML file's entries are the operator's own and are held to none of it."""

    # `api_key_env` given through the admin API must start with this ("": any name; SLUICEGATE_*
    # is refused whatever this says): the API must not send the router's other secrets out.
    api_key_env_prefix: str = Field("BACKEND_KEY_", pattern=r"^[A-Za-z0-9_]{0,64}$")
    # Backend addresses (the URL's host, and every address its name resolves to when a
    # connection opens) must be in one of these (empty: anywhere) and in none of the denied.
    allowed_backend_networks: list[str] = Field(default_factory=list, max_length=1024)
    denied_backend_networks: list[str] = Field(
        default_factory=lambda: list(DEFAULT_DENIED_NETWORKS), max_length=1024
    )
    # KV events of backends added at run time (router/engine/kv_endpoints.py): true lets the
    # admin API (and what such an engine's `GET /kv_event_sources` answers) have the router
    # bind a socket (a listener) or use an `ipc://` path (a file on its machine). Off: only
    # tcp endpoints the router connects to, in the networks above.
    kv_events_bind_and_ipc: bool = False

    @field_validator("allowed_backend_networks", "denied_backend_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"{net!r} is not an IP network (a.b.c.d/n or v6::/n)") from None
        return v


# Paths the console may not take: the router's own routes live there.
_CONSOLE_TAKEN = ("/v1", "/admin", "/metrics", "/healthz", "/readyz")


class PickerConfig(_Strict):
    """`sluicegate epp`, the endpoint picker behind a gateway's ext_proc filter
    (docs/endpoint-picker.md); `sluicegate serve` reads none of it."""

    # Endpoints after the picked one in `x-gateway-destination-endpoint`, for the gateway's
    # retries (an ordered, comma-separated list; not leased). 0: the one picked, which an
    # ORIGINAL_DST cluster needs (it reads one address); more needs Envoy's override_host policy.
    fallbacks: int = Field(0, ge=0, le=8)
    # `none`: the gateway's filter sends no response body (`response_body_mode: NONE`): less
    # CPU, but no TTFT, usage or stream end seen; the lease is given back when the gateway ends
    # the stream, after the response's headers (docs/endpoint-picker.md).
    response_body: Literal["streamed", "none"] = "streamed"


class ConsoleConfig(_Strict):
    """The web console (docs/console.md): one page that shows the fleet live, served by the
    router itself; its actions go through the admin API and need the admin token."""

    enabled: bool = False  # off unless asked for: the page shows topology
    # Path prefix of the page, its assets (`<path>/static/`) and its live view (`<path>/api/live`).
    path: str = Field("/console", pattern=r"^(/[A-Za-z0-9._~-]+)+$", max_length=100)
    refresh: float = Field(1.0, ge=0.5, le=60)  # seconds between the page's reads of live state

    @field_validator("path")
    @classmethod
    def _free_path(cls, v: str) -> str:
        for taken in _CONSOLE_TAKEN:
            if v == taken or v.startswith(taken + "/"):
                raise ValueError(f"{v!r} is under {taken}, one of the router's own routes")
        return v


class FallbackChain(_Strict):
    """The models a model's requests go to, in order, when it cannot serve them
    (router/request/placement/fallbacks.py, docs/fallbacks.md). Written as LiteLLM writes it, a
    plain list of model names, or as this mapping to set `mid_stream`."""

    # The fallback models, tried in this order (each a model some backend serves).
    models: list[str] = Field(min_length=1, max_length=16)
    # A stream whose engine died, that no engine of its own model can continue: `continue` on
    # the next model of the chain (from the text already sent), or `error` (an error event).
    mid_stream: Literal["continue", "error"] = "continue"

    @model_validator(mode="before")
    @classmethod
    def _bare_list(cls, v: Any) -> Any:
        return {"models": v} if isinstance(v, list | tuple | str) else v

    @field_validator("models", mode="before")
    @classmethod
    def _one_name(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v


def _fallback_map(v: Any) -> Any:
    """LiteLLM's list of one-entry mappings (`[{"llama-70b": ["gpt-4o-mini"]}]`) as one map."""
    if not isinstance(v, list | tuple):
        return v
    merged: dict[str, Any] = {}
    for entry in v:
        if not isinstance(entry, dict):
            raise ValueError("each entry must map a model to its fallback models")
        for model, chain in entry.items():
            if model in merged:
                raise ValueError(f"{model!r} is given twice")
            merged[model] = chain
    return merged


# The API formats a backend kind serves: OpenAI's (chat, completions, ...) and Anthropic's
# Messages. vLLM and SGLang serve both; a fallback never translates between them.
API_FORMATS: dict[str, tuple[str, ...]] = {
    "vllm": ("openai", "anthropic"),
    "sglang": ("openai", "anthropic"),
    "openai": ("openai",),
    "anthropic": ("anthropic",),
}
FallbackMap = Annotated[dict[str, FallbackChain], BeforeValidator(_fallback_map)]
FALLBACK_KEYS = ("fallbacks", "context_window_fallbacks", "content_policy_fallbacks")


def fallback_cycle(chains: dict[str, FallbackChain]) -> list[str] | None:
    """A cycle of the chains (`[a, b, a]`), or None."""
    done: set[str] = set()
    for start in chains:
        path: list[str] = []
        on_path: set[str] = set()
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            node, i = stack.pop()
            if i == 0:
                if node in on_path:
                    return [*path[path.index(node) :], node]
                if node in done:
                    continue
                path.append(node)
                on_path.add(node)
            targets = chains[node].models if node in chains else []
            if i < len(targets):
                stack.append((node, i + 1))
                stack.append((targets[i], 0))
            else:
                done.add(node)
                on_path.discard(node)
                path.pop()
    return None


_TEMPLATE_FIXED = ("name", "url", "models")
_PORT_NAME = r"^[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$"  # an IANA_SVC_NAME, as Kubernetes has it
_NAMESPACE = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"  # a DNS label


class _DiscoveryBase(_Strict):
    """What every discovery source shares: the backend template and how models are known."""

    # Discovered backends are named `<prefix>-<address>-<port>`; default prefix: the service,
    # the InferencePool's name, or the DNS name's first label.
    prefix: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,30}$")
    models: Literal["auto"] | dict[str, str] = "auto"
    # BackendConfig's fields but name, url and models, which discovery fills in per endpoint.
    backend: dict[str, Any] = Field(default_factory=dict)
    scheme: Literal["http", "https"] = "http"
    # At most this many backends from this source; the excess is refused, counted and shown.
    max_endpoints: int = Field(2000, ge=1, le=100_000)
    # models: auto only. The model ids an endpoint may claim: names or shell-style patterns
    # (`llama-*`, `qwen?-7b`); None: any id. Ids outside are refused, counted and logged.
    models_allow: list[str] | None = Field(None, min_length=1, max_length=256)
    # models: auto only. False: an endpoint never takes a model that a file or admin backend
    # serves (that id is refused for it); True: it joins that model's backends.
    shadow: bool = False

    @field_validator("models", mode="before")
    @classmethod
    def _models_list_or_map(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            v = {str(m): str(m) for m in v}
        if isinstance(v, dict) and not v:
            raise ValueError("must name at least one model, or be `auto`")
        return v

    @field_validator("backend")
    @classmethod
    def _template(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in _TEMPLATE_FIXED:
            if key in v:
                raise ValueError(f"{key}: set per endpoint by discovery; not allowed here")
        try:
            BackendConfig.model_validate(
                {**v, "name": "template", "url": "http://template.invalid", "models": ["m"]}
            )
        except ValidationError as exc:
            raise ValueError(describe_validation(exc, "")) from None
        return v

    @field_validator("models_allow")
    @classmethod
    def _allow_patterns(cls, v: list[str] | None) -> list[str] | None:
        for pattern in v or ():
            if not re.match(r"^[\x21-\x7e]{1,256}$", pattern):
                raise ValueError(f"{pattern!r}: a model id or pattern of visible characters")
        return v

    @model_validator(mode="after")
    def _auto_only(self) -> _DiscoveryBase:
        if self.models != "auto" and (self.models_allow is not None or self.shadow):
            raise ValueError("models_allow and shadow apply to `models: auto` only")
        return self

    def model_allowed(self, model: str) -> bool:
        if self.models_allow is None:
            return True
        return any(fnmatch.fnmatchcase(model, p) for p in self.models_allow)

    def backend_config(self, name: str, url: str, models: dict[str, str]) -> BackendConfig:
        data = {**self.backend, "name": name, "url": url, "models": models}
        return BackendConfig.model_validate(data)


class KubernetesWatch(_DiscoveryBase):
    """What every source that lists and watches the Kubernetes API shares: the client's config
    and the watch's timings (router/discovery/watch.py)."""

    resync: float = Field(300.0, gt=0, le=86400)
    # Seconds to wait while the API server is unreachable before trying again (doubles, capped).
    backoff_max: float = Field(30.0, gt=0, le=600)
    # Seconds without a watch event or bookmark (the API server sends one about every minute)
    # after which the watch counts as hung: it is restarted and the source shows stale.
    watch_idle_timeout: float = Field(60.0, gt=0, le=3600)
    kubeconfig: str | None = None  # default: in-cluster service account, else KUBECONFIG
    # A label naming its endpoints' `role` (prefill, decode, both): llm-d's. Read on the
    # EndpointSlice (kind kubernetes) or on the pod (kind inferencepool).
    role_label: str = Field("llm-d.ai/role", pattern=r"^[A-Za-z0-9./_-]{1,316}$")


class KubernetesDiscovery(KubernetesWatch):
    """EndpointSlices of one Service (or a label selector) in one namespace."""

    kind: Literal["kubernetes"]
    namespace: str = Field(pattern=_NAMESPACE)
    service: str | None = Field(None, pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
    label_selector: str | None = Field(None, min_length=1)
    port: int | str = Field(description="the EndpointSlice port's name or number")

    @field_validator("port")
    @classmethod
    def _port(cls, v: int | str) -> int | str:
        if isinstance(v, int):
            if not 1 <= v <= 65535:
                raise ValueError("a port number must be 1-65535")
        elif not re.match(_PORT_NAME, v):
            raise ValueError("a port name must be a lowercase DNS label of up to 15 characters")
        return v

    @model_validator(mode="after")
    def _selects_something(self) -> KubernetesDiscovery:
        if not self.service and not self.label_selector:
            raise ValueError("give `service` or `label_selector` to select EndpointSlices")
        if self.service and self.label_selector:
            raise ValueError("give `service` or `label_selector`, not both")
        return self

    @property
    def selector(self) -> str:
        return self.label_selector or f"kubernetes.io/service-name={self.service}"

    @property
    def names_prefix(self) -> str:
        return self.prefix or self.service or self.namespace


class InferencePoolDiscovery(KubernetesWatch):
    """The pods an InferencePool (`inference.networking.k8s.io/v1`, the Gateway API Inference
    Extension) selects: each target port of each ready pod is one backend `podIP:port`."""

    kind: Literal["inferencepool"]
    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
    namespace: str = Field(pattern=_NAMESPACE)

    @property
    def names_prefix(self) -> str:
        return self.prefix or self.name


class DnsDiscovery(_DiscoveryBase):
    """A name's A/AAAA records (a headless Service, or any name)."""

    kind: Literal["dns"]
    name: str = Field(pattern=r"^[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})$")
    port: int = Field(ge=1, le=65535)
    interval: float = Field(5.0, gt=0, le=3600)
    timeout: float = Field(2.0, gt=0, le=60)
    nameserver: str | None = Field(None, pattern=r"^[0-9A-Fa-f.:\[\]]+(:[0-9]{1,5})?$")

    @property
    def names_prefix(self) -> str:
        return self.prefix or self.name.split(".")[0]


DiscoverySource = Annotated[
    KubernetesDiscovery | InferencePoolDiscovery | DnsDiscovery, Field(discriminator="kind")
]


class ClientKeyConfig(_Strict):
    """A client key by its sha256 (hex), optionally limited to some public model names."""

    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")
    name: str | None = None
    models: list[str] | None = None  # None: every model
    # Admission (only with `admission:` set): the key's band and its share within the band.
    priority: Literal["critical", "standard", "sheddable"] = "standard"
    weight: float = Field(1.0, gt=0, le=1000)
    # Quotas (router/request/admit/quota.py; shared through Redis: quota_shared.py); None: no limit.
    rpm: int | None = Field(None, ge=1, le=10_000_000)  # requests per minute
    tpm: int | None = Field(None, ge=1, le=10_000_000_000)  # prompt + completion tokens / minute
    max_parallel: int | None = Field(None, ge=1, le=1_000_000)  # requests in flight at once
    # False: the key's requests never go to a fallback model (docs/fallbacks.md).
    fallbacks: bool = True
    # Time-to-first-token objective (ms) of the key's requests without x-slo-ttft-ms
    # (`balancer: latency`).
    slo_ttft_ms: float | None = Field(None, gt=0, le=3_600_000)
    # Time-per-output-token objective (ms) of the key's requests without x-slo-tpot-ms.
    slo_tpot_ms: float | None = Field(None, gt=0, le=3_600_000)

    @model_validator(mode="before")
    @classmethod
    def _bare_hash(cls, v: Any) -> Any:
        return {"sha256": v} if isinstance(v, str) else v

    @field_validator("sha256")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.lower()


def read_api_keys_file(path: str | Path) -> list[Any]:
    """Entries of a client-key file (YAML or JSON: a list, or a mapping with `api_keys:`), as
    mounted from a Secret. Error messages name the file, never its content."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"api_keys_file {p}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError:
        raise ValueError(f"api_keys_file {p}: not valid YAML or JSON") from None
    if isinstance(data, dict):
        data = data.get("api_keys")
    if data is None:
        return []
    if not isinstance(data, list):
        raise ValueError(f"api_keys_file {p}: must be a list of keys or `api_keys: [...]`")
    return data


_FILE_DATA: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "sluicegate_file_data", default=None
)


class _FileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_DATA.get() or {})


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICEGATE_", extra="forbid", frozen=True)

    config: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=64)
    redis_url: SecretStr | None = None
    # Shared in-flight counts: give up on Redis after this long (then count locally); a dead
    # replica's leases stop counting this long after its last heartbeat.
    redis_timeout: float = Field(0.05, gt=0, le=5)
    redis_lease_ttl: float = Field(10.0, ge=1, le=3600)
    redis_prefix: str = Field("sluicegate", pattern=r"^[A-Za-z0-9._:-]{1,64}$")
    # Redis that survives a node loss (router/core/redis_client.py): Sentinel finds the master
    # (credentials, TLS and db still come from redis_url when set), or Cluster seeded by redis_url.
    redis_sentinels: list[str] = Field(default_factory=list)
    redis_sentinel_master: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    redis_sentinel_password: SecretStr | None = None
    redis_cluster: bool = False
    admin_token: SecretStr | None = None
    admin: AdminConfig = AdminConfig()
    # The web console at `console.path` (docs/console.md); off unless `enabled: true`.
    console: ConsoleConfig = ConsoleConfig()
    picker: PickerConfig = PickerConfig()  # `sluicegate epp` only (docs/endpoint-picker.md)
    # Stamped on every upstream request (`x-sluicegate-hop`, router/request/admit/hops.py) so a
    # backend that points back at this router is refused, not looped. One per `serve` (its workers
    # share it) unless set; replicas given the same id catch a loop through their Service at once.
    deployment_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    backends: list[BackendConfig] = Field(default_factory=list)
    balancer: str = "least_inflight"
    model_balancers: dict[str, str] = Field(default_factory=dict)
    # Applies to every model with both prefill and decode backends (`role`).
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    # Per public model name: its own rule, or null for none (its prefill engines then idle).
    model_disaggregation: dict[str, DisaggregationConfig | None] = Field(default_factory=dict)
    timeouts: Timeouts = Timeouts()
    limits: PoolLimits = PoolLimits()
    server: ServerConfig = ServerConfig()
    health: HealthConfig = HealthConfig()
    outlier: OutlierConfig = OutlierConfig()
    retries: RetryConfig = RetryConfig()
    migration: MigrationConfig = MigrationConfig()
    # `balancer: latency`: how its TTFT models learn (docs/balancers.md#latency).
    latency: LatencyConfig = LatencyConfig()
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # multipart/form-data bodies (audio uploads): OpenAI's own limit is 25 MB
    max_upload_bytes: int = Field(25 * 1024 * 1024, ge=1024)
    # Bytes of request bodies one worker reads and holds at once, all requests together, from
    # their first byte until each request ends; past it: 503 with Retry-After. Never below
    # max_body_bytes or max_upload_bytes (raised to them), so any one body fits.
    max_held_body_bytes: int = Field(256 * 1024 * 1024, ge=1024, le=1 << 40)
    response_ids: ResponseIdsConfig = ResponseIdsConfig()
    max_error_body_bytes: int = Field(64 * 1024, ge=1024)
    drain_grace: float = Field(30.0, ge=0)
    # Client keys: set either (or both) and /v1/* requires `Authorization: Bearer <key>`.
    api_keys: list[ClientKeyConfig] = Field(default_factory=list)
    api_keys_file: str | None = None
    api_keys_reload: float = Field(5.0, gt=0, le=3600)  # seconds between checks of the file
    # Seconds between full registry reloads from Redis, which heal a missed pub/sub message.
    registry_resync: float = Field(1.0, gt=0, le=60)
    engine_metrics: EngineMetricsConfig = EngineMetricsConfig()
    affinity: AffinityConfig = AffinityConfig()
    # LoRA adapters: read from the engines, routed to those that hold them (docs/lora.md).
    lora: LoraConfig = LoraConfig()
    # Adds `x-sluicegate-backend: <name>` to responses; off by default: it reveals topology.
    expose_backend_header: bool = False
    # Backends that follow the cluster (EndpointSlices, an InferencePool's pods) or DNS answers;
    # see router/discovery/ and docs/discovery.md.
    discovery: list[DiscoverySource] = Field(default_factory=list)
    tracing: TracingConfig = TracingConfig()
    admission: AdmissionConfig | None = None
    # Declared models held while their pool wakes, and the KEDA scaler (docs/scale-from-zero.md).
    scale_from_zero: ScaleFromZeroConfig | None = None
    # The Batch API (docs/batch.md); absent: /v1/files and /v1/batches answer 404. Needs Redis.
    batch: BatchConfig | None = None
    # Token usage per request (router/request/usage/strip.py): `active` asks a stream's backend
    # for its usage when the client did not and hides that event; `passive` counts content events.
    usage_accounting: Literal["active", "passive"] = "active"
    usage_flush: float = Field(5.0, gt=0, le=3600)  # seconds between usage writes to Redis
    # Model fallbacks (docs/fallbacks.md), LiteLLM's key and shapes: model -> the models tried
    # in order when its own backends failed, were full or ejected after its retries (and when a
    # stream broke that none of them continued, unless the chain says `mid_stream: error`).
    fallbacks: FallbackMap = Field(default_factory=dict)
    # model -> the models tried when the prompt plus max_tokens does not fit its context (its
    # engines' max_model_len, or their context-length 400).
    context_window_fallbacks: FallbackMap = Field(default_factory=dict)
    # model -> the models tried when a backend refuses on content policy (OpenAI's
    # content_policy_violation, Azure's content filter codes).
    content_policy_fallbacks: FallbackMap = Field(default_factory=dict)

    @field_validator("backends")
    @classmethod
    def _unique_names(cls, v: list[BackendConfig]) -> list[BackendConfig]:
        seen: set[str] = set()
        for b in v:
            if b.name in seen:
                raise ValueError(f"duplicate backend name {b.name!r}")
            seen.add(b.name)
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            scheme = urlsplit(v.get_secret_value()).scheme
            if scheme not in ("redis", "rediss", "unix"):
                # The value may carry a password: name the scheme only.
                raise ValueError(f"scheme {scheme!r} is not one of redis://, rediss://, unix://")
        return v

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinel_addresses(cls, v: list[str]) -> list[str]:
        for addr in v:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{addr!r} is not host:port")
        return v

    @model_validator(mode="after")
    def _redis_topology(self) -> Settings:
        if bool(self.redis_sentinels) != bool(self.redis_sentinel_master):
            raise ValueError("redis_sentinels and redis_sentinel_master go together")
        url = self.redis_url.get_secret_value() if self.redis_url else ""
        if self.redis_sentinels and url.startswith("unix:"):
            raise ValueError("redis_sentinels: the sentinels name the master; no unix:// redis_url")
        if self.redis_cluster:
            if self.redis_sentinels:
                raise ValueError("redis_cluster and redis_sentinels exclude each other")
            if not url.startswith(("redis://", "rediss://")):
                raise ValueError("redis_cluster needs redis_url (redis:// or rediss://, any node)")
        return self

    @model_validator(mode="after")
    def _fallback_chains(self) -> Settings:
        # Names a backend serves, or discovery declares (`models: auto` may declare any name
        # its `models_allow` lets in: all of them without one).
        known = {m for b in self.backends for m in b.models}
        patterns: list[str] = []
        for source in self.discovery:
            if source.models == "auto":
                patterns.extend(source.models_allow or ["*"])
            else:
                known.update(source.models)
        # The API formats each model's backends speak (never translated between).
        formats: dict[str, set[str]] = {}
        for b in self.backends:
            for m in b.models:
                formats.setdefault(m, set()).update(API_FORMATS[b.kind])
        for source in self.discovery:
            if source.models != "auto":
                kind = source.backend.get("kind", "vllm")
                for m in source.models:
                    formats.setdefault(m, set()).update(API_FORMATS.get(kind, ()))
        for key in FALLBACK_KEYS:
            chains: dict[str, FallbackChain] = getattr(self, key)
            for model, chain in chains.items():
                for name in (model, *chain.models):
                    if name not in known and not any(
                        fnmatch.fnmatchcase(name, p) for p in patterns
                    ):
                        raise ValueError(f"{key}: {name!r} is a model no backend serves")
                if model in chain.models:
                    raise ValueError(f"{key}: {model!r} falls back to itself")
                for target in chain.models:
                    if model in formats and target in formats:
                        if not formats[model] & formats[target]:
                            raise ValueError(
                                f"{key}: {target!r} cannot serve {model!r}'s requests "
                                f"({'/'.join(sorted(formats[target]))} API only; fallbacks "
                                "never translate between API formats)"
                            )
            cycle = fallback_cycle(chains)
            if cycle is not None:
                raise ValueError(f"{key}: a cycle: {' -> '.join(cycle)}")
        return self

    @model_validator(mode="after")
    def _batch_needs_redis(self) -> Settings:
        if self.batch is not None and self.redis_url is None and not self.redis_sentinels:
            raise ValueError(
                "batch: the Batch API keeps its jobs in Redis; set redis_url (or redis_sentinels)"
            )
        return self

    @model_validator(mode="after")
    def _keys_file_readable(self) -> Settings:
        # Read once here so a bad file stops startup with one line; auth.py reads it for use.
        if self.api_keys_file:
            for i, entry in enumerate(read_api_keys_file(self.api_keys_file)):
                try:
                    ClientKeyConfig.model_validate(entry)
                except ValidationError as exc:
                    problem = describe_validation(exc, "entry")
                    raise ValueError(f"api_keys_file entry [{i}] {problem}") from None
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _FileSource(settings_cls)


def describe_validation(exc: ValidationError, where_none: str = "body") -> str:
    """`field: problem` for the first error; pydantic messages never quote the input."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or where_none
    return f"{where}: {err['msg']}"


def _describe(exc: ValidationError, data: dict[str, Any]) -> str:
    err = exc.errors()[0]
    parts: list[str] = []
    node: Any = data
    for loc in err["loc"]:
        if isinstance(loc, int) and isinstance(node, list) and loc < len(node):
            node = node[loc]
            name = node.get("name") if isinstance(node, dict) else None
            parts.append(f"[{loc}]" + (f"({name})" if name else ""))
            continue
        node = node.get(loc) if isinstance(node, dict) else None
        parts.append(f".{loc}" if parts else str(loc))
    where = "".join(parts) or "(top level)"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where}: {err['msg']}{more}"


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config file {p}: cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {p}:{where}: not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping")
    return data


def load_settings(config: str | Path | None = None, **overrides: Any) -> Settings:
    """Build Settings: explicit overrides > SLUICEGATE_* env > YAML file > defaults."""
    path = str(config) if config else os.environ.get("SLUICEGATE_CONFIG")
    data = read_config_file(path) if path else {}
    token = _FILE_DATA.set(data)
    try:
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if path:
            overrides["config"] = path
        return Settings(**overrides)
    except ValidationError as exc:
        origin = f"config file {path}" if path else "settings"
        raise ConfigError(f"{origin}: {_describe(exc, data)}") from None
    finally:
        _FILE_DATA.reset(token)
