"""`--only peers` and `--only kv_real` share one real-engine run: the page writes both sections
from it, with the peers' rows beside sluicegate's and issue 52's criteria as computed ratios."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.kit.peers import PEERS
from bench.kit.report import write_report
from bench.scenarios import kv_real
from bench.scenarios.registry import PAGE


def _row(hit: float, p50: float, p90: float) -> dict[str, Any]:
    return {
        "completed": 160, "failed": 0, "hit_rate": hit, "hit_rates": [hit], "ttft_p50_ms": p50,
        "ttft_p90_ms": p90, "ttft_p99_ms": p90 * 1.5, "itl_p50_ms": 15.0,
        "output_tokens_s": 200.0, "busier_share": 0.5, "reasons": {}, "rates": {},
    }  # fmt: skip


def _real() -> dict[str, Any]:
    pressured = {
        "least_load": _row(0.42, 3000, 5000),
        "cache_aware_approx": _row(0.80, 200, 1000),  # within 0.03 and 1.15x of the reference
        "cache_aware_events": _row(0.70, 200, 1000),  # 0.12 below the reference's hit rate
        "vllm-router cache_aware": _row(0.82, 190, 973),
    }
    roomy = {
        "least_load": _row(0.60, 100, 500),
        "cache_aware_approx": _row(0.84, 90, 400),
        "cache_aware_events": _row(0.84, 120, 600),  # slower than least_load: a loss
        "smg cache_aware": _row(0.84, 80, 450),
    }

    def size(blocks: int, targets: dict[str, Any]) -> dict[str, Any]:
        return {"kv_blocks": blocks, "prefix": {"rounds": 2, "targets": targets, "against": {}}}

    res = {
        "workload": "prefix_repetition",
        "random": "random",
        "peers": dict(PEERS),
        "sizes": {"roomy": size(64, roomy), "pressured": size(40, pressured)},
    }
    return {**res, "criteria": kv_real.criteria(res)}


def test_issue_52s_criteria_are_computed_from_the_pooled_figures() -> None:
    got = {(r["size"], r["target"]): r for r in kv_real.criteria(_real())}
    approx, events = (
        got[("pressured", "cache_aware_approx")],
        got[("pressured", "cache_aware_events")],
    )
    assert approx["against"] == "vllm-router cache_aware" and approx["met"]
    assert approx["hit_rate_diff"] == -0.02 and approx["ttft_p90_x"] == 1.03
    assert not events["met"] and events["hit_rate_diff"] == -0.12  # hit rate short
    assert got[("roomy", "cache_aware_approx")]["met"]
    assert not got[("roomy", "cache_aware_events")]["met"]  # TTFT p90 1.2x least_load's


def test_one_peers_run_writes_both_sections_with_the_peers_rows(tmp_path: Path) -> None:
    hop = {
        "rounds": 5, "policy": "cache_aware",
        "per_request": {
            k: {"rps": 500.0, "errors": 0, "cpu_ms_per_req": None if k == "direct" else 0.5}
            for k in ("direct", "nginx", "sluicegate", "vllm-router", "smg")
        },
        "cpu_vs_nginx": {"sluicegate": {"median": 2.0, "min": 1.9, "max": 2.1}},
        "burst": {"direct": {"ttft_p99_ms": 50.0, "added_p99_rounds_ms": [], "errors": 0}},
    }  # fmt: skip
    machine = {"cpu": "x", "cores": 2, "python": "3", "nginx": "-", "date": "2026-01-01 00:00 UTC"}
    results = {"kv_real": _real(), "peers": {"hop": hop}}
    write_report({"machine": machine, "quick": False, "results": results}, {}, tmp_path, PAGE)
    page = (tmp_path / "benchmarks.md").read_text()
    kv, rest = page.split("<!-- kv_real:begin -->")[1].split("<!-- kv_real:end -->")
    ours = rest.split("<!-- peers:begin -->")[1].split("<!-- peers:end -->")[0]
    assert "| pressured, prefix | cache_aware_events | vllm-router cache_aware | -0.12" in kv
    assert "| smg cache_aware | 80 | 450 |" in ours  # a peer's row beside sluicegate's
    assert "| sluicegate cache_aware_approx | 90 | 400 |" in ours
    assert "Lead on TTFT p90: sluicegate cache_aware_approx over smg cache_aware: 0.89x" in ours
    assert "| sluicegate | 500 | 0.5 | 2.00 (1.90-2.10) |" in ours
