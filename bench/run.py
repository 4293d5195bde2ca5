"""The benchmark: sluicegate beside a direct connection (and nginx, when installed), one run.

    python -m bench.run --quick          # under 2 minutes
    python -m bench.run                  # the full run, about 19 minutes (soak, prefix, noisy)
    python -m bench.run --only overhead  # one scenario (its section of the docs is replaced,
                                         # the others are kept)
    python -m bench.run --only compare   # beside a textbook FastAPI proxy and LiteLLM
    python -m bench.run --only picker    # Envoy + `sluicegate epp` beside Envoy, the proxy, nginx
    python -m bench.run --quick --only overhead --baseline-src DIR   # A/B against a checkout
    python -m bench.run --only hop --check   # beside nginx and the floor; exit 1 when CPU per
                                             # request vs nginx grew > 5 % over the baseline

Targets are started and stopped here (mock upstreams, the router, nginx, redis-server), all on
127.0.0.1; loads alternate between targets in rounds so noise on this shared machine spreads
evenly. Results: bench/results/latest.json, a markdown table, and PNG plots (matplotlib, when
installed) under docs/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import uvloop

from bench.kit.cluster import ROOT, Bench, short
from bench.kit.report import write_report
from bench.scenarios.registry import BY_NAME, PAGE, SCENARIOS


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "nginx": subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
        if shutil.which("nginx")
        else "not installed",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> int:
    # Routers start as they are deployed (`python -m router.cli`), not forked from the test
    # harness's zygote: a measured process must not differ from the baseline's or the image's.
    os.environ["SLUICEGATE_TEST_FORK"] = "0"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", action="append", choices=sorted(BY_NAME))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--soak-seconds", type=float, help="soak length (default 240; 30 with --quick)")
    ap.add_argument(
        "--baseline-src", help="overhead: also a router from this checkout (A/B in one run)"
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="hop: exit 1 when CPU/request vs nginx grew > 5 %% over bench/hop_baseline.json",
    )
    args = ap.parse_args()
    uvloop.install()
    bench = Bench(args.quick, args.soak_seconds, args.baseline_src)
    bench.check = args.check
    started = time.monotonic()
    try:
        for name in args.only or [s.name for s in SCENARIOS if s.full]:
            BY_NAME[name].run(bench)
    finally:
        bench.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "machine": machine(),
        "quick": args.quick,
        "seconds": time.monotonic() - started,
        "results": bench.results,
    }
    saved = report
    if args.only and (out / "latest.json").exists():
        # A partial run keeps the last full run's figures (and header) beside its own.
        try:
            last = json.loads((out / "latest.json").read_text())
            updated = {**last.get("updated", {}), **dict.fromkeys(args.only, machine()["date"])}
            results = {**last.get("results", {}), **bench.results}
            saved = {**last, "results": results, "updated": updated}
        except (OSError, ValueError):
            pass
    (out / "latest.json").write_text(json.dumps(short(saved), indent=2))
    write_report(
        report, bench.samples, ROOT / "docs", PAGE, only=args.only, merged=saved["results"]
    )
    print(f"done in {report['seconds']:.0f}s; results in {out / 'latest.json'}", flush=True)
    gate = bench.results.get("hop", {}).get("check")
    return 1 if gate is not None and not gate["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
