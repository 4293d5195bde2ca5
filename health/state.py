"""Per-backend health as seen by this process, and the filter the proxy routes through.

Each writer owns its own flag (active probes, passive outlier detection, cooldowns); a backend
is routable when none is set and it is not draining.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.upstreams import Backend


@dataclass(slots=True)
class BackendHealth:
    failed_probe: bool = False
    cooldown_until: float = 0.0
    consecutive_failures: int = 0
    last_error: str | None = None


class HealthBook:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[str, BackendHealth] = {}

    def _get(self, name: str) -> BackendHealth:
        st = self._state.get(name)
        if st is None:
            st = self._state[name] = BackendHealth()
        return st

    def routable(self, backend: Backend, now: float) -> bool:
        st = self._state.get(backend.name)
        if backend.draining:
            return False
        return st is None or (not st.failed_probe and st.cooldown_until <= now)

    def eligible(self, backends: Sequence[Backend]) -> list[Backend]:
        now = self._clock()
        ok = [b for b in backends if self.routable(b, now)]
        if ok:
            return ok
        # Panic mode: when nothing looks healthy, try them all rather than fail everything.
        return [b for b in backends if not b.draining]

    def on_success(self, name: str) -> None:
        st = self._state.get(name)
        if st is not None and st.consecutive_failures:
            st.consecutive_failures = 0

    def on_failure(self, name: str, kind: str) -> None:
        st = self._get(name)
        st.consecutive_failures += 1
        st.last_error = kind

    def cool_down(self, name: str, seconds: float) -> None:
        st = self._get(name)
        st.cooldown_until = max(st.cooldown_until, self._clock() + seconds)

    def describe(self, name: str) -> dict[str, Any]:
        st = self._state.get(name) or BackendHealth()
        now = self._clock()
        return {
            "healthy": not st.failed_probe and st.cooldown_until <= now,
            "consecutive_failures": st.consecutive_failures,
            "cooldown_remaining": max(0.0, round(st.cooldown_until - now, 3)),
            "last_error": st.last_error,
        }
