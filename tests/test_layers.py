"""The import graph: no circle anywhere, and no import from a lower layer up to a higher one.

Layers, bottom first: settings, the backend type and errors; the upstream transport and logging;
balancers and health; the request path's parts and the registry; metrics; the lifecycle's steps;
the lifecycle (their order); the HTTP face, admin and status; the app; the CLI. A module may
import its own layer or below.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("router", "balancers", "health")

# Longest matching prefix wins. A new module must be placed here: an unknown one fails the test.
LAYERS: dict[str, int] = {
    "router.core": 0,
    "router.core.tls": 0,  # a backend's TLS policy as one shared ssl.SSLContext
    "router.upstream": 1,
    "router.ops.logs": 1,
    "router.ops.collector": 1,  # the startup heap out of the collector's walk (stdlib only)
    "router.ops.memory": 1,  # freed request bodies handed back to the system (stdlib only)
    "router.ops.live": 1,  # the console's last two minutes of routing, per second (stdlib only)
    "router.state": 1,  # the shared-store base, its pipeliner: core only (stores build on it)
    "balancers": 2,
    "health": 2,
    "router.engine": 2,  # engine metrics scraping: core and upstream only
    "router.engine.kv_wire": 2,  # vLLM's KV-event messages decoded (pure)
    "router.engine.kv_index": 2,  # engine blocks keyed by the router's token-chain keys (pure)
    "router.engine.kv_events": 2,  # ZMQ subscription per engine feeding the index
    "router.engine.kv_endpoints": 2,  # where a KV-event socket may point (the admin rules)
    "router.engine.calibrate": 2,  # prefill and decode rates from the engine's histograms
    "router.request.tokens": 3,  # the request's token ids: router tokenizer or engine /tokenize
    "router.request.token_memo": 3,  # `via: engine`: earlier messages' ids, remembered
    "router.registry.fleet": 3,
    "router.registry.sync": 3,
    "router.request.record": 3,
    "router.request.drain": 3,
    "router.request.headers": 3,
    "router.request.validate": 3,
    "router.request.failover": 3,
    "router.request.prefix": 3,  # prompt -> block hash chain (pure)
    "router.request.affinity": 3,  # hashing + prefix index + binding cache_aware
    "router.request.affinity_store": 3,  # the prefix index shared in Redis
    "router.request.admission": 3,  # the admission queue: core and balancers only
    "router.request.quota": 3,  # per-key rpm / tpm / max_parallel: core only
    "router.request.quota_shared": 3,  # the same shared through Redis, on router.state
    "router.request.sse": 3,  # server-sent events as bytes: boundaries, parsed events (pure)
    "router.request.hops": 3,  # the hop marker: loops refused (core only)
    "router.request.usage_stream": 3,  # include_usage asked for and its event taken out (pure)
    "router.request.usage_book": 3,  # hourly usage per key and model: core only
    "router.request.multipart": 3,  # a form's model and stream fields (pure)
    "router.request.response_ids": 3,  # response id -> backend, local or in Redis
    "router.request.estimate": 3,  # a request's token estimate (pure)
    "router.request.continuation": 3,  # migration: the continuation request (pure)
    "router.request.migration": 3,  # migration policy: which calls may go on elsewhere
    "router.request.relayed": 3,  # migration: what one attempt relayed (pure)
    "router.request.adapter_flights": 3,  # LoRA: adapters in flight per engine (pure)
    "router.request.stitch": 3,  # migration: a continuation's events joined to the stream (pure)
    "router.request.usage": 3,  # tokens and the first content token from the bytes (pure)
    "router.request.pd": 3,  # prefill/decode: a model's pools by role, the two legs' bodies
    "router.ops.metrics": 4,
    "router.ops.tracing": 4,  # OpenTelemetry spans: core only, used by the lifecycle and the app
    "router.discovery": 4,
    "router.request.endings": 3,  # how an attempt ends: Retry, Broken, NoneLeft (pure)
    "router.request.watch": 3,  # the lifecycle task under a watcher of the client
    # The lifecycle's steps: they use metrics and tracing, and each other only downward
    # (parts, call < getting_in, pump, prefill_leg, migrate < attempt; account).
    "router.request.parts": 5,  # what every step uses, built once
    "router.request.call": 5,  # one request's state through the steps
    "router.request.getting_in": 5,  # drain, hop, validation, ticket, quota
    "router.request.attempt": 5,  # pick, lease, upstream, retryable status
    "router.request.prefill_leg": 5,  # P/D: the prefill engine's leg of an attempt
    "router.request.pump": 5,  # the stream relayed chunk by chunk
    "router.request.migrate": 5,  # a broken stream continued elsewhere
    "router.request.account": 5,  # tokens, usage book, record, metrics at the end
    "router.request.proxy": 6,  # the order of the steps
    "router.web": 7,
    "router.web.console": 7,  # the console page, its assets and its live view's route
    "router.web.live_state": 7,  # the console's live view: admin rows, routing, queue, quotas
    "router.registry.admin": 7,
    "router.ops.status": 7,
    "router.mock": 7,
    "router.mock.apis": 0,  # the other APIs' shapes: pure formatting
    "router.mock.handoff": 0,  # the mock's NIXL and SGLang handoff (stdlib only)
    "router.enginefleet": 7,  # real vLLM engines for the engine tier and `sluicegate engines`
    "router.app": 8,
    "router.cli": 9,
    "router.ops.probe": 9,  # the image's HEALTHCHECK entry point (stdlib only)
}

# Package markers (`__init__.py` holding only a docstring) sit in layer 0. They match their own
# name only: a prefix here would place every unlisted module of the package silently.
PACKAGE_MARKERS = frozenset({"router", "router.request", "router.registry", "router.ops"})


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imports(path: Path, known: set[str]) -> set[str]:
    """Project modules `path` imports (also under TYPE_CHECKING: a circle there is a smell too)."""
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        deps.update(n for n in names if n in known)
    return deps


def _layer(module: str) -> int:
    if module in PACKAGE_MARKERS:
        return 0
    best = max(
        (p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None
    )
    assert best is not None, f"{module}: not placed in a layer (add it to LAYERS in this test)"
    return LAYERS[best]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, known) - {name} for name, path in modules.items()}


def test_no_import_runs_up_a_layer() -> None:
    upward = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in _graph().items()
        for d in sorted(deps)
        if _layer(d) > _layer(m)
    ]
    assert upward == []


def test_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    """The walk above really finds what it looks for (guards against a vacuous pass)."""
    (tmp_path / "a.py").write_text("from router.app import create_app\n")
    deps = _imports(tmp_path / "a.py", {"router.app", "router.app.create_app"})
    assert "router.app" in deps
    assert _layer("router.core.settings") < _layer("router.app")


def test_every_module_is_placed_and_markers_are_only_markers() -> None:
    """No module falls into a layer by accident: each is named (or sits under a named prefix),
    and a package marker matched by its exact name holds nothing but a docstring."""
    modules = _modules()
    for name in modules:
        _layer(name)  # fails naming an unlisted module
    for marker in PACKAGE_MARKERS:
        tree = ast.parse(modules[marker].read_text(encoding="utf-8"))
        assert all(
            isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in tree.body
        ), f"{marker}: a package marker holds code; place it in LAYERS instead"
    try:
        _layer("router.request.not_listed_anywhere")
    except AssertionError as exc:
        assert "not placed in a layer" in str(exc)
    else:
        raise AssertionError("an unlisted module under a package marker was placed silently")
