"""The import graph: no circle anywhere, and no import from a lower layer up to a higher one.

Layers, bottom first: settings, the backend type and errors; the upstream transport and logging;
balancers and health; the request path's parts and the registry; metrics; the lifecycle's steps;
the lifecycle (their order); the HTTP face, admin and status; the app; the CLI. A module may
import its own layer or below.

The benchmarks sit above the router: bench/kit (what they share), then bench/scenarios (`make
bench`'s, with their registry above them) and bench/oneoff (investigations), then bench/run.py,
the entry point, which nothing imports.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "balancers", "health", "bench")
ROOMS = ("lifecycle", "admit", "placement", "usage", "migration", "wire")

# Longest matching prefix wins. A new module must be placed here: an unknown one fails the test.
# Folders, not modules: a folder sits in one layer (a few stdlib-only modules of router/ops
# sit below their folder, which is the metrics and tracing layer).
LAYERS: dict[str, int] = {
    "router.core": 0,  # settings, the backend value, errors, the endpoint table
    "router.upstream": 1,  # the one HTTP stack to backends
    "router.state": 1,  # the shared-store base, its pipeliner: core only (stores build on it)
    "router.ops.logs": 1,
    "router.ops.collector": 1,  # the startup heap out of the collector's walk (stdlib only)
    "router.ops.memory": 1,  # freed request bodies handed back to the system (stdlib only)
    "router.ops.live": 1,  # the console's last two minutes of routing, per second (stdlib only)
    "balancers": 2,  # pure policies
    "health": 2,  # probes, outlier detection, health state
    "router.engine": 2,  # what engines report: readings, KV events, LoRA adapters
    "router.request.wire": 3,  # SSE, headers, multipart: bytes in and out (pure)
    "router.request.admit": 3,  # validation, estimate, admission queue, quotas, hops, budgets
    "router.request.placement": 3,  # affinity, prefix, tokens, response ids, adapters, P/D
    "router.request.usage": 3,  # usage from the bytes, its strip, the usage book, the record
    "router.request.migration": 3,  # relay, stitch, continuation, migration policy
    "router.registry": 3,  # the backend set, its Redis sync
    "router.ops": 4,  # metrics, tracing
    "router.discovery": 4,
    # Scale from zero: declared models' demand (local, or summed in Redis) and the KEDA external
    # scaler (gRPC, its generated protocol in router/scaling/keda/): apart from any other gRPC.
    "router.scaling": 4,
    "router.request.lifecycle": 5,  # the steps and their order (proxy)
    "router.batch": 6,  # the Batch API: its store, files and runner (runs lines as requests)
    "router.web": 7,  # the HTTP face, admin routes, the console
    "router.app": 8,
    "router.stores": 8,  # each concern's store, the process's own or shared: the one table
    # The endpoint picker: the app's parts behind Envoy's ext_proc (its generated messages too).
    "router.picker": 8,
    # Test doubles and tools: only the CLI imports them, no serving module.
    "router.tools": 9,  # the mock engine, the engine fleet, status, probe, the settings doc
    "router.cli": 10,
    "bench.kit": 11,  # processes, loads, nginx, /proc, the page writer: no scenario
    "bench.scenarios": 12,  # `make bench`'s scenarios
    "bench.oneoff": 12,  # investigations run on their own
    "bench.scenarios.registry": 13,  # the one registry: every scenario by name
    "bench.run": 14,  # the entry point (`python -m bench.run`)
}

# Package markers (`__init__.py` holding only a docstring) sit in layer 0. They match their own
# name only: a prefix here would place every unlisted module of the package silently.
PACKAGE_MARKERS = frozenset({"router", "router.request", "router.registry", "router.ops"})
PACKAGE_MARKERS |= {f"router.request.{room}" for room in ROOMS}
PACKAGE_MARKERS |= {"router.tools", "bench", "bench.kit", "bench.scenarios", "bench.oneoff"}


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


def test_bench_scenarios_and_oneoffs_share_only_the_kit() -> None:
    """Two rooms of one layer: `make bench`'s scenarios and the one-off investigations meet only in
    bench/kit, so either can change without the other."""
    rooms = ("bench.scenarios", "bench.oneoff")
    crossing = [
        f"{m} imports {d}"
        for m, deps in _graph().items()
        for d in sorted(deps)
        for here, there in (rooms, rooms[::-1])
        if m.startswith(here + ".") and (d == there or d.startswith(there + "."))
    ]
    assert crossing == []


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


def test_the_architecture_page_holds_the_layers_and_every_folder() -> None:
    """docs/architecture.md's rooms table gives each folder the layer this test gives it, and
    every folder of the code is named on the page."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rooms = page.split("## The rooms", 1)[1].split("From the bottom", 1)[0]
    rows = [line for line in rooms.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert rows, "the rooms table is gone"
    for row in rows:
        layer = int(row.split("|")[1])
        for path in re.findall(r"`([\w/.]+)`", row.split("|")[3]):
            module = path.removesuffix(".py").replace("/", ".")
            if path.endswith("/"):  # a folder: where a module of it sits (its marker is 0)
                module += "any"
            assert _layer(module) == layer, (
                f"{path}: the page says {layer}, the test {_layer(module)}"
            )
    folders = {
        str(p.parent.relative_to(ROOT))
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
    }
    missing = sorted(f for f in folders if f"`{f}/`" not in page and f"{f}/" not in page)
    assert missing == [], f"folders the architecture page does not name: {missing}"
