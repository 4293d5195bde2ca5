"""Turn a benchmark run into docs/benchmarks.md tables and PNG plots.

Each scenario's section sits between `<!-- name:begin -->` and `<!-- name:end -->`: a partial run
(`--only`) replaces the sections of the scenarios it ran (or adds them at the end) and keeps
everything else in the page as the last run wrote it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _table(rows: list[tuple[str, ...]]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


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


def targets(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """Issue targets beside what this run measured."""
    rows: list[tuple[str, str, str, str]] = []

    def add(name: str, goal: str, value: Any, ok: bool | None) -> None:
        rows.append((name, goal, _fmt(value), "-" if ok is None else ("yes" if ok else "no")))

    o = r.get("overhead", {}).get("c32")
    if o:
        vs_nginx = o.get("router_vs_nginx_rps")
        add(
            "overhead c=32: req/s vs nginx",
            ">= 0.5",
            vs_nginx,
            None if vs_nginx is None else vs_nginx >= 0.5,
        )
        cpu = o["router"]["cpu_ms_per_req"]
        add("overhead c=32: router CPU ms/request", "<= 1", cpu, cpu <= 1)
        added = o["router_added_ttfb_p50_ms"]
        add("overhead c=32: added TTFC p50 ms", "<= 2", added, added <= 2)
    co = r.get("console")
    if co:
        share = co["pages_cpu_share_percent"]
        add("console: 5 open pages, router CPU % of a core", "<= 1", share, share <= 1)
    st = r.get("streaming")
    if st:
        add(
            "streaming: added TTFC p99 ms",
            "<= 10",
            st["added_ttfb_p99_ms"],
            st["added_ttfb_p99_ms"] <= 10,
        )
        rss = st["router"]["peak_rss_mb"]
        add("streaming: router peak RSS MB", "<= 150", rss, rss <= 150)
    sm = r.get("storm")
    if sm:
        w = sm["waste_percent"]
        add("storm: waste %", "<= 1", w, w is not None and w <= 1)
        add("storm: in flight afterwards", "0", sm["inflight_after"], sm["inflight_after"] == 0)
        grow = (sm["rss_second_half_mean_mb"] or 0) - (sm["rss_first_half_mean_mb"] or 0)
        add("storm: RSS growth, 2nd half vs 1st (MB)", "~0", grow, grow < 5)
        add(
            "storm: open fds before -> after",
            "no growth",
            f"{sm['fds_before']} -> {sm['fds_after']}",
            sm["fds_after"] <= sm["fds_before"] + 2,
        )
    if "engine" in r:
        from bench.engine import targets as engine_targets

        for name, goal, value, ok in engine_targets(r["engine"]):
            add(name, goal, value, ok)
    if "prefix" in r:
        from bench.prefix_workload import targets as prefix_targets

        for name, goal, value, met in prefix_targets(r["prefix"]):
            add(name, goal, value, met)
    mr = r.get("multi_replica")
    if mr:
        add("multi-replica: 2 routers vs 1 (req/s)", ">= 1.7", mr["ratio"], mr["ratio"] >= 1.7)
    return rows


def _marked(name: str, lines: list[str]) -> list[str]:
    return [f"<!-- {name}:begin -->", *lines, f"<!-- {name}:end -->"]


def splice(text: str, name: str, block: str) -> str:
    """`text` with scenario `name`'s marked section replaced by `block` (or added at the end)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


def splice_page(page: Path, named: list[tuple[str, list[str]]]) -> None:
    """Replace (or add) these scenarios' marked sections of the page, keeping the rest."""
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    for name, lines in named:
        text = splice(text, name, "\n".join(_marked(name, lines)))
    page.write_text(text)


def targets_section(results: dict[str, Any]) -> list[str]:
    """The Targets table, made from `results` on every write: a partial run passes the last full
    run's results merged with its own, so each row shows what its scenario's section shows."""
    rows = targets(results)
    if not rows:
        return []
    return ["## Targets", "", _table([("target", "goal", "measured", "met"), *rows]), ""]


def write_report(
    report: dict[str, Any],
    samples: dict[str, list[float]],
    docs: Path,
    only: list[str] | None = None,
    merged: dict[str, Any] | None = None,
) -> None:
    """The whole page; with `only` (a partial run) and a page already there, just the sections
    of the scenarios that ran, and the Targets table from `merged` (the saved results)."""
    docs.mkdir(parents=True, exist_ok=True)
    page = docs / "benchmarks.md"
    if only and page.exists():
        splice_page(
            page,
            [("targets", targets_section(merged or report["results"])), *sections(report)],
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
    out += [*_marked("targets", targets_section(r)), ""]
    for name, lines in sections(report):
        out += [*_marked(name, lines), ""]
    for png in plots(samples, docs):
        out += [f"![{png}]({png})", ""]
    reading = Path(__file__).with_name("reading.md")
    if reading.exists():
        out += [reading.read_text()]
    page.write_text("\n".join(out))


def sections(report: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """Each scenario of this run that has a section of the page: (name, its lines)."""
    r = report["results"]
    found: list[tuple[str, list[str]]] = []
    if "hop" in r:
        from bench.hop import lines

        found.append(("hop", lines(r["hop"])))
    if "overhead" in r:
        out = ["## Overhead (64-token streams, no token delay)", ""]
        rows = [
            (
                "concurrency",
                "target",
                "req/s",
                "TTFC p50 ms",
                "TTFC p99 ms",
                "hop CPU ms/req",
                "loadgen CPU share",
            )
        ]
        for c, row in r["overhead"].items():
            for k in ("direct", "nginx", "router"):
                if k in row:
                    v = row[k]
                    rows.append(
                        (
                            c[1:],
                            k,
                            _fmt(v["rps"]),
                            _fmt(v["ttfb_p50_ms"]),
                            _fmt(v["ttfb_p99_ms"]),
                            _fmt(v["cpu_ms_per_req"]),
                            _fmt(v["loadgen_cpu_share"]),
                        )
                    )
        out += [_table(rows), ""]
        rows = [
            (
                "concurrency",
                "router/direct req/s",
                "router/nginx req/s",
                "added TTFC p50 ms",
                "added TTFC p99 ms",
            )
        ]
        for c, row in r["overhead"].items():
            rows.append(
                (
                    c[1:],
                    _fmt(row["router_vs_direct_rps"]),
                    _fmt(row.get("router_vs_nginx_rps")),
                    _fmt(row["router_added_ttfb_p50_ms"]),
                    _fmt(row["router_added_ttfb_p99_ms"]),
                )
            )
        out += [_table(rows), ""]
        found.append(("overhead", out))
    if "compare" in r:
        from bench.compare import section as compare_section

        found.append(("compare", compare_section(r["compare"], report["machine"]["date"])))
    for key, title in (
        ("streaming", "Realistic streaming (500 streams, 20 ms/token, 256 tokens)"),
        ("storm", "Disconnect storm (500 users, close after the 5th chunk)"),
        ("soak", "Soak (mixed streams, disconnects, non-streaming)"),
        ("multi_replica", "Multi-replica (Redis in-flight store)"),
    ):
        if key in r:
            found.append(
                (key, [f"## {title}", "", "```json", json.dumps(r[key], indent=2), "```", ""])
            )
    if "engine" in r:
        from bench.engine import section as engine_section

        found.append(("engine", engine_section(r["engine"], r["engine"].get("plot"))))
    if "prefix" in r:
        from bench.prefix_workload import section as prefix_section

        p = r["prefix"]
        found.append(("prefix", prefix_section(p, p.get("plot"), report["machine"]["date"])))
    if "lora" in r:
        from bench.lora import section as lora_section

        found.append(("lora", lora_section(r["lora"])))
    if "pd" in r:
        from bench.pd import section as pd_section

        found.append(("pd", pd_section(r["pd"])))
    if "console" in r:
        from bench.console import section as console_section

        found.append(("console", console_section(r["console"])))
    if "real" in r:
        from bench.real_engine import section as real_section

        found.append(("real", real_section(r["real"], report["machine"]["date"])))
    if "kv" in r:
        from bench.kv_workload import section as kv_section

        found.append(("kv", kv_section(r["kv"], report["machine"]["date"])))
    if "kv_real" in r:
        from bench.kv_real import section as kv_real_section

        found.append(("kv_real", kv_real_section(r["kv_real"], report["machine"]["date"])))
    if "noisy" in r:
        from bench.noisy import section as noisy_section

        found.append(("noisy", noisy_section(r)))
    if "priority" in r.get("admission", {}):
        from bench.noisy import priority_section

        found.append(("admission", priority_section(r)))
    return found
