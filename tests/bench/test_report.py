"""A partial benchmark run (`python -m bench.run --only X`) rewrites only X's section of
docs/benchmarks.md: the other scenarios' figures stay as the last run wrote them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.kit.page import splice
from bench.kit.report import write_report
from bench.scenarios.registry import PAGE


def _report(results: dict[str, Any]) -> dict[str, Any]:
    machine = {"cpu": "x", "cores": 2, "python": "3", "nginx": "-", "date": "2026-01-01 00:00 UTC"}
    return {"machine": machine, "quick": False, "results": results}


def _prefix(hit: float) -> dict[str, Any]:
    row = {
        "hit_rate": hit,
        "ttft_p50_ms": 50.0,
        "ttft_p90_ms": 300.0,
        "ttft_p99_ms": 600.0,
        "tokens_s": 500.0,
        "full_prefill_share": 0.1,
        "requests": 320,
        "errors": 0,
        "reasons": {"prefix": 300, "load": 20},
    }
    return {
        "shape": {},
        "chat": {"least_inflight": {**row, "hit_rate": 0.3}, "cache_aware_redis": row},
    }


def test_a_partial_run_replaces_its_section_and_keeps_the_others(tmp_path: Path) -> None:
    soak = {"seconds": 240, "requests": 12345}
    write_report(_report({"soak": soak, "prefix": _prefix(0.8)}), {}, tmp_path, PAGE)
    page = tmp_path / "benchmarks.md"
    full = page.read_text()
    assert "12345" in full and "| cache_aware_redis | 0.800 |" in full

    merged = {"soak": soak, "prefix": _prefix(0.9)}
    write_report(
        _report({"prefix": _prefix(0.9)}), {}, tmp_path, PAGE, only=["prefix"], merged=merged
    )
    partial = page.read_text()
    section = partial.split("<!-- prefix:begin -->")[1].split("<!-- prefix:end -->")[0]
    assert (
        "| cache_aware_redis | 0.900 |" in section
        and "| cache_aware_redis | 0.800 |" not in section
    )
    assert partial.count("<!-- prefix:begin -->") == 1

    # Everything outside the prefix and Targets sections is byte for byte what the full run wrote.
    def outside(text: str) -> list[str]:
        parts = []
        for name in ("targets", "prefix"):
            head, rest = text.split(f"<!-- {name}:begin -->", 1)
            parts.append(head)
            text = rest.split(f"<!-- {name}:end -->", 1)[1]
        return [*parts, text]

    assert outside(partial) == outside(full)


def test_the_targets_table_shows_the_figure_its_section_shows(tmp_path: Path) -> None:
    """A partial run rewrites the Targets table from the saved results, so the table never quotes
    a figure that the scenario's own section no longer shows."""
    write_report(_report({"prefix": _prefix(0.8)}), {}, tmp_path, PAGE)
    page = tmp_path / "benchmarks.md"
    # least_inflight's hit rate is 0.3 in both runs: the ratio row moves from 0.8/0.3 to 0.9/0.3.
    assert "| 2.67 | yes |" in page.read_text()
    write_report(
        _report({"prefix": _prefix(0.9)}),
        {},
        tmp_path,
        PAGE,
        only=["prefix"],
        merged={"prefix": _prefix(0.9)},
    )
    table = page.read_text().split("<!-- targets:begin -->")[1].split("<!-- targets:end -->")[0]
    assert "| 3 | yes |" in table and "| 2.67 | yes |" not in table


def test_a_section_the_page_lacks_is_added_at_the_end() -> None:
    text = "# Benchmarks\n\n## Overhead\n\nold figures\n"
    out = splice(text, "prefix", "<!-- prefix:begin -->\nnew\n<!-- prefix:end -->")
    assert out.startswith(text.rstrip("\n")) and out.endswith("<!-- prefix:end -->\n")
    assert (
        splice(out, "prefix", "<!-- prefix:begin -->\nnewer\n<!-- prefix:end -->").count("new") == 1
    )
