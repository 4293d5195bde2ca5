"""The console's live view (`GET <console.path>/api/live`): one JSON answer built from what this
process already holds. No scrape, probe or Redis call of its own beyond the in-flight counts
that `/admin/backends` reads too.

Sections: `backends` (compact admin rows: health and reason, draining, in flight, the engine's
last reading, KV-index size, adapters, when the engine was last read and last sent a KV event),
`routing` (router/ops/live.py: requests/s per backend and per reason, TTFT p50/p99 per backend
over the last minute, per-second series), `admission` (depth and oldest wait per band), `quotas`
(each named key's limits and what this process counts against them), `fallbacks` (the model
fallback chains, docs/fallbacks.md), `batch` (the jobs not yet ended, as the batch runner last
read them from Redis; None without `batch:`). Usage by the hour comes from `GET /admin/usage`,
which the page reads on its own, slower clock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from router.ops.live import Live
from router.request.admit.admission import Admission
from router.request.admit.quota import QuotaBook
from router.web.admin import BackendRows
from router.web.auth import ClientKeys

MAX_ROWS = 500  # backends listed; a discovered fleet past it is counted, not listed


def _row(full: dict[str, Any]) -> dict[str, Any]:
    engine = full.get("engine") or {}
    kv = full.get("kv_events_state") or {}
    lora = engine.get("lora") or {}
    return {
        "name": full["name"],
        "url": full["url"],
        "kind": full["kind"],
        "source": full["source"],
        "models": sorted(full["models"]),
        "weight": full["weight"],
        "max_inflight": full["max_inflight"],
        "draining": full["draining"],
        "healthy": full["healthy"],
        "reason": full["reason"],
        "in_flight": full["in_flight"],
        "waiting": engine.get("waiting"),
        "running": engine.get("running"),
        "kv_usage": engine.get("kv_usage"),
        "engine_stale": engine.get("stale"),
        "scraped_at": engine.get("scraped_at"),
        "kv_state": kv.get("state"),
        "kv_blocks": kv.get("blocks"),
        "kv_last_event": kv.get("last_event"),
        "adapters": lora.get("loaded", []),
    }


class LiveState:
    def __init__(
        self,
        rows: BackendRows,
        live: Live,
        admission: Admission | None,
        quotas: QuotaBook,
        keys: ClientKeys,
        actions: bool,
        refresh: float,
        wall: Callable[[], float] = time.time,
        fallbacks: list[dict[str, Any]] | None = None,
        batch: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self._fallbacks = fallbacks or []
        self._rows = rows
        self._live = live
        self._admission = admission
        self._quotas = quotas
        self._keys = keys
        self._actions = actions
        self._refresh = refresh
        self._wall = wall
        self._batch = batch  # the batch runner's jobs as of its last tick (None: batch off)

    def _quota_rows(self) -> list[dict[str, Any]]:
        out = []
        for lim in self._keys.limited():
            requests, tokens, parallel = self._quotas.in_use(lim.key_id)
            out.append(
                {
                    "key": lim.label,
                    "rpm": lim.rpm,
                    "rpm_used": round(requests),
                    "tpm": lim.tpm,
                    "tpm_used": round(tokens),
                    "max_parallel": lim.max_parallel,
                    "parallel": parallel,
                }
            )
        return out

    async def view(self) -> dict[str, Any]:
        backends = self._rows.fleet.registry.snapshot.backends
        shown = await self._rows(backends[:MAX_ROWS])
        admission = self._admission
        return {
            "now": round(self._wall(), 3),
            "worker": os.getpid(),
            "refresh": self._refresh,
            "actions": self._actions,
            "backends": [_row(r) for r in shown],
            "backends_total": len(backends),
            "routing": self._live.view(),
            "admission": None if admission is None else admission.bands(),
            "quotas": {"scope": self._quotas.kind, "keys": self._quota_rows()},
            "fallbacks": self._fallbacks,
            "batch": None if self._batch is None else self._batch(),
        }
