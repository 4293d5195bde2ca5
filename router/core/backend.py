"""A backend as a frozen value: what every layer (balancers, health, the request path) sees.

Built from a `BackendConfig` once per registry snapshot; never mutated (a change is a new value).
Secret-bearing fields stay out of `repr` and `public()`. `ssl_context` is the backend's TLS
policy made once (router/core/tls.py): every connection to it (traffic, probes, scrapes) uses it.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from router.core.settings import (
    BackendConfig,
    HealthConfig,
    KvEventsConfig,
    OutlierConfig,
    TlsConfig,
)
from router.core.validation import check_header_name, check_header_value, check_url

# The Messages API version a `kind: anthropic` backend is spoken to in, unless its `headers` say.
ANTHROPIC_VERSION = b"2023-06-01"


def _wire(where: str, name: str, value: str) -> tuple[bytes, bytes]:
    try:
        check_header_name(name)
        check_header_value(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return name.lower().encode("latin-1"), value.encode("latin-1")


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    url: str
    kind: str
    models: MappingProxyType[str, str]  # public name -> the backend's own model id
    weight: float = 1.0
    max_inflight: int | None = None
    # Secret-bearing: never shown by repr, never serialised by `public()`.
    auth_headers: tuple[tuple[bytes, bytes], ...] = field(default=(), repr=False)
    query: tuple[tuple[str, str], ...] = ()
    has_key: bool = False
    health: HealthConfig | None = None
    outlier: OutlierConfig | None = None
    source: str = "file"  # "file" (the YAML file, maybe patched over the API) or "api"
    draining: bool = False
    key_header: str = "authorization"
    header_names: tuple[str, ...] = ()  # extra headers' names; their values may be secrets
    metrics_path: str | None = None  # engine metrics to scrape; None for openai or when off
    kv_events: KvEventsConfig | None = None  # where its KV-cache events come from (vllm only)
    role: str = "both"  # prefill | decode | both (router/request/placement/pd.py)
    bootstrap_port: int = 8998  # SGLang's bootstrap server, on a prefill engine
    tls: TlsConfig | None = None
    # The shared context of `tls` (None: the system default). Compared by identity, so a
    # backend rebuilt after its files changed is a changed backend and reconnects.
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False)

    def target(self, model: str) -> str:
        """The backend's own id of the public model name `model` (unchanged when it has none:
        a LoRA adapter routed by its base model goes by its own name)."""
        return self.models.get(model, model)

    @property
    def server_name(self) -> str | None:
        """SNI and the certificate's expected name, when not the URL's host."""
        return self.tls.server_name if self.tls is not None else None

    @classmethod
    def from_config(
        cls, cfg: BackendConfig, source: str = "file", draining: bool = False
    ) -> Backend:
        """Raises ValueError naming the field when `cfg` holds what cannot go on the wire (the
        validators already refuse it; a config built without them, or a key variable that
        changed since, still gets a clear error here, never a UnicodeEncodeError later)."""
        key = cfg.resolved_key()
        headers = [_wire(f"headers.{k}", k, v) for k, v in cfg.headers.items()]
        hname = cfg.key_header.lower()
        if cfg.kind == "anthropic":
            # Anthropic's API: the key as `x-api-key`, and the API version it is spoken in.
            if hname == "authorization":  # Anthropic takes no bearer key
                hname = "x-api-key"
            if not any(k.lower() == "anthropic-version" for k in cfg.headers):
                headers.append((b"anthropic-version", ANTHROPIC_VERSION))
        if key:
            value = f"Bearer {key}" if hname == "authorization" else key
            headers.append(_wire("api_key", hname, value))
        check_url(cfg.url)
        try:
            context = cfg.tls.context() if cfg.tls is not None else None
        except ValueError as exc:  # validated already; its files may have gone since
            raise ValueError(f"tls.{exc}") from None
        return cls(
            name=cfg.name,
            url=cfg.url,
            kind=cfg.kind,
            models=MappingProxyType(dict(cfg.models)),
            weight=cfg.weight,
            max_inflight=cfg.max_inflight,
            auth_headers=tuple(headers),
            query=tuple(cfg.query.items()),
            has_key=bool(key),
            health=cfg.health,
            outlier=cfg.outlier,
            source=source,
            draining=draining,
            key_header=hname,
            header_names=tuple(k.lower() for k in cfg.headers),
            metrics_path=cfg.metrics_path if cfg.kind not in ("openai", "anthropic") else None,
            kv_events=cfg.kv_events if cfg.kind == "vllm" else None,
            tls=cfg.tls,
            ssl_context=context,
            role=cfg.role,
            bootstrap_port=cfg.bootstrap_port,
        )

    def public(self) -> dict[str, Any]:
        """What the admin API may show: everything but secrets."""
        return {
            "name": self.name,
            "url": self.url,
            "kind": self.kind,
            "models": dict(self.models),
            "weight": self.weight,
            "max_inflight": self.max_inflight,
            "api_key": "***" if self.has_key else None,
            "key_header": self.key_header,
            # Values masked: extra headers and query parameters can carry credentials too.
            "headers": dict.fromkeys(self.header_names, "***"),
            "query": {k: "***" for k, _ in self.query},
            "source": self.source,
            "draining": self.draining,
            "metrics_path": self.metrics_path,
            "kv_events": self.kv_events.model_dump() if self.kv_events is not None else None,
            # Paths and flags only: nothing here is a secret, the key file's contents never read.
            "tls": self.tls.model_dump() if self.tls is not None else None,
            "role": self.role,
        }
