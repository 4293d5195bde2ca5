"""How many batch lines may run: none while an interactive request queues, `per_engine` for each
engine whose reading shows room, at most `max_inflight` (router/batch/runner.py's `room`)."""

from __future__ import annotations

from router.batch.runner import room
from router.core.backend import Backend
from router.core.engine import EngineReading
from router.core.settings import BackendConfig, BatchConfig

CFG = BatchConfig(storage_dir="/unused", per_engine=3, max_inflight=8, room_kv_usage=0.8)
FLEET = [
    Backend.from_config(BackendConfig(name=n, url=f"http://127.0.0.1:{p}", models=["m"]))
    for n, p in (("a", 1), ("b", 2), ("c", 3))
]


def reading(waiting: float = 0, kv: float = 0.1, stale: bool = False) -> EngineReading:
    return EngineReading(waiting, 1, kv, None, None, 1.0, 1, stale)


def test_an_interactive_request_waiting_stops_every_new_line() -> None:
    assert room(CFG, FLEET, {}, queued=1) == 0


def test_only_engines_whose_readings_show_room_take_lines() -> None:
    busy = {"a": reading(waiting=2), "b": reading(kv=0.9), "c": reading()}
    assert room(CFG, FLEET, busy, queued=0) == 3
    full = {"a": reading(waiting=2), "b": reading(kv=0.9), "c": reading(waiting=1)}
    assert room(CFG, FLEET, full, queued=0) == 0


def test_an_engine_without_a_fresh_reading_counts_as_room_within_max_inflight() -> None:
    stale = {"a": reading(waiting=9, stale=True)}
    assert room(CFG, FLEET, stale, queued=0) == 8  # 3 x 3 engines, capped at max_inflight
