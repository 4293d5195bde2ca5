"""The percentile every scenario reports, and the alternating rounds that compare targets fairly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def pct(values: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile of `values` (nan when there are none)."""
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


@dataclass
class Tally:
    """One target's rounds, summed: CPU seconds by the role of the process that spent them."""

    ok: int = 0
    errors: int = 0
    elapsed: float = 0.0
    ttfb: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)


# One load of `seconds` against a target: answered, errors, elapsed, first-byte times, CPU by role.
Load = Callable[[str, float], tuple[int, int, float, list[float], dict[str, float]]]


def alternating_rounds(
    targets: Sequence[str], load: Load, rounds: int, seconds: float
) -> dict[str, Tally]:
    """Each target warmed up (connections, pools, first-call caches), then loaded in turn for
    `rounds` rounds, each round starting one further along so no target always runs first."""
    for k in targets:
        load(k, 1.0)
    tallies = {k: Tally() for k in targets}
    order = list(targets)
    for rnd in range(rounds):
        for k in order[rnd % len(order) :] + order[: rnd % len(order)]:
            ok, errors, elapsed, ttfb, spent = load(k, seconds)
            t = tallies[k]
            t.ok += ok
            t.errors += errors
            t.elapsed += elapsed
            t.ttfb += ttfb
            for role, cpu in spent.items():
                t.cpu[role] = t.cpu.get(role, 0.0) + cpu
    return tallies
