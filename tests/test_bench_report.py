"""A partial benchmark run (`python -m bench.run --only X`) rewrites only X's section of
docs/benchmarks.md: the other scenarios' figures stay as the last run wrote them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import splice, write_report


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
    write_report(_report({"soak": soak, "prefix": _prefix(0.8)}), {}, tmp_path)
    page = tmp_path / "benchmarks.md"
    full = page.read_text()
    assert "12345" in full and "| cache_aware_redis | 0.800 |" in full

    write_report(_report({"prefix": _prefix(0.9)}), {}, tmp_path, only=["prefix"])
    partial = page.read_text()
    section = partial.split("<!-- prefix:begin -->")[1].split("<!-- prefix:end -->")[0]
    assert (
        "| cache_aware_redis | 0.900 |" in section
        and "| cache_aware_redis | 0.800 |" not in section
    )
    assert partial.count("<!-- prefix:begin -->") == 1
    # Everything outside the prefix section is byte for byte what the full run wrote.
    assert partial.split("<!-- prefix:begin -->")[0] == full.split("<!-- prefix:begin -->")[0]
    assert partial.split("<!-- prefix:end -->")[1] == full.split("<!-- prefix:end -->")[1]


def test_a_section_the_page_lacks_is_added_at_the_end() -> None:
    text = "# Benchmarks\n\n## Overhead\n\nold figures\n"
    out = splice(text, "prefix", "<!-- prefix:begin -->\nnew\n<!-- prefix:end -->")
    assert out.startswith(text.rstrip("\n")) and out.endswith("<!-- prefix:end -->\n")
    assert (
        splice(out, "prefix", "<!-- prefix:begin -->\nnewer\n<!-- prefix:end -->").count("new") == 1
    )
