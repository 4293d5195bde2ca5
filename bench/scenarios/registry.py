"""The scenarios of `make bench`, registered once: the runner (bench/run.py) runs them by name,
and the report (bench/kit/report.py) writes their sections and Targets rows from `PAGE`.

Each `Scenario` has its name (`python -m bench.run --only NAME`), its run function (figures go
into the run's Bench), and, where it has them, its section of docs/benchmarks.md and its rows of
the page's Targets table. A new scenario is one entry in `SCENARIOS` (in the order a full run
takes) and its name in `SECTION_ORDER` / `TARGET_ORDER` where it has a section / targets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.kit.cluster import ROOT, Bench
from bench.kit.report import Page, Row, Section, Targets
from bench.scenarios import (
    admission,
    batch,
    compare,
    console,
    core,
    engine,
    hop,
    kv_real,
    kv_workload,
    latency,
    lora,
    noisy,
    pd,
    peers,
    picker,
    prefix_workload,
    real_engine,
)
from tests.support.harness import Cluster


@dataclass(frozen=True)
class Scenario:
    """One scenario: its name, its run function, its section of the page and its Targets rows."""

    name: str
    run: Callable[[Bench], None]
    section: Section | None = None
    targets: Targets | None = None
    full: bool = True  # part of a full run; if not, only with `--only NAME`
    page_name: str = ""  # its section's name on the page (its markers), when not `name`


def _stored(key: str, run: Callable[[Cluster, bool], dict[str, Any]]) -> Callable[[Bench], None]:
    """A scenario run as `run(cluster, quick)`, its figures kept under `key`."""

    def go(bench: Bench) -> None:
        bench.results[key] = run(bench.cluster, bench.quick)

    return go


def _of(key: str, section: Callable[[dict[str, Any], str], list[str]]) -> Section:
    """`section` of the figures under `key` and the run's date, when the results have them."""

    def made(r: dict[str, Any], date: str) -> list[str] | None:
        return section(r[key], date) if key in r else None

    return made


def _rows(key: str, targets: Callable[[dict[str, Any]], Sequence[Row]]) -> Targets:
    """`targets` of the figures under `key`, when the results have them."""
    return lambda r: targets(r[key]) if key in r else []


def _engine(bench: Bench) -> None:
    res = engine.run(bench.cluster, bench.quick)
    made = engine.plot(engine.split_samples(res), ROOT / "docs" / engine.PNG)
    bench.results["engine"] = {**res, "plot": engine.PNG if made else None}


def _noisy(bench: Bench) -> None:
    bench.results.update(noisy.run(bench.cluster, bench.quick))


def _prefix(bench: Bench) -> None:
    res = prefix_workload.run(bench.cluster, bench.quick)
    made = prefix_workload.plot(
        res, prefix_workload.split_samples(res), ROOT / "docs" / prefix_workload.PNG
    )
    bench.results["prefix"] = {**res, "plot": prefix_workload.PNG if made else None}


def _hop(bench: Bench) -> None:
    res = hop.run(bench.cluster, bench.quick, bench.baseline_src)
    if bench.check:
        res["check"] = dict(zip(("ok", "message"), hop.check(res), strict=True))
        print(res["check"]["message"], flush=True)
    bench.results["hop"] = res


def _pd(bench: Bench) -> None:
    bench.results["pd"] = pd.run(bench.cluster, bench.quick, bench.baseline_src)


def _peers(bench: Bench) -> None:
    """Both issues' real-engine figures from one measurement: kv_real's key filled too."""
    res = peers.run(bench.cluster, bench.quick)
    bench.results["kv_real"] = res.pop("real")
    bench.results["peers"] = res


def _peers_section(r: dict[str, Any], date: str) -> list[str] | None:
    return peers.section(r["peers"], r.get("kv_real"), date) if "peers" in r else None


def _noisy_section(r: dict[str, Any], date: str) -> list[str] | None:
    return noisy.section(r) if "noisy" in r else None


def _priority_section(r: dict[str, Any], date: str) -> list[str] | None:
    return noisy.priority_section(r) if "priority" in r.get("admission", {}) else None


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "overhead",
        core.overhead,
        _of("overhead", lambda res, date: core.overhead_section(res)),
        core.overhead_targets,
    ),
    Scenario("compare", _stored("compare", compare.run), _of("compare", compare.section)),
    Scenario(
        "streaming",
        core.streaming,
        _of("streaming", lambda res, date: core.streaming_section(res)),
        core.streaming_targets,
    ),
    Scenario(
        "storm",
        core.storm,
        _of("storm", lambda res, date: core.storm_section(res)),
        core.storm_targets,
    ),
    Scenario("soak", core.soak, _of("soak", lambda res, date: core.soak_section(res))),
    Scenario(
        "multi",
        core.multi,
        _of("multi_replica", lambda res, date: core.multi_section(res)),
        core.multi_targets,
        page_name="multi_replica",
    ),
    Scenario(
        "engine",
        _engine,
        _of("engine", lambda res, date: engine.section(res, res.get("plot"))),
        _rows("engine", engine.targets),
    ),
    Scenario("admission", _stored("admission", admission.run), _priority_section),
    Scenario("noisy", _noisy, _noisy_section),
    Scenario(
        "prefix",
        _prefix,
        _of("prefix", lambda res, date: prefix_workload.section(res, res.get("plot"), date)),
        _rows("prefix", prefix_workload.targets),
    ),
    Scenario("lora", _stored("lora", lora.run), _of("lora", lambda res, date: lora.section(res))),
    Scenario("kv", _stored("kv", kv_workload.run), _of("kv", kv_workload.section)),
    Scenario(
        "console",
        _stored("console", console.run),
        _of("console", lambda res, date: console.section(res)),
        console.targets,
    ),
    Scenario("latency", _stored("latency", latency.run), _of("latency", latency.section)),
    Scenario("batch", _stored("batch", batch.run), _of("batch", batch.section)),
    Scenario("hop", _hop, _of("hop", lambda res, date: hop.lines(res))),
    Scenario("pd", _pd, _of("pd", lambda res, date: pd.section(res))),
    Scenario("picker", _stored("picker", picker.run), _of("picker", picker.section)),
    # Not in a full run: they need the real-engine venv (make engine-venv); `--only real`.
    Scenario(
        "real", _stored("real", real_engine.run), _of("real", real_engine.section), full=False
    ),
    Scenario(
        "kv_real", _stored("kv_real", kv_real.run), _of("kv_real", kv_real.section), full=False
    ),
    Scenario(
        "batch_real",
        _stored("batch_real", batch.run_real),
        _of("batch_real", batch.section_real),
        full=False,
    ),
    # The real-engine half is kv_real's run (its key filled too), then the hop beside the peers.
    Scenario("peers", _peers, _peers_section, full=False),
)

BY_NAME = {s.name: s for s in SCENARIOS}

# The page's order of sections (a full run writes them so; a partial run keeps the page's own)
# and the Targets table's order of rows: the order they read in, not the order they run in.
SECTION_ORDER = (
    "hop", "overhead", "compare", "streaming", "storm", "soak", "multi", "engine", "prefix",
    "lora", "pd", "picker", "console", "real", "kv", "kv_real", "peers", "latency", "noisy",
    "admission", "batch", "batch_real",
)  # fmt: skip
TARGET_ORDER = ("overhead", "console", "streaming", "storm", "engine", "prefix", "multi")


def _page() -> Page:
    sections: list[tuple[str, Section]] = []
    for name in SECTION_ORDER:
        s = BY_NAME[name]
        assert s.section is not None, f"{name}: in SECTION_ORDER without a section"
        sections.append((s.page_name or s.name, s.section))
    targets: list[Targets] = []
    for name in TARGET_ORDER:
        made = BY_NAME[name].targets
        assert made is not None, f"{name}: in TARGET_ORDER without targets"
        targets.append(made)
    left = {s.name for s in SCENARIOS if s.section} - set(SECTION_ORDER)
    left |= {s.name for s in SCENARIOS if s.targets} - set(TARGET_ORDER)
    assert not left, f"{sorted(left)}: a section or targets not placed on the page"
    return Page(tuple(sections), tuple(targets))


PAGE = _page()
