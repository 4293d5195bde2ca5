"""A Kubernetes watch flooded with bookmarks (issue 46, case 20).

82,000 bookmarks back to back froze discovery behind them for about 69 minutes (each paced at
20 a second), while every one of them told `/readyz` the source was in sync. A bookmark with
more of the stream already arrived behind it is superseded (only the latest version matters):
it is skipped, and it is no sign of being in sync. The real client library against the fake API
server (tests/support/fake_kube.py), in process, as tests/discovery/test_hostile.py runs them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.discovery.test_hostile import PORTS, source
from tests.support.fake_kube import FakeKube, endpoint
from tests.support.harness import free_port
from tests.support.wait import wait_for_async

FIRST = "vllm-10.0.0.1-8000"
SECOND = "vllm-10.0.0.2-8000"


@pytest.fixture
def flooding() -> Iterator[FakeKube]:
    """A fake of its own: a flood is set per test."""
    fk = FakeKube(free_port(), bookmark_every=0.2)
    try:
        yield fk
    finally:
        fk.close()


def test_a_change_behind_a_bookmark_flood_is_applied_within_the_idle_timeout(
    flooding: FakeKube, tmp_path: Path
) -> None:
    """Paced, 20,000 bookmarks held the change behind them for 1,000 s. Skipped, it comes
    within `watch_idle_timeout` (by then a backlog that had not ended would restart the watch
    past it)."""
    flood = 20_000
    idle = 10.0
    flooding.put_slice("s1", [endpoint("10.0.0.1")], PORTS)

    async def run() -> None:
        async with source(flooding, tmp_path, watch_idle_timeout=idle, backoff_max=0.5) as r:
            await wait_for_async(lambda: r.names == {FIRST}, "the first endpoint")
            applied = r.events.seen.count("bookmark")
            flooding.bookmark_flood = flood
            flooding.drop_watches()  # the next watch: the flood, then the change
            flooding.put_slice("s2", [endpoint("10.0.0.2")], PORTS)
            await wait_for_async(lambda: r.names == {FIRST, SECOND}, "the change behind", idle)
            superseded = r.events.seen.count("bookmark_superseded")
            # Skipped: none of them marked the source in sync, or counted as a bookmark.
            assert r.events.seen.count("bookmark") - applied < flood / 100
            assert superseded > flood / 2, superseded
            assert "bookmark_flood" in r.events.seen
            assert not r.src.rec.stale

    asyncio.run(run())


def test_a_backlog_of_bookmarks_that_does_not_end_shows_stale(
    flooding: FakeKube, tmp_path: Path
) -> None:
    """Each watch opens with more bookmarks than can be read through within the idle timeout
    (a server that never catches up): superseded bookmarks are no sign of life, so the source
    shows stale (before, each one said it was in sync), and is fresh again once it stops."""
    idle = 0.2
    flooding.bookmark_every = idle / 4  # once the flood stops, the watch is never idle
    flooding.put_slice("s1", [endpoint("10.0.0.1")], PORTS)

    async def run() -> None:
        async with source(flooding, tmp_path, watch_idle_timeout=idle, backoff_max=0.5) as r:
            await wait_for_async(lambda: r.names == {FIRST}, "the first endpoint")
            assert not r.src.rec.stale
            flooding.bookmark_flood = 200_000
            flooding.drop_watches()
            await wait_for_async(
                lambda: r.src.rec.error == f"no watch event for {idle:g}s", "stale", 30
            )
            assert r.src.rec.stale
            assert r.names == {FIRST}  # the last set stays
            flooding.bookmark_flood = 0
            await wait_for_async(lambda: not r.src.rec.stale, "fresh after the flood", 30)

    asyncio.run(run())
