"""`sluicegate status` run as a real process against a real router and mock backends."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from router.tools.status import ErrorRates, render_table
from tests.support.harness import ROOT, Cluster, Proc, backend, control, free_port

BASE_EJECTION_S = 30.0  # outlier.base_ejection: the first ejection lasts this long


@pytest.fixture(scope="module")
def fleet(module_procs: Cluster) -> dict[str, Proc]:
    good = module_procs.mock("good", itl_ms=40, tokens=300)
    cool = module_procs.mock("cool", tokens=2)
    dead = f"http://127.0.0.1:{free_port()}"
    router = module_procs.router(
        {
            "backends": [
                backend("good", good, {"m": "mock-model"}, weight=3),
                backend("cool", cool, {"c": "mock-model"}),
                {"name": "dead", "url": dead, "models": ["d"]},
            ],
            # `dead` is its model's only backend: let the outlier detector eject it anyway.
            "outlier": {"max_ejection_percent": 100, "base_ejection": BASE_EJECTION_S},
            # One probe at start, then none during the module: `dead` is out by ejection (what
            # the test reads), not by failed probes, however slowly the tests before it run.
            "health": {"interval": 300, "unhealthy_interval": 300},
        },
        env={"SLUICEGATE_ADMIN_TOKEN": "status-admin-token-123"},
    )
    return {"good": good, "cool": cool, "router": router}


def status(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "router.cli", "status", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={"SLUICEGATE_ADMIN_TOKEN": "status-admin-token-123", "PATH": "/usr/bin:/bin"},
        stdin=subprocess.DEVNULL,
    )


def table(text: str) -> dict[str, dict[str, str]]:
    """Rows of the table keyed by backend, cells keyed by column (split on the header's
    column starts)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = next(i for i, ln in enumerate(lines) if ln.startswith("BACKEND"))
    head = lines[header]
    names = [
        "BACKEND",
        "HEALTH",
        "IN FLIGHT",
        "WAITING",
        "RUNNING",
        "KV",
        "WEIGHT",
        "EJECTED UNTIL",
        "ERROR RATE",
        "DETAIL",
    ]
    starts = [head.index(n) for n in names]
    rows = {}
    for ln in lines[header + 1 :]:
        cells = [
            ln[s : (starts[i + 1] if i + 1 < len(starts) else None)].strip()
            for i, s in enumerate(starts)
        ]
        rows[cells[0]] = dict(zip(names, cells, strict=True))
    return rows


@pytest.fixture
def held_stream(fleet: dict[str, Proc]) -> Iterator[None]:
    with (
        httpx.Client(timeout=10) as c,
        c.stream(
            "POST",
            fleet["router"].url + "/v1/chat/completions",
            json={"model": "m", "stream": True},
        ) as r,
    ):
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        yield


def test_table_shows_in_flight_weight_health_and_error_rate(
    fleet: dict[str, Proc], held_stream: None
) -> None:
    router = fleet["router"]
    for _ in range(2):
        assert httpx.post(router.url + "/v1/completions", json={"model": "d"}).status_code == 502
    done = status("--url", router.url)
    assert done.returncode == 0, done.stderr
    rows = table(done.stdout)
    assert set(rows) == {"good", "cool", "dead"}
    assert rows["good"]["IN FLIGHT"] == "1"
    assert rows["good"]["WEIGHT"] == "3"
    assert rows["good"]["HEALTH"] == "healthy"
    assert rows["dead"]["ERROR RATE"] == "100.0%"
    assert rows["dead"]["DETAIL"] == "last error: connect"
    assert rows["good"]["ERROR RATE"] == "0.0%"
    assert rows["cool"]["ERROR RATE"] == "-"  # no attempts yet
    assert "status-admin-token-123" not in done.stdout + done.stderr


def test_cooling_backend_shows_until_when(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    started = time.monotonic()
    control(fleet["cool"], fail_status=503, retry_after=120)
    try:
        r = httpx.post(router.url + "/v1/completions", json={"model": "c"})
        assert r.status_code == 503
    finally:
        control(fleet["cool"], fail_status=0, retry_after=None)
    rows = table(status("--url", router.url).stdout)
    elapsed = time.monotonic() - started
    assert rows["cool"]["HEALTH"] == "cooling"
    until = rows["cool"]["EJECTED UNTIL"]
    assert until.endswith("s)") and "(in " in until, until
    seconds = int(until.split("(in ")[1].rstrip("s)"))
    assert 120 - elapsed - 1 <= seconds <= 120


def test_watch_refreshes_and_stops_after_count(fleet: dict[str, Proc]) -> None:
    started = time.monotonic()
    done = status("--url", fleet["router"].url, "--watch", "--interval", "0.2", "--count", "3")
    assert done.returncode == 0, done.stderr
    frames = done.stdout.split("\x1b[H\x1b[2J")[1:]
    assert len(frames) == 3
    assert all("BACKEND" in f and "good" in f for f in frames)
    assert time.monotonic() - started >= 0.4


def test_ejected_backend_shows_reason_and_until_when(fleet: dict[str, Proc]) -> None:
    router = fleet["router"]
    started = time.monotonic()
    for _ in range(6):  # the outlier detector ejects after 5 failures in a row
        assert httpx.post(router.url + "/v1/completions", json={"model": "d"}).status_code == 502
    rows = table(status("--url", router.url).stdout)
    elapsed = time.monotonic() - started  # a loaded machine's slow CLI start included
    assert rows["dead"]["HEALTH"] == "ejected"
    assert rows["dead"]["DETAIL"].startswith("ejected: 5 consecutive failures")
    seconds = int(rows["dead"]["EJECTED UNTIL"].split("(in ")[1].rstrip("s)"))
    assert BASE_EJECTION_S - elapsed - 1 <= seconds <= BASE_EJECTION_S


def test_unreachable_router_is_one_line_and_exit_1() -> None:
    done = status("--url", f"http://127.0.0.1:{free_port()}")
    assert done.returncode == 1
    assert done.stderr.strip().startswith("sluicegate status: cannot reach")
    assert done.stdout == ""


def test_fields_a_newer_router_reports_are_used() -> None:
    rows = [
        {
            "name": "x",
            "healthy": False,
            "in_flight": 4,
            "weight": 1.5,
            "ejected_until": 1060.0,
            "error_rate": 0.25,
            "last_error": "status_503",
        },
        {"name": "y", "state": "probing", "in_flight": 0, "weight": 1.0},
    ]
    rows.append({"name": "z", "healthy": False, "reason": "probe failed (timeout)"})
    rows.append({"name": "w", "healthy": False, "ejected_until": 999.0})  # already over
    out = table(render_table(rows, {}, now=1000.0))
    assert out["x"]["HEALTH"] == "ejected"
    assert out["x"]["EJECTED UNTIL"] == "00:17:40Z (in 60s)"
    assert out["x"]["ERROR RATE"] == "25.0%"
    assert out["x"]["DETAIL"] == "last error: status_503"
    assert out["y"]["HEALTH"] == "probing"
    assert out["y"]["EJECTED UNTIL"] == "-"
    assert out["z"]["HEALTH"] == "probe failed"
    assert out["z"]["DETAIL"] == "probe failed (timeout)"
    assert out["w"]["HEALTH"] == "unhealthy"
    assert out["w"]["EJECTED UNTIL"] == "-"


def test_error_rate_is_over_the_last_window() -> None:
    rates = ErrorRates()
    assert rates.update({"a": (10, 5)}) == {"a": 0.5}
    assert rates.update({"a": (20, 5)}) == {"a": 0.0}
    assert rates.update({"a": (20, 5)}) == {"a": None}  # nothing sent in the window
    assert rates.update({"a": (4, 4)}) == {"a": 1.0}  # the router restarted
