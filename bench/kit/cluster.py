"""The benchmark's processes and loads: a Cluster of targets (tests/support/harness.py), routers in
front of mock upstreams, and a load measured against one of them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from bench.kit.loadgen import Result, run_load
from bench.kit.nginx import start_nginx
from bench.kit.procstat import cpu_seconds
from tests.support.harness import Cluster, Proc

ROOT = Path(__file__).resolve().parents[2]  # the checkout
CHAT = "/v1/chat/completions"


class Bench:
    """One run's cluster, options and figures: what every scenario's run function is given."""

    def __init__(
        self, quick: bool, soak_seconds: float | None = None, baseline_src: str | None = None
    ) -> None:
        self.quick = quick
        self.baseline_src = baseline_src  # overhead: also a router from this checkout (A/B)
        self.soak_seconds = soak_seconds
        self.cluster = Cluster()
        self.results: dict[str, Any] = {}
        self.samples: dict[str, list[float]] = {}
        self.check = False  # hop: the CPU/request gate against bench/hop_baseline.json

    # ---------- processes
    def mock(self, name: str, **kw: Any) -> Proc:
        return self.cluster.mock(name, **kw)

    def router(
        self, ups: list[Proc], workers: int = 1, src: str | None = None, **extra: Any
    ) -> Proc:
        cfg = {
            "backends": [
                {"name": f"b{i}", "url": u.url, "models": {"m": "mock-model"}}
                for i, u in enumerate(ups)
            ],
            **extra,
        }
        # One JSON line per request is part of the product; the benchmark keeps it on but sends
        # it to the log file, as a deployment would.
        # One hash seed for every router: the layout of its dicts and sets moves one process's
        # CPU per request by 1-4 % against another's of the same code (four identical routers
        # spread 0.6 % with one seed), which would drown the A/B comparisons (`--baseline-src`).
        env = {"SLUICEGATE_LOG_LEVEL": "warning", "PYTHONHASHSEED": "0"}
        return self.cluster.router(cfg, workers=workers, env=env, src=src)

    def nginx(self, ups: list[Proc]) -> Proc | None:
        return start_nginx(self.cluster, ups)

    # ---------- load
    def load(self, target: Proc, body: dict[str, Any], concurrency: int, **kw: Any) -> Result:
        payload = json.dumps(body).encode()
        return asyncio.run(run_load("127.0.0.1", target.port, CHAT, payload, concurrency, **kw))

    def measured(
        self, hop: Proc | None, target: Proc, body: dict[str, Any], concurrency: int, **kw: Any
    ) -> dict[str, Any]:
        cpu0 = cpu_seconds(hop.pid) if hop else 0.0
        r = self.load(target, body, concurrency, **kw)
        cpu1 = cpu_seconds(hop.pid) if hop else 0.0
        return {
            "ok": r.ok,
            "errors": r.errors,
            "aborted": r.aborted,
            "elapsed": r.elapsed,
            "ttfb": r.ttfb,
            "hop_cpu_s": cpu1 - cpu0,
            "loadgen_cpu_share": r.cpu_s / r.elapsed if r.elapsed else 0.0,
        }

    def rounds(
        self,
        targets: dict[tuple[str, int], Proc],
        body: dict[str, Any],
        concurrency: int,
        rounds: int,
        seconds: float,
    ) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
        """Each router (its own hop) warmed up, then loaded in turn for `rounds` rounds, each round
        starting one further along so no setting always runs first; per setting (a key's first
        part): the hop's CPU seconds, the requests answered, the errors."""
        names = dict.fromkeys(name for name, _ in targets)
        cpu = dict.fromkeys(names, 0.0)
        ok = dict.fromkeys(names, 0)
        errors = dict.fromkeys(names, 0)
        for router in targets.values():  # warm-up
            self.measured(router, router, body, concurrency, duration=1.0)
        keys = list(targets)
        for rnd in range(rounds):
            for name, i in keys[rnd % len(keys) :] + keys[: rnd % len(keys)]:
                router = targets[(name, i)]
                m = self.measured(router, router, body, concurrency, duration=seconds)
                cpu[name] += m["hop_cpu_s"]
                ok[name] += m["ok"]
                errors[name] += m["errors"]
        return cpu, ok, errors

    def compare_cpu(
        self,
        targets: dict[tuple[str, int], Proc],
        body: dict[str, Any],
        ratios: dict[str, tuple[str, str]],
        *,
        concurrency: int,
        rounds: int,
        seconds: float,
    ) -> dict[str, Any]:
        """`rounds()`, reported: router CPU ms per request by setting, the requests and errors,
        and each of `ratios` (name -> (setting, against)) as the ratio of their CPU per request;
        printed as one JSON line and returned."""
        cpu, ok, errors = self.rounds(targets, body, concurrency, rounds, seconds)
        per = {k: cpu[k] / ok[k] * 1000 for k in cpu}
        line = {
            "cpu_ms_per_req": per,
            "requests": ok,
            "errors": errors,
            **{name: per[a] / per[b] for name, (a, b) in ratios.items()},
            "rounds": rounds,
            "routers_per_setting": len(targets) // len(cpu),
            "seconds": seconds,
            "concurrency": concurrency,
        }
        print(json.dumps(line), flush=True)
        return line

    def close(self) -> None:
        self.cluster.close()


def short(obj: Any) -> Any:
    """`obj` with floats rounded to 3 places and lists cut to 8 items (printed and saved)."""
    if isinstance(obj, float):
        return round(obj, 3)
    if isinstance(obj, dict):
        return {k: short(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [short(v) for v in obj][:8]
    return obj
