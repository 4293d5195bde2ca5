"""Each engine's time to first token (and per output token), learnt from this router's own requests.

A sample pairs what was known when a request was picked (`Features`: its uncached prompt tokens,
the router's prefill and decode tokens in flight on the engine, the engine's waiting, running and
KV usage readings) with what was then observed (its TTFT, its TPOT). `Learner` keeps a bounded,
stratified reservoir per engine (by the prompt's size, so that the rare long prompt of a
long-tailed mix is not pushed out by the many short ones, newest kept within each stratum) and
`refit()` fits, per engine and for the pool, a ridge least-squares line per target with
non-negative slopes (a load that makes an engine faster is collinearity, not physics: such a
slope is dropped and the rest refitted). `Models` is the frozen result the balancer reads.

Why linear: TTFT on an engine is close to (queued prefill tokens + this prompt's) x the engine's
per-token prefill time, plus a step's share per running sequence; a line per engine learns the
per-token time of a slow GPU, a hidden load's intercept, and needs neither numpy nor a tuning
knob. The queued tokens' slope is kept at least the own prompt's (`fit`). A 7x7 normal system
per engine is solved in pure Python: refit cost ~2 ms per engine of 256 samples
(bench/oneoff/latency_pick.py), off the request path (a runner chore).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

# The inputs, in order; a sample's features are a tuple of these six floats.
FEATURES = ("uncached", "prefill_inflight", "decode_inflight", "waiting", "running", "kv_usage")
Features = tuple[float, float, float, float, float, float]
STRATA = (256, 1024, 4096)  # uncached prompt tokens: below each a stratum, then one above all
PER_STRATUM = 64  # samples kept per stratum and engine: 256 per engine at most
POOLED_MAX = 1024  # samples the pooled fit reads at most (every k-th)
RIDGE = 1e-4  # relative to the samples' count: keeps a fit of a flat feature solvable
# Plus this, in RMS-scaled units: with few samples (fewer than the 7 terms) the slopes shrink
# towards 0 and the fit towards the engine's mean TTFT, instead of a wild slope on whichever
# reading happened to vary (negligible once an engine has a hundred samples).
RIDGE_MIN = 1.0
CEILING = 4.0  # a prediction is at most this times the slowest TTFT the engine was seen to take
# A fit's `spread`: this quantile of observed / predicted TTFT over its own samples. An SLO is
# counted as met by an engine when its prediction times its spread is within it: packing aims
# at the SLO's edge, and on the bare prediction half of what it packs there lands past it.
SPREAD_QUANTILE = 0.9


@dataclass(frozen=True, slots=True)
class Fit:
    """One engine's (or the pool's) lines: `ttft` and `tpot` are (intercept, slope per
    feature); `tpot` None when too few samples carried one. Predictions are bounded to
    [0, `ceiling`] seconds, so one wild extrapolation cannot exile an engine."""

    ttft: tuple[float, ...]
    tpot: tuple[float, ...] | None
    samples: int
    ceiling: float
    tpot_ceiling: float = 0.0
    spread: float = 1.0  # SPREAD_QUANTILE of observed / predicted TTFT, in [1, CEILING]

    def ttft_s(self, x: Features) -> float:
        w = self.ttft
        y = w[0] + w[1] * x[0] + w[2] * x[1] + w[3] * x[2] + w[4] * x[3] + w[5] * x[4] + w[6] * x[5]
        return 0.0 if y < 0.0 else (self.ceiling if y > self.ceiling else y)

    def tpot_s(self, x: Features) -> float | None:
        w = self.tpot
        if w is None:
            return None
        y = w[0] + w[1] * x[0] + w[2] * x[1] + w[3] * x[2] + w[4] * x[3] + w[5] * x[4] + w[6] * x[5]
        return 0.0 if y < 0.0 else min(y, self.tpot_ceiling)


@dataclass(frozen=True, slots=True)
class Models:
    """What the balancer reads: per engine, its own fit once it has enough samples, and the
    pooled fit of every engine's samples (None until the pool has enough)."""

    engines: Mapping[str, Fit] = field(default_factory=dict)
    pooled: Fit | None = None
    samples: Mapping[str, int] = field(default_factory=dict)  # backend -> samples held


NO_MODELS = Models()


@dataclass(slots=True)
class Sample:
    x: Features
    ttft: float  # seconds from dispatch to the first token
    # Seconds per output token after the first: set when its stream ends (the sample is taken
    # at the first token, so that a model is learnt one whole decode sooner), None until then.
    tpot: float | None


def _stratum(uncached: float) -> int:
    for i, top in enumerate(STRATA):
        if uncached < top:
            return i
    return len(STRATA)


class Learner:
    """The reservoir and the refit. Not thread-safe; one per process, fed by the request path
    (`add`, O(1)) and refitted by a runner chore (`refit`)."""

    def __init__(self, min_samples: int = 24, per_stratum: int = PER_STRATUM) -> None:
        self.min_samples = min_samples
        self._per = per_stratum
        self._by_engine: dict[str, list[deque[Sample]]] = {}

    def add(self, backend: str, sample: Sample) -> None:
        strata = self._by_engine.get(backend)
        if strata is None:
            if len(self._by_engine) >= 4096:  # backends come and go; keep what is recent
                self._by_engine.clear()
            strata = self._by_engine[backend] = [
                deque(maxlen=self._per) for _ in range(len(STRATA) + 1)
            ]
        strata[_stratum(sample.x[0])].append(sample)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the samples of backends no longer in `keep`."""
        kept = set(keep)
        for name in [n for n in self._by_engine if n not in kept]:
            del self._by_engine[name]

    def samples(self, backend: str) -> list[Sample]:
        return [s for d in self._by_engine.get(backend, ()) for s in d]

    def refit(self) -> Models:
        engines: dict[str, Fit] = {}
        counts: dict[str, int] = {}
        pooled: list[Sample] = []
        for name in list(self._by_engine):
            got = self.samples(name)
            counts[name] = len(got)
            pooled.extend(got)
            if len(got) >= self.min_samples:
                f = fit(got)
                if f is not None:
                    engines[name] = f
        pool = None
        if len(pooled) >= self.min_samples:
            step = max(1, len(pooled) // POOLED_MAX)
            pool = fit(pooled[::step])
        return Models(engines, pool, counts)


def fit(samples: Sequence[Sample]) -> Fit | None:
    """Ridge least squares of TTFT (and TPOT) on the features, slopes kept non-negative."""
    if not samples:
        return None
    xs = [s.x for s in samples]
    # TTFT is fitted on (uncached + queued prefill, queued prefill, ...): the queue's slope is
    # then the own prompt's plus a non-negative extra. A prompt's tokens take as long to
    # prefill queued ahead as they do as this one's own; the own-prompt slope is learnt from
    # every sample (prompt sizes vary), the queue's seldom (an engine the router never loaded
    # has seen no queue), and with no floor the ridge shrinks it to 0: an engine about to be
    # flooded would be predicted idle until the flood's first answers came back.
    ttft = _fit_line([(x[0] + x[1], *x[1:]) for x in xs], [s.ttft for s in samples])
    if ttft is not None:
        ttft = (ttft[0], ttft[1], ttft[1] + ttft[2], *ttft[3:])
    if ttft is None:
        return None
    with_tpot = [s for s in samples if s.tpot is not None]
    tpot = None
    tpot_ceiling = 0.0
    if len(with_tpot) >= max(4, len(samples) // 4):
        ys = [s.tpot for s in with_tpot if s.tpot is not None]
        tpot = _fit_line([s.x for s in with_tpot], ys)
        tpot_ceiling = CEILING * max(ys)
    ceiling = CEILING * max(s.ttft for s in samples)
    f = Fit(ttft, tpot, len(samples), ceiling, tpot_ceiling)
    ratios = sorted(s.ttft / p for s in samples if (p := f.ttft_s(s.x)) > 0.0)
    if not ratios:
        return f
    spread = ratios[int(SPREAD_QUANTILE * (len(ratios) - 1))]
    return Fit(ttft, tpot, len(samples), ceiling, tpot_ceiling, min(CEILING, max(1.0, spread)))


def _fit_line(xs: Sequence[Features], ys: Sequence[float]) -> tuple[float, ...] | None:
    n = len(xs)
    k = len(FEATURES)
    # Scale each feature by its root mean square (not its largest: one long prompt of a long
    # tail would shrink the rest to nothing), so that one ridge weight fits all.
    scale = [math.sqrt(sum(x[j] * x[j] for x in xs) / n) or 1.0 for j in range(k)]
    rows = [(1.0, *(x[j] / scale[j] for j in range(k))) for x in xs]
    m = k + 1
    xtx = [[0.0] * m for _ in range(m)]
    xty = [0.0] * m
    for r, y in zip(rows, ys, strict=True):
        for i in range(m):
            ri = r[i]
            if ri == 0.0:
                continue
            xty[i] += ri * y
            row = xtx[i]
            for j in range(i, m):
                row[j] += ri * r[j]
    for i in range(m):
        for j in range(i):
            xtx[i][j] = xtx[j][i]
    ridge = RIDGE * n + RIDGE_MIN
    active = list(range(m))
    while True:
        w = _solve(
            [[xtx[i][j] + (ridge if i == j and i else 0.0) for j in active] for i in active],
            [xty[i] for i in active],
        )
        if w is None:
            return None
        worst = min(range(1, len(active)), key=lambda i: w[i], default=None)
        if worst is None or w[worst] >= 0.0:
            break
        del active[worst]  # a negative slope: that feature out, the rest again
    full = [0.0] * m
    for i, wi in zip(active, w, strict=True):
        full[i] = wi
    return (full[0], *(full[j + 1] / scale[j] for j in range(k)))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None for a singular system."""
    n = len(b)
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-12:
            return None
        if piv != col:
            a[col], a[piv] = a[piv], a[col]
            b[col], b[piv] = b[piv], b[col]
        p = a[col][col]
        for r in range(col + 1, n):
            f = a[r][col] / p
            if f:
                ar, ac = a[r], a[col]
                for c in range(col, n):
                    ar[c] -= f * ac[c]
                b[r] -= f * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))
        x[r] = s / a[r][r]
    return x
