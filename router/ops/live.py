"""The last two minutes of routing, second by second, in memory: what the console's live view reads.

`Live` is a ring of `SECONDS` one-second slots. Three writers, each a few dict operations and no
allocation once a slot's names are known: `routed(backend, reason)` at each routing decision,
`answered(backend, ttft)` when a request ends, `queued(delta)` when the admission queue moves.
A slot is reused (cleared) when its second comes round again, so memory is bounded by
`SECONDS` x (`MAX_NAMES` names + `MAX_SAMPLES` TTFT samples per backend) whatever the traffic;
past a bound a second's extra names count under `OTHER` and extra samples are not kept (its
percentiles then come from its first `MAX_SAMPLES` answers). `view(now)` does the sums and the
sorts, on the reader's time: per backend and per reason requests/s and TTFT p50/p99 over the last
`WINDOW` seconds, and per-second series for sparklines. Each worker keeps its own. Cost on the
request path: about 2 us per request on the benchmark's shared machine, ~0.2 % of the router's
CPU per streamed request (`python -m bench.run --only console`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

SECONDS = 120  # slots: the last minute for rates and percentiles, two for the sparklines
WINDOW = 60  # seconds the rates and percentiles cover
MAX_NAMES = 256  # distinct backends (and reasons) one second counts by name
MAX_SAMPLES = 64  # TTFT samples one second keeps per backend
MAX_SLOT_SAMPLES = 1024  # and over all backends
OTHER = "_other"


class _Slot:
    __slots__ = (
        "answered",
        "backends",
        "queue_end",
        "queue_max",
        "reasons",
        "samples",
        "sec",
        "ttft",
    )

    def __init__(self) -> None:
        self.sec = -1
        self.backends: dict[str, int] = {}  # routing decisions per backend
        self.reasons: dict[str, int] = {}  # routing decisions per reason
        self.ttft: dict[str, list[float]] = {}  # backend -> seconds to the first content token
        self.samples = 0
        self.answered = 0
        self.queue_max = self.queue_end = 0

    def reset(self, sec: int, queue: int) -> None:
        self.sec = sec
        self.backends.clear()
        self.reasons.clear()
        self.ttft.clear()
        self.samples = self.answered = 0
        self.queue_max = self.queue_end = queue


def _count(into: dict[str, int], name: str) -> None:
    n = into.get(name)
    if n is not None:
        into[name] = n + 1
    elif len(into) < MAX_NAMES:
        into[name] = 1
    else:
        into[OTHER] = into.get(OTHER, 0) + 1


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Live:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._slots = [_Slot() for _ in range(SECONDS)]
        self._queue = 0  # requests in the admission queue now
        self._view: tuple[int, dict[str, Any]] | None = None

    def _slot(self) -> _Slot:
        sec = int(self._clock())
        slot = self._slots[sec % SECONDS]
        if slot.sec != sec:
            slot.reset(sec, self._queue)
        return slot

    def routed(self, backend: str, reason: str) -> None:
        slot = self._slot()
        # Inlined `_count` twice: this runs on every routing decision.
        into = slot.backends
        n = into.get(backend)
        if n is not None:
            into[backend] = n + 1
        else:
            _count(into, backend)
        into = slot.reasons
        n = into.get(reason)
        if n is not None:
            into[reason] = n + 1
        else:
            _count(into, reason)

    def answered(self, backend: str, ttft: float | None) -> None:
        slot = self._slot()
        slot.answered += 1
        if ttft is None or slot.samples >= MAX_SLOT_SAMPLES:
            return
        samples = slot.ttft.get(backend)
        if samples is None:
            samples = slot.ttft[backend] = []
        if len(samples) < MAX_SAMPLES:
            samples.append(ttft)
            slot.samples += 1

    def queued(self, delta: int) -> None:
        self._queue += delta
        slot = self._slot()
        slot.queue_end = self._queue
        if self._queue > slot.queue_max:
            slot.queue_max = self._queue

    def view(self) -> dict[str, Any]:
        """Rates and percentiles over the last `WINDOW` whole seconds, series over `SECONDS`.
        Whole seconds do not change once past: the view is built at most once a second, however
        many pages read it."""
        now = int(self._clock())
        if self._view is None or self._view[0] != now:
            self._view = (now, self._build(now))
        return self._view[1]

    def _build(self, now: int) -> dict[str, Any]:
        by_sec = {s.sec: s for s in self._slots if now - SECONDS < s.sec < now}
        backends: dict[str, int] = {}
        reasons: dict[str, int] = {}
        ttft: dict[str, list[float]] = {}
        throughput: list[int] = []
        ttft_p50: list[float | None] = []
        queue: list[int | None] = []
        depth: int | None = None  # carried through seconds in which the queue did not move
        for sec in range(now - SECONDS + 1, now):
            slot = by_sec.get(sec)
            if slot is None:  # nothing happened that second
                throughput.append(0)
                ttft_p50.append(None)
                queue.append(depth)
                continue
            every = sorted(v for samples in slot.ttft.values() for v in samples)
            throughput.append(slot.answered)
            ttft_p50.append(round(_percentile(every, 0.5), 4) if every else None)
            queue.append(slot.queue_max)
            depth = slot.queue_end
            if sec < now - WINDOW:
                continue
            for name, n in slot.backends.items():
                backends[name] = backends.get(name, 0) + n
            for name, n in slot.reasons.items():
                reasons[name] = reasons.get(name, 0) + n
            for name, samples in slot.ttft.items():
                ttft.setdefault(name, []).extend(samples)
        per_backend: dict[str, dict[str, float | None]] = {}
        for name in backends.keys() | ttft.keys():
            samples = sorted(ttft.get(name, ()))
            per_backend[name] = {
                "rps": round(backends.get(name, 0) / WINDOW, 3),
                "ttft_p50": round(_percentile(samples, 0.5), 4) if samples else None,
                "ttft_p99": round(_percentile(samples, 0.99), 4) if samples else None,
                "ttft_samples": len(samples),
            }
        return {
            "window_seconds": WINDOW,
            "backends": per_backend,
            "reasons": {name: round(n / WINDOW, 3) for name, n in sorted(reasons.items())},
            "queue_now": self._queue,
            "series": {"throughput": throughput, "ttft_p50": ttft_p50, "queue": queue},
        }
