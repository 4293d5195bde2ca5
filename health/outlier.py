"""Passive outlier detection policy: when real traffic says a backend is failing, for how long it
is ejected, and whether ejecting it would leave a model with too few backends.

Pure functions over numbers; `health.state.HealthBook` applies them to its per-backend state.
Ejection lasts `base_ejection` x times ejected, capped at `max_ejection` (Envoy's defaults:
30 s, 300 s). The ejection count decays to zero after a backend stays uneventful for
`max_ejection`, so one bad hour does not punish a backend forever.
"""

from __future__ import annotations

from router.core.errors import FailureKind
from router.core.settings import OutlierConfig

# Failures that count against a backend. A 4xx is the client's doing and a 429 is a polite
# request to slow down (handled as a cooldown), so neither counts; nor does our own full pool.
PASSIVE_FAILURES = frozenset({FailureKind.CONNECT, FailureKind.TIMEOUT, FailureKind.MID_STREAM})


def counts_as_failure(kind: FailureKind, status: int | None = None) -> bool:
    if kind is FailureKind.STATUS:
        return status is not None and 500 <= status <= 599
    return kind in PASSIVE_FAILURES


def should_eject(cfg: OutlierConfig, consecutive_failures: int) -> bool:
    return consecutive_failures >= cfg.consecutive_failures


def ejection_seconds(cfg: OutlierConfig, times_ejected: int) -> float:
    """How long the `times_ejected`-th ejection (1-based) lasts."""
    return min(cfg.base_ejection * max(1, times_ejected), cfg.max_ejection)


def times_ejected_after_rest(
    cfg: OutlierConfig, times_ejected: int, last_ejection_end: float | None, now: float
) -> int:
    """The ejection count to build on: reset once the backend behaved for `max_ejection`."""
    if last_ejection_end is not None and now - last_ejection_end >= cfg.max_ejection:
        return 0
    return times_ejected


def within_share(cfg: OutlierConfig, ejected_now: int, group_size: int) -> bool:
    """May one more of a model's `group_size` backends be ejected while `ejected_now` are?"""
    if group_size <= 0:
        return True
    return (ejected_now + 1) * 100 <= cfg.max_ejection_percent * group_size
