"""Turn a benchmark run into docs/benchmarks.md tables and PNG plots.

The page is made of the scenarios' own sections and Targets rows, handed in as data (a `Page`,
from the scenario registry, bench/scenarios/registry.py); this module knows no scenario.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.kit.page import fmt, marked, splice_page, table

# One row of the Targets table: target, goal, what the run measured (formatted here), and
# whether it is met (None: not judged).
Row = tuple[str, str, Any, bool | None]
# A scenario's rows of the Targets table, from a run's results (none when they lack its figures).
Targets = Callable[[dict[str, Any]], Sequence[Row]]
# A scenario's section of the page, from a run's results and its date: its lines, or None when
# the results have no figures of its.
Section = Callable[[dict[str, Any], str], list[str] | None]


@dataclass(frozen=True)
class Page:
    """What the page shows, in the page's order: each section's name (its markers) and maker,
    and the makers of the Targets table's rows."""

    sections: tuple[tuple[str, Section], ...]
    targets: tuple[Targets, ...]


def plots(samples: dict[str, list[float]], docs: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    ttfb = {k: v for k, v in samples.items() if not k.endswith("_rss") and v}
    if ttfb:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for k, v in sorted(ttfb.items()):
            xs = sorted(x * 1000 for x in v)
            ax.plot(xs, [i / len(xs) for i in range(len(xs))], label=k)
        ax.set_xscale("log")
        ax.set_xlabel("time to first chunk (ms, log)")
        ax.set_ylabel("fraction of requests")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(docs / "bench-ttfc.png", dpi=100)
        plt.close(fig)
        made.append("bench-ttfc.png")
    rss = {k: v for k, v in samples.items() if k.endswith("_rss") and v}
    if rss:
        fig, ax = plt.subplots(figsize=(8, 4))
        for k, v in sorted(rss.items()):
            ax.plot(range(len(v)), v, label=k)
        ax.set_xlabel("sample")
        ax.set_ylabel("router RSS (MB)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(docs / "bench-rss.png", dpi=100)
        plt.close(fig)
        made.append("bench-rss.png")
    return made


def targets(r: dict[str, Any], page: Page) -> list[tuple[str, str, str, str]]:
    """Issue targets beside what this run measured."""
    rows: list[tuple[str, str, str, str]] = []
    for made in page.targets:
        for name, goal, value, ok in made(r):
            rows.append((name, goal, fmt(value), "-" if ok is None else ("yes" if ok else "no")))
    return rows


def targets_section(results: dict[str, Any], page: Page) -> list[str]:
    """The Targets table, made from `results` on every write: a partial run passes the last full
    run's results merged with its own, so each row shows what its scenario's section shows."""
    rows = targets(results, page)
    if not rows:
        return []
    return ["## Targets", "", table([("target", "goal", "measured", "met"), *rows]), ""]


def write_report(
    report: dict[str, Any],
    samples: dict[str, list[float]],
    docs: Path,
    page: Page,
    only: list[str] | None = None,
    merged: dict[str, Any] | None = None,
) -> None:
    """The whole page; with `only` (a partial run) and a page already there, just the sections
    of the scenarios that ran, and the Targets table from `merged` (the saved results)."""
    docs.mkdir(parents=True, exist_ok=True)
    md = docs / "benchmarks.md"
    if only and md.exists():
        splice_page(
            md,
            [
                ("targets", targets_section(merged or report["results"], page)),
                *sections(report, page),
            ],
        )
        return
    r = report["results"]
    m = report["machine"]
    out = [
        "# Benchmarks",
        "",
        "Produced by `make bench` (`python -m bench.run`"
        + (" --quick" if report["quick"] else "")
        + f"), {m['date']}.",
        f"Machine: {m['cpu']}, {m['cores']} cores shared by the load generator, the mock "
        f"upstreams and the router; Python {m['python']}; {m['nginx']}.",
        "All figures come from one run; compare ratios, not absolute numbers.",
        "",
    ]
    out += [*marked("targets", targets_section(r, page)), ""]
    for name, lines in sections(report, page):
        out += [*marked(name, lines), ""]
    for png in plots(samples, docs):
        out += [f"![{png}]({png})", ""]
    reading = Path(__file__).resolve().parents[1] / "reading.md"
    if reading.exists():
        out += [reading.read_text()]
    md.write_text("\n".join(out))


def sections(report: dict[str, Any], page: Page) -> list[tuple[str, list[str]]]:
    """Each scenario of this run that has a section of the page: (name, its lines)."""
    found: list[tuple[str, list[str]]] = []
    for name, made in page.sections:
        lines = made(report["results"], report["machine"]["date"])
        if lines is not None:
            found.append((name, lines))
    return found
