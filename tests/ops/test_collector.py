"""The app takes its startup heap out of the garbage collector's walk before it serves, and
collects young objects in batches (router/ops/collector.py): what keeps a full collection of
a router holding 50,000 discovered backends to tens of ms instead of hundreds."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import yaml

from router.app import create_app
from router.core.settings import load_settings
from router.ops.collector import YOUNG


def test_the_app_freezes_its_startup_heap_and_batches_young_collections(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump({"backends": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}]})
    )
    app = create_app(load_settings(config)).app  # the FastAPI app behind the fast path
    before = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, *before[1:])
    try:

        async def run() -> None:
            async with app.router.lifespan_context(app):
                # The modules, classes and functions loaded by now: tens of thousands.
                assert gc.get_freeze_count() > 10_000
                assert gc.get_threshold()[0] == YOUNG
                made = [[i] for i in range(1000)]  # objects made later are not frozen
                frozen = gc.get_freeze_count()
                assert all(gc.is_tracked(x) for x in made)
                gc.collect()
                assert gc.get_freeze_count() == frozen

        asyncio.run(run())
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
