"""The percentile every scenario reports."""

from __future__ import annotations

from collections.abc import Sequence


def pct(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (nan when there are none)."""
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")
