"""`sluicegate status --url URL [--watch]`: the backend table an operator reads at 3 a.m.

Rows come from `GET /admin/backends` (health, in flight, the engine's own waiting/running/KV
use when its metrics are scraped, the KV-event feed's state and lag, weight, cooldown/ejection);
below the table, when any engine runs LoRA, each one's loaded, running and waiting adapters;
the error rate comes from the admin row when the router reports one, else from `GET /metrics`
(failed attempts / attempts; over the last refresh interval when watching). The admin token is
read from `SLUICEGATE_ADMIN_TOKEN` and only ever sent as a header.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

COLUMNS = (
    "BACKEND",
    "HEALTH",
    "IN FLIGHT",
    "WAITING",
    "RUNNING",
    "KV",
    "KV EVENTS",
    "WEIGHT",
    "EJECTED UNTIL",
    "ERROR RATE",
    "DETAIL",
)
CLEAR = "\x1b[H\x1b[2J"


class StatusError(Exception):
    """The router could not be asked; str() is the one-line reason."""


@dataclass
class ErrorRates:
    """Per-backend (attempts, errors) counters; rates over the window since the last sample."""

    last: dict[str, tuple[float, float]] = field(default_factory=dict)

    def update(self, counters: dict[str, tuple[float, float]]) -> dict[str, float | None]:
        rates: dict[str, float | None] = {}
        for name, (attempts, errors) in counters.items():
            prev_a, prev_e = self.last.get(name, (0.0, 0.0))
            if attempts < prev_a:  # a restarted router: counters began again
                prev_a, prev_e = 0.0, 0.0
            d_attempts, d_errors = attempts - prev_a, errors - prev_e
            rates[name] = d_errors / d_attempts if d_attempts > 0 else None
        self.last = counters
        return rates


def _headers() -> dict[str, str]:
    token = os.environ.get("SLUICEGATE_ADMIN_TOKEN")
    return {"authorization": f"Bearer {token}"} if token else {}


def fetch_backends(client: httpx.Client, url: str) -> list[dict[str, Any]]:
    try:
        r = client.get(url.rstrip("/") + "/admin/backends", headers=_headers())
    except httpx.HTTPError as exc:
        raise StatusError(f"cannot reach {url}: {type(exc).__name__}") from None
    if r.status_code in (401, 403):
        raise StatusError(
            f"{url} refused the admin request ({r.status_code}): set SLUICEGATE_ADMIN_TOKEN"
        )
    if r.status_code != 200:
        raise StatusError(f"{url}/admin/backends answered {r.status_code}")
    try:
        rows = r.json()
    except ValueError:
        raise StatusError(f"{url}/admin/backends did not answer JSON") from None
    if isinstance(rows, dict):
        rows = rows.get("backends", rows.get("data", []))
    if not isinstance(rows, list):
        raise StatusError(f"{url}/admin/backends answered an unexpected shape")
    return [row for row in rows if isinstance(row, dict)]


def fetch_error_counters(client: httpx.Client, url: str) -> dict[str, tuple[float, float]]:
    """backend -> (attempts, failed attempts) from /metrics; empty when it can't be read."""
    try:
        r = client.get(url.rstrip("/") + "/metrics", headers=_headers())
        if r.status_code != 200:
            return {}
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return {}
    attempts: dict[str, float] = {}
    errors: dict[str, float] = {}
    for family in families:
        for s in family.samples:
            backend = s.labels.get("backend")
            if backend is None:
                continue
            if s.name == "sluicegate_upstream_attempts_total":
                attempts[backend] = attempts.get(backend, 0.0) + s.value
            elif s.name == "sluicegate_upstream_errors_total":
                errors[backend] = errors.get(backend, 0.0) + s.value
    return {b: (a, errors.get(b, 0.0)) for b, a in attempts.items()}


def _future(value: Any, now: float) -> float | None:
    return float(value) if isinstance(value, int | float) and value > now else None


def _health(row: dict[str, Any], now: float) -> str:
    if row.get("draining"):
        return "draining"
    state = row.get("state")
    if isinstance(state, str):
        return state
    reason = str(row.get("reason") or "")
    if reason.startswith("probe failed"):
        return "probe failed"
    if _future(row.get("ejected_until"), now):
        return "ejected"
    if _future(row.get("cooldown_until"), now) or (row.get("cooldown_remaining") or 0) > 0:
        return "cooling"  # the backend asked for a pause (429/503 with Retry-After)
    return "unhealthy" if row.get("healthy") is False else "healthy"


def _ejected_until(row: dict[str, Any], now: float) -> str:
    """Until when it takes no traffic: an ejection's end, else a cooldown's (wall-clock epoch
    seconds from the router; ISO strings shown as given)."""
    for key in ("ejected_until", "cooldown_until"):
        if isinstance(row.get(key), str) and row[key]:
            return str(row[key])
    stamp = _future(row.get("ejected_until"), now) or _future(row.get("cooldown_until"), now)
    if stamp is None:
        remaining = row.get("cooldown_remaining") or 0
        if not isinstance(remaining, int | float) or remaining <= 0:
            return "-"
        stamp = now + remaining
    when = datetime.fromtimestamp(stamp, UTC).strftime("%H:%M:%SZ")
    return f"{when} (in {max(1, round(stamp - now))}s)"


def _detail(row: dict[str, Any]) -> str:
    if row.get("reason"):
        return str(row["reason"])
    if row.get("last_error"):
        return f"last error: {row['last_error']}"
    return "-"


def _rate(row: dict[str, Any], rates: dict[str, float | None]) -> str:
    value = row.get("error_rate")
    if not isinstance(value, int | float):
        value = rates.get(str(row.get("name")))
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return "-" if value is None else str(value)


def _engine(reading: Any) -> tuple[str, str, str]:
    """Waiting, running, KV use; `-` when not scraped, `?` suffix when the reading is stale."""
    if not isinstance(reading, dict) or not reading.get("scraped_at"):
        return ("-", "-", "-")
    mark = "?" if reading.get("stale") else ""
    kv = reading.get("kv_usage")
    kv_text = f"{kv * 100:.0f}%" if isinstance(kv, int | float) else "-"
    return (
        _num(reading.get("waiting")) + mark,
        _num(reading.get("running")) + mark,
        kv_text + mark,
    )


def _kv_events(state: Any) -> str:
    """The KV-event feed: its state and lag (`live 0.10s`), `-` when the backend has none."""
    if not isinstance(state, dict):
        return "-"
    lag = state.get("lag_seconds")
    text = str(state.get("state", "?"))
    return f"{text} {lag:.2f}s" if isinstance(lag, int | float) else text


def render_table(
    rows: Sequence[dict[str, Any]], rates: dict[str, float | None], now: float | None = None
) -> str:
    now = time.time() if now is None else now
    cells = [
        (
            str(row.get("name", "?")),
            _health(row, now),
            _num(row.get("in_flight", 0)),
            *_engine(row.get("engine")),
            _kv_events(row.get("kv_events_state")),
            _num(row.get("weight")),
            _ejected_until(row, now),
            _rate(row, rates),
            _detail(row),
        )
        for row in rows
    ]
    widths = [max(len(c[i]) for c in [COLUMNS, *cells]) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [COLUMNS, *cells]
    ]
    if not cells:
        lines.append("(no backends)")
    lines += _adapters(rows)
    return "\n".join(lines) + "\n"


def _names(value: Any) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, list) and value else "-"


def _adapters(rows: Sequence[dict[str, Any]]) -> list[str]:
    """`LORA ADAPTERS` lines: per engine with LoRA, loaded / running / waiting (max slots)."""
    out: list[str] = []
    for row in rows:
        engine = row.get("engine")
        lora = engine.get("lora") if isinstance(engine, dict) else None
        if not isinstance(lora, dict):
            continue
        if not out:
            out += ["", "LORA ADAPTERS"]
        out.append(
            f"{row.get('name', '?')}  loaded {_names(lora.get('loaded'))}"
            f"  running {_names(lora.get('running'))}  waiting {_names(lora.get('waiting'))}"
            f"  max {_num(lora.get('max_lora'))}"
        )
    return out


def run(
    url: str,
    watch: bool = False,
    interval: float = 2.0,
    count: int | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
) -> int:
    rates = ErrorRates()
    frames = 0
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            try:
                rows = fetch_backends(client, url)
                table = render_table(rows, rates.update(fetch_error_counters(client, url)))
            except StatusError as exc:
                if not watch:
                    print(f"sluicegate status: {exc}", file=err)
                    return 1
                table = f"sluicegate status: {exc}\n"
            if watch:
                stamp = datetime.now(UTC).strftime("%H:%M:%SZ")
                head = f"sluicegate status  {url}  {stamp}  every {interval:g}s, Ctrl-C stops\n\n"
                out.write(CLEAR + head + table)
            else:
                out.write(table)
            out.flush()
            frames += 1
            if not watch or (count is not None and frames >= count):
                return 0
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return 0
