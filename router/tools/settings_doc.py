"""docs/configuration.md, generated from the settings model (`make docs`).

`python -m router.tools.settings_doc` rewrites the page; `--check` exits 1 when the committed page
is missing a setting or says something stale (tests/tools/test_settings_doc.py does the same). Every
key of `Settings` and of each model nested in it gets a row: its type, default, limits and
description. A description comes from the field's `description=`, else from `_EXTRA` below, else
from the comments at the field in settings.py (the lines above it and the one at its end): a new
setting without any of them is an error, so the page never has a blank row.
"""

from __future__ import annotations

import ast
import functools
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from router.core import settings as s

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# Descriptions of fields that have no `description=` and no comment of their own in settings.py
# (or one that speaks of its neighbours too).
_EXTRA: dict[str, str] = {
    "Settings.redis_timeout": (
        "With Redis: seconds before a call gives up (the request is then counted locally)."
    ),
    "Settings.redis_lease_ttl": (
        "With Redis: a dead replica's requests and quota slots stop counting this many seconds "
        "after its last heartbeat (live ones re-stamp every third of it)."
    ),
    "ClientKeyConfig.priority": "Admission band of the key's requests (with `admission:` only).",
    "ClientKeyConfig.weight": "The key's share within its band (with `admission:` only).",
    "AdminConfig.denied_backend_networks": (
        "Backend addresses never allowed (default: metadata services, link-local, 0.0.0.0/8, ::)."
    ),
    "Settings.config": "Path of the YAML config file (`serve --config`).",
    "Settings.host": "Address the router listens on.",
    "Settings.port": "Port the router listens on (0: any free port).",
    "Settings.workers": "Worker processes (each its own event loop, one port; metrics merged).",
    "Settings.redis_url": (
        "Redis for state shared by every replica and worker: `redis://`, `rediss://` (TLS), "
        "`unix:///path`. Unset: each process keeps its own. Best given as "
        "`SLUICEGATE_REDIS_URL`; never logged."
    ),
    "Settings.redis_prefix": (
        "Prefix of every Redis key this deployment writes, so two deployments can share one Redis."
    ),
    "Settings.redis_sentinels": "Sentinel addresses (`host:26379`); with `redis_sentinel_master`.",
    "Settings.redis_sentinel_master": "The master's name the sentinels know (e.g. `mymaster`).",
    "Settings.redis_sentinel_password": "Password of the sentinels themselves, when they need one.",
    "Settings.redis_cluster": "Redis Cluster: `redis_url` names any node.",
    "Settings.admin_token": (
        "Token of the admin API (`Authorization: Bearer`); unset: admin changes answer 403. "
        "Best given as `SLUICEGATE_ADMIN_TOKEN`."
    ),
    "Settings.admin": "What backends added at run time (admin API, discovery) may be.",
    "Settings.log_level": "Level of the JSON log lines on stderr.",
    "Settings.backends": "The backends of the config file (the admin API and discovery add more).",
    "Settings.balancer": (
        "Balancer of every model: `least_inflight`, `round_robin`, `least_load`, `cache_aware`, "
        "or a plugin's name (entry-point group `sluicegate.balancers`)."
    ),
    "Settings.model_balancers": "Per-model balancer: `{public model name: balancer}`.",
    "Settings.timeouts": "Upstream timeouts, seconds.",
    "Settings.limits": "Each backend's connection pool.",
    "Settings.server": "Client connections, per worker.",
    "Settings.health": "Active health probes (a backend's own `health:` keys win).",
    "Settings.outlier": "Ejection on real traffic's failures (a backend's own `outlier:` wins).",
    "Settings.retries": "Retries before the first byte reached the client.",
    "Settings.migration": (
        "A stream whose engine dies mid-answer goes on on another backend (docs/migration.md)."
    ),
    "MigrationRule.enabled": (
        "True: on; false: off; unset: on, except from or to `kind: openai` backends."
    ),
    "MigrationRule.max_migrations": (
        "Migrations of one request at most; it reaches at most 1 + this many engines that "
        "broke while working on it, plain retries included."
    ),
    "MigrationConfig.models": "Public model name -> a rule replacing the global one for it.",
    "Settings.max_body_bytes": "Largest JSON request body; larger: 413.",
    "Settings.max_held_body_bytes": (
        "Bytes of request bodies one worker reads and holds at once, all requests together "
        "(from their first byte to the request's end); past it a request gets 503 "
        "(`bodies_over_budget`) with Retry-After. Raised to `max_body_bytes` and "
        "`max_upload_bytes` when below them."
    ),
    "Settings.response_ids": "Responses API ids -> the backend that stored them.",
    "Settings.max_error_body_bytes": (
        "Most bytes read of a backend's retryable error answer (5xx, 429); relayed, cut there, "
        "when no retry follows."
    ),
    "Settings.drain_grace": "Seconds streams in flight may take to finish on SIGTERM.",
    "Settings.api_keys_file": (
        "Client keys from a file (a mounted Secret): the same entries as `api_keys`, re-read "
        "when it changes."
    ),
    "Settings.engine_metrics": "Scraping of each engine's `/metrics` (for `least_load`).",
    "Settings.affinity": "Cache-aware routing and session affinity.",
    "Settings.tracing": "OpenTelemetry traces.",
    "Settings.admission": "The admission queue; unset: a full fleet answers 503 at once.",
    "Timeouts.connect": "Seconds to open an upstream connection.",
    "Timeouts.read": (
        "Longest silent gap while reading an upstream answer, seconds; also the longest a "
        "prefill leg's whole (one-token) answer may take."
    ),
    "Timeouts.write": "Seconds to write the request upstream.",
    "Timeouts.pool": "Seconds to wait for a free connection of the backend's pool.",
    "PoolLimits.max_connections": "Connections to one backend at most.",
    "PoolLimits.max_keepalive": "Idle connections kept open per backend.",
    "PoolLimits.keepalive_expiry": "Seconds an idle connection is kept.",
    "HealthConfig.interval": "Seconds between probes of a healthy backend (+-10 % jitter).",
    "HealthConfig.timeout": "Seconds a probe may take.",
    "HealthConfig.unhealthy_threshold": "Failed probes in a row that take a backend out.",
    "HealthConfig.healthy_threshold": "Good probes in a row that bring it back.",
    "HealthConfig.path": (
        "Probe path; default `GET /health` (vllm, sglang) or `GET /v1/models` with the key "
        "(openai)."
    ),
    "HealthConfig.enabled": "False: never probed (always counted healthy by probes).",
    "OutlierConfig.consecutive_failures": (
        "Connect errors, timeouts or 5xx in a row that eject a backend."
    ),
    "OutlierConfig.base_ejection": "Seconds of the first ejection; x times ejected after that.",
    "OutlierConfig.max_ejection": "Longest ejection, seconds.",
    "OutlierConfig.max_ejection_percent": "Most of a model's backends ejected at once, percent.",
    "RetryConfig.attempts": "Attempts per request at most, the first included.",
    "RetryConfig.budget_percent": (
        "Retries waiting for an answer stay under this share of the requests in flight."
    ),
    "RetryConfig.min_retries": "Retries always allowed, whatever the budget.",
    "RetryConfig.deadline": "Seconds after arrival past which no retry starts.",
    "TracingConfig.sample_ratio": (
        "Share of new traces sampled (default `OTEL_TRACES_SAMPLER_ARG`, else 1.0); a client's "
        "`traceparent` keeps its own decision."
    ),
    "TracingConfig.service_name": "Service name of the spans (default `OTEL_SERVICE_NAME`, else "
    "`sluicegate`).",
    "KvEventsConfig.endpoint": "The engine's `--kv-events-config` endpoint (see above).",
    "KvEventsConfig.topic": 'ZMQ topic the engine publishes on (`""`: all).',
    "KvEventsConfig.replay_endpoint": "The engine's replay endpoint, to catch up after a gap.",
    "KvEventsConfig.bind": "Override: true, the router binds; false, it connects.",
    "BackendConfig.name": "Unique backend name (metrics label, admin API path).",
    "BackendConfig.url": "Base URL; the request path (`/v1/...`) is appended.",
    "BackendConfig.kind": "Engine kind: vllm, sglang, openai (a cloud API; never scraped), or "
    "anthropic (Anthropic's Messages API at /v1/messages, with `x-api-key` and "
    "`anthropic-version`; never scraped).",
    "BackendConfig.models": (
        "Models it serves: a list, or a map public name -> the backend's model id."
    ),
    "BackendConfig.api_key_env": (
        "Environment variable holding the backend's key (through the admin API it must start "
        "with `admin.api_key_env_prefix`)."
    ),
    "BackendConfig.api_key": "The backend's key itself; never logged or returned.",
    "BackendConfig.key_header": "Header carrying the key (`Authorization` sends `Bearer <key>`).",
    "BackendConfig.headers": "Extra headers sent upstream; values never shown.",
    "BackendConfig.query": "Query parameters added to every upstream URL (e.g. `api-version`).",
    "BackendConfig.weight": "Relative share of traffic.",
    "BackendConfig.max_inflight": (
        "Requests in flight at most; a full backend is skipped (all full: 503 + Retry-After, or "
        "the admission queue)."
    ),
    "BackendConfig.health": "This backend's probe settings, over the global `health:`.",
    "BackendConfig.outlier": "This backend's ejection settings, over the global `outlier:`.",
    "EngineMetricsConfig.interval": "Seconds between scrapes of one engine.",
    "EngineMetricsConfig.timeout": "Seconds a scrape may take.",
    "EngineMetricsConfig.stale_after": (
        "Seconds after which a reading is stale (ranked after every fresh one)."
    ),
    "TokenizerConfig.via": "`router`: tokenize in the router; `engine`: the backend's `/tokenize`.",
    "TokenizerConfig.path": "The tokenizer's directory (or a hub id already in the local cache).",
    "AffinityConfig.max_prefix_chars": "Characters of a prompt hashed at most (0: none).",
    "AdmissionConfig.saturation": "Engine readings that count a backend as full.",
    "_DiscoveryBase.models": "`auto` (each new endpoint's `GET /v1/models`), a list, or a map.",
    "_DiscoveryBase.scheme": "Scheme of the discovered backends' URLs.",
    "KubernetesDiscovery.kind": "`kubernetes`: EndpointSlices.",
    "KubernetesDiscovery.namespace": "Namespace of the EndpointSlices.",
    "KubernetesDiscovery.service": "Service whose EndpointSlices are followed.",
    "KubernetesDiscovery.label_selector": (
        "Label selector on EndpointSlices, in place of `service`."
    ),
    "KubernetesWatch.resync": "Seconds between full re-lists, even while the watch is fine.",
    "InferencePoolDiscovery.kind": "`inferencepool`: the pods an InferencePool selects.",
    "InferencePoolDiscovery.name": "Name of the InferencePool.",
    "InferencePoolDiscovery.namespace": "Namespace of the InferencePool and of its pods.",
    "DnsDiscovery.kind": "`dns`: a name's A/AAAA records.",
    "DnsDiscovery.name": "The name to resolve (a headless Service, or any name).",
    "DnsDiscovery.port": "Port of the discovered backends.",
    "DnsDiscovery.interval": "Seconds between lookups.",
    "DnsDiscovery.timeout": "Seconds a lookup may take.",
    "DnsDiscovery.nameserver": "`host[:port]` of the resolver; default: the system's.",
    "ClientKeyConfig.sha256": "sha256 (hex) of the key; the key itself is never configured.",
    "ClientKeyConfig.name": "Tenant name (metrics, usage, fairness); unnamed keys share one.",
}

# What a JSON-ish type is called on the page.
_SCALARS: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    SecretStr: "secret string",
    type(None): "null",
    Any: "any",
}


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    limits: str
    description: str


@dataclass(frozen=True)
class Section:
    path: str  # where the model sits: `timeouts`, `backends[]`, `discovery[]` (kind: dns)
    model: type[BaseModel]
    doc: str
    rows: tuple[Row, ...]


@functools.cache
def _comments(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the comments at it in the class's source (above it, then at its end)."""
    try:
        source = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):
        return {}
    by_line: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            by_line[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    found: dict[str, str] = {}
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef)
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, by_line[line])
            line -= 1
        end = by_line.get(node.end_lineno or node.lineno)
        text = " ".join([*above, *([end] if end else [])]).strip()
        if text:
            found[node.target.id] = text
    return found


def _owner(model: type[BaseModel], name: str) -> type[BaseModel]:
    """The class (in the MRO) whose body declares `name`: comments live there."""
    for klass in model.__mro__:
        if isinstance(klass, type) and name in getattr(klass, "__annotations__", {}):
            return klass
    return model


def _description(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    if field.description:
        text = field.description
    else:
        owner = _owner(model, name)
        text = _EXTRA.get(f"{owner.__name__}.{name}") or _comments(owner).get(name, "")
    if not text:
        raise LookupError(
            f"{model.__name__}.{name}: no description (give the field a comment in "
            "router/core/settings.py, or an entry in _EXTRA of router/tools/settings_doc.py)"
        )
    first = text.split(" ", 1)[0]
    if first.isalpha() and first.islower():  # not `vLLM`, not `models:`
        text = text[0].upper() + text[1:]
    return text if text.endswith((".", ")", "`")) else text + "."


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _models_in(arg)


def _type(annotation: Any, anchors: dict[type[BaseModel], str]) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0], anchors)
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(a, anchors) for a in args)
    if origin is list:
        return f"list of {_type(args[0], anchors)}"
    if origin is dict:
        return f"map of {_type(args[0], anchors)} to {_type(args[1], anchors)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{_anchor(anchors[annotation])})"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _anchor(path: str) -> str:
    """GitHub's anchor of a `## path` heading."""
    return "".join(c for c in path.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    if isinstance(value, SecretStr):
        return "(secret)"
    return f"`{json.dumps(value)}`"


def _limits(field: FieldInfo) -> str:
    # pydantic keeps each bound as its own annotated-types marker (Gt, Ge, ..., MaxLen) and a
    # pattern in its general metadata: read them by attribute.
    out: list[str] = []
    for m in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            bound = getattr(m, attr, None)
            if bound is not None:
                out.append(f"{sign} {bound:,}".replace(",", "_"))
        if (shortest := getattr(m, "min_length", None)) is not None:
            out.append(f"at least {shortest} long")
        if (longest := getattr(m, "max_length", None)) is not None:
            out.append(f"at most {longest} long")
        if pattern := getattr(m, "pattern", None):
            out.append(f"matches `{pattern}`")
    return ", ".join(out).replace("|", "\\|")


def sections(root: type[BaseModel] = s.Settings) -> list[Section]:
    """The root model, then every model nested in it, each once, in the order first reached."""
    anchors: dict[type[BaseModel], str] = {root: "top level"}
    order: list[type[BaseModel]] = [root]
    i = 0
    while i < len(order):
        model = order[i]
        i += 1
        for name, field in model.model_fields.items():
            for nested in _models_in(field.annotation):
                if nested in anchors:
                    continue
                base = "" if model is root else anchors[model] + "."
                path = base + name
                annotation = field.annotation
                if typing.get_origin(annotation) is list:
                    path += "[]"
                elif typing.get_origin(annotation) is dict:
                    path += ".<name>"
                kind = nested.model_fields.get("kind")
                kinds = typing.get_args(kind.annotation) if kind is not None else ()
                if (
                    kind is not None
                    and typing.get_origin(kind.annotation) is Literal
                    and len(kinds) == 1
                ):
                    path += f" (kind {kinds[0]})"
                anchors[nested] = path
                order.append(nested)
    out: list[Section] = []
    for model in order:
        rows = tuple(
            Row(
                key=name,
                type=_type(field.annotation, anchors),
                default=_default(field),
                limits=_limits(field),
                description=_description(model, name, field),
            )
            for name, field in model.model_fields.items()
        )
        doc = inspect.cleandoc(model.__doc__ or "") if model.__doc__ != BaseModel.__doc__ else ""
        out.append(Section(anchors[model], model, doc, rows))
    return out


_HEAD = """\
# Configuration reference

<!-- Generated by `make docs` (python -m router.tools.settings_doc) from router/core/settings.py:
edit the model, not this page. tests/tools/test_settings_doc.py fails while this page is stale. -->

Settings come from, highest first: command-line flags (`serve --host --port --workers
--config`), `SLUICEGATE_<KEY>` environment variables for the top-level keys (nested ones as
JSON, e.g. `SLUICEGATE_TIMEOUTS='{"read": 300}'`), the YAML file (`--config` or
`SLUICEGATE_CONFIG`), the defaults below. Unknown keys are refused: a bad file stops startup
with one line naming the file and the field, and exit code 2. An annotated example file:
[running.md](running.md).

Durations are in seconds, sizes in bytes. A row's type links to the section of a nested model.
"""


def render(root: type[BaseModel] = s.Settings) -> str:
    out = [_HEAD]
    for sec in sections(root):
        out += [f"## {sec.path}", ""]
        if sec.doc:
            out += [sec.doc, ""]
        out += ["| key | type | default | limits | description |", "|---|---|---|---|---|"]
        for r in sec.rows:
            cells = (f"`{r.key}`", r.type, r.default, r.limits, r.description.replace("|", "\\|"))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def problems(page: str, root: type[BaseModel] = s.Settings) -> list[str]:
    """What is wrong with `page` against the model: each row missing or stale, by its key."""
    expected = render(root)
    if page == expected:
        return []
    have = set(page.splitlines())
    found: list[str] = []
    for sec in sections(root):
        for line in expected.split(f"## {sec.path}\n", 1)[1].split("\n## ", 1)[0].splitlines():
            if line.startswith("| `") and line not in have:
                key = line.split("`", 2)[1]
                present = any(h.startswith(f"| `{key}` |") for h in have)
                found.append(f"{sec.path}: `{key}` " + ("stale" if present else "missing"))
    return found or ["the page differs from the model's (order, headings or text)"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        page = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        found = problems(page)
        for problem in found:
            print(f"{PAGE.name}: {problem}", file=sys.stderr)
        if found:
            print("run `make docs` and commit docs/configuration.md", file=sys.stderr)
        return 1 if found else 0
    if args:
        print("usage: python -m router.tools.settings_doc [--check]", file=sys.stderr)
        return 2
    PAGE.write_text(render(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
